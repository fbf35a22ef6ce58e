"""Host memory of `python -m effattn_jax.convert from-hf` on a synthetic Llama checkpoint:

    python -m eval.bench.convert_memory [--shape llama-3.2-1b] [--dir /tmp/convert-bench] [--json]

writes a bf16 safetensors file of random weights in the shape of Llama 3.2 1B (1.24B parameters,
its 128,256 x 2,048 embedding the largest tensor), then converts it in a child process that
reports its resident memory after start-up and at its peak (VmRSS and VmHWM of /proc). On a CPU the "device"
is host memory, so the converted model's float32 parameters are resident by design; what the
streaming must bound is the rest:

    staging = peak - start-up - the model's float32 bytes

against 1.5 x the largest tensor (float32) + one layer (float32). Prints one line per figure and
`staging_gib=<x> bound_gib=<y> within=<true|false>`; `--json` prints {shape, params, file_gib,
start_gib, peak_gib, model_f32_gib, largest_f32_gib, layer_f32_gib, staging_gib, bound_gib, within}.
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np

from eval.bench import common

SHAPES = {
    "llama-3.2-1b": {
        "vocab_size": 128256,
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "max_position_embeddings": 2048,
        "tie_word_embeddings": True,
    },
    "tiny": {  # for a quick look at the script itself
        "vocab_size": 4096,
        "hidden_size": 256,
        "intermediate_size": 512,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "max_position_embeddings": 256,
        "tie_word_embeddings": True,
    },
}


def tensor_shapes(hf: dict) -> dict[str, tuple[int, ...]]:
    d, f, hd = hf["hidden_size"], hf["intermediate_size"], hf["head_dim"]
    q, kv = hf["num_attention_heads"] * hd, hf["num_key_value_heads"] * hd
    shapes = {"model.embed_tokens.weight": (hf["vocab_size"], d), "model.norm.weight": (d,)}
    for i in range(hf["num_hidden_layers"]):
        layer = {
            "self_attn.q_proj.weight": (q, d),
            "self_attn.k_proj.weight": (kv, d),
            "self_attn.v_proj.weight": (kv, d),
            "self_attn.o_proj.weight": (d, q),
            "mlp.gate_proj.weight": (f, d),
            "mlp.up_proj.weight": (f, d),
            "mlp.down_proj.weight": (d, f),
            "input_layernorm.weight": (d,),
            "post_attention_layernorm.weight": (d,),
        }
        shapes |= {f"model.layers.{i}.{k}": v for k, v in layer.items()}
    return shapes


def write_safetensors(path: Path, shapes: dict[str, tuple[int, ...]]) -> None:
    """A bf16 safetensors file written tensor by tensor (the format: a little-endian u64 header
    length, the JSON header, the raw bytes), so the writer never holds the model."""
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, shape in shapes.items():
        n = int(np.prod(shape)) * 2
        header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    rng = np.random.default_rng(0)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text)
        for shape in shapes.values():
            values = (rng.standard_normal(shape, np.float32) * 0.02).astype(np.float32)
            f.write((values.view(np.uint32) >> 16).astype(np.uint16).tobytes())  # bf16: the high half


def _child(model_dir: str, out: str) -> None:
    """The conversion, reporting its own resident memory (KiB) after start-up and at its peak."""
    import jax  # noqa: F401 - start-up includes jax and the project, as a user's process does

    from effattn_jax import convert

    start = common.resident_kib("VmRSS")
    convert.from_hf(model_dir, out)
    print(json.dumps({"start_kib": start, "peak_kib": common.resident_kib("VmHWM")}))


def main(argv: list[str] | None = None) -> int:
    p = common.parser(__doc__, __file__)
    p.add_argument("--shape", choices=SHAPES, default="llama-3.2-1b")
    p.add_argument("--dir", default="/tmp/effattn-convert-bench", help="where the synthetic model goes")
    p.add_argument("--child", nargs=2, help=common.HIDDEN)
    args = p.parse_args(argv)
    if args.child:
        _child(*args.child)
        return 0
    with common.report(args, f"convert from-hf, shape {args.shape}") as emit:
        return measure(args, emit)


def measure(args, emit) -> int:
    hf = SHAPES[args.shape]
    root = Path(args.dir)
    model, out = root / args.shape, root / f"{args.shape}-run"
    shapes = tensor_shapes(hf)
    if not (model / "model.safetensors").exists():
        model.mkdir(parents=True, exist_ok=True)
        write_safetensors(model / "model.safetensors", shapes)
        config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu"} | hf
        (model / "config.json").write_text(
            json.dumps(config | {"rms_norm_eps": 1e-5, "rope_theta": 500000.0})
        )
        _write_tokenizer(model / "tokenizer.json")
    subprocess.run(["rm", "-rf", str(out)], check=True)
    env = os.environ | {"JAX_PLATFORMS": "cpu"}
    child = [sys.executable, "-m", "eval.bench.convert_memory", "--child", str(model), str(out)]
    result = subprocess.run(child, capture_output=True, text=True, env=env, check=False)
    if result.returncode:
        print(result.stderr[-3000:], file=sys.stderr)
        return 1
    mem = json.loads(result.stdout.strip().splitlines()[-1])
    gib = lambda b: b / 2**30
    params = sum(int(np.prod(s)) for s in shapes.values())
    model_bytes = params * 4
    largest = max(int(np.prod(s)) for s in shapes.values()) * 4
    layer = sum(int(np.prod(s)) for n, s in shapes.items() if n.startswith("model.layers.0.")) * 4
    staging = mem["peak_kib"] * 1024 - mem["start_kib"] * 1024 - model_bytes
    bound = 1.5 * largest + layer
    figures = {"shape": args.shape, "params": params, "file_gib": gib(params * 2),
               "start_gib": gib(mem["start_kib"] * 1024), "peak_gib": gib(mem["peak_kib"] * 1024),
               "model_f32_gib": gib(model_bytes), "largest_f32_gib": gib(largest),
               "layer_f32_gib": gib(layer),
               "staging_gib": gib(staging), "bound_gib": gib(bound), "within": staging <= bound}  # fmt: skip
    f = figures
    print(f"shape={args.shape} params={params:,} file_gib={f['file_gib']:.2f}")
    print(f"start_gib={f['start_gib']:.2f} peak_gib={f['peak_gib']:.2f}")
    print(" ".join(f"{k}={f[k]:.2f}" for k in ("model_f32_gib", "largest_f32_gib", "layer_f32_gib")))
    print(
        f"staging_gib={f['staging_gib']:.2f} bound_gib={f['bound_gib']:.2f} within={str(f['within']).lower()}"
    )
    emit(figures)
    return 0


def _write_tokenizer(path: Path) -> None:
    """A tiny byte-level BPE (the conversion only checks it fits the vocabulary)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(["the of and to in a is that"] * 10, trainer)
    tok.save(str(path))


if __name__ == "__main__":
    sys.exit(main())
