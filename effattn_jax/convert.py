"""Hugging Face checkpoints into runs of this project.

    python -m effattn_jax.convert from-hf --model DIR --out RUN_DIR [key=value ...]

reads a Hugging Face model directory (`config.json`, `*.safetensors` with or without an index,
`tokenizer.json`) and writes a run directory whose step-0 checkpoint train.py, `python -m eval`
and `effattn_jax.generate` use like any other (and `train.init_from=RUN_DIR` starts new runs
from). The config is derived from `config.json` (the `key=value` overrides come after, e.g.
`data.seq_len=2048`); the tokenizer is copied into the run and recorded as `data.tokenizer`, so
data preparation, eval and generation tokenize the same way. Weights stream tensor by tensor
into their shardings. Families: Llama and Mistral (dense attention, no RoPE scaling, no sliding
window). Anything else is refused in one line, exit 2, nothing written.
"""

from __future__ import annotations

import json
import shutil
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import jax
import numpy as np

from effattn_jax.cli import ArgumentParser

ARCHITECTURES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral"}
IGNORED = (".rotary_emb.inv_freq",)  # buffers some checkpoints carry; recomputed here


class ConvertError(ValueError):
    """A model directory this cannot convert; the message is one line."""


def read_hf_config(model_dir: Path) -> dict:
    try:
        hf = json.loads((model_dir / "config.json").read_text())
    except FileNotFoundError:
        raise ConvertError(f"{model_dir}: no config.json; not a Hugging Face model directory") from None
    except ValueError as e:
        raise ConvertError(f"{model_dir / 'config.json'}: not JSON ({e})") from None
    arch = (hf.get("architectures") or ["<none>"])[0]
    if arch not in ARCHITECTURES:
        raise ConvertError(
            f"{model_dir}: architecture {arch!r} is not one this converts ({', '.join(ARCHITECTURES)})"
        )
    return hf


def config_overrides(hf: dict, model_dir: Path) -> dict:
    """This project's config keys for a Hugging Face `config.json` (Llama / Mistral)."""
    rope = hf.get("rope_parameters") or {}
    theta = hf.get("rope_theta", rope.get("rope_theta", 10000.0))
    scaling = hf.get("rope_scaling") or ({} if rope.get("rope_type", "default") == "default" else rope)
    window = hf.get("sliding_window") or 0
    unsupported = {
        "rope scaling": scaling and scaling.get("rope_type", scaling.get("type")),
        "attention biases": hf.get("attention_bias"),
        "MLP biases": hf.get("mlp_bias"),
        "a sliding window": 0 < window < hf["max_position_embeddings"],
        f"activation {hf.get('hidden_act')!r}": hf.get("hidden_act", "silu") != "silu",
    }
    if found := [what for what, present in unsupported.items() if present]:
        raise ConvertError(f"{model_dir}: {', '.join(found)}: not converted yet")
    heads = hf["num_attention_heads"]
    return {
        "model.vocab_size": hf["vocab_size"],
        "model.d_model": hf["hidden_size"],
        "model.num_layers": hf["num_hidden_layers"],
        "model.num_heads": heads,
        "model.num_kv_heads": hf.get("num_key_value_heads") or heads,
        "model.head_dim": hf.get("head_dim") or hf["hidden_size"] // heads,
        "model.mlp_dim": hf["intermediate_size"],
        "model.tie_embeddings": bool(hf.get("tie_word_embeddings", False)),
        "model.rope_theta": float(theta),
        "model.norm_eps": float(hf.get("rms_norm_eps", 1e-6)),
        "attention.kind": "mha",
        "attention.core": "dense",
        "data.seq_len": hf["max_position_embeddings"],
    }


def _weight_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        paths = [model_dir / f for f in files]
    else:
        paths = sorted(model_dir.glob("*.safetensors"))
    if not paths:
        raise ConvertError(f"{model_dir}: no *.safetensors weights")
    if missing := [p.name for p in paths if not p.exists()]:
        raise ConvertError(f"{model_dir}: {missing[0]} is missing (named by the index)")
    return paths


def _tensors(model_dir: Path) -> Iterator[tuple[str, np.ndarray]]:
    """(name, float32 array) of every tensor, one at a time (bf16 and fp16 widened)."""
    from safetensors import safe_open

    for path in _weight_files(model_dir):
        with safe_open(str(path), framework="flax") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                yield name, np.asarray(f.get_tensor(name), np.float32)


def _target(name: str, hf: dict) -> tuple[tuple[str, ...], Callable[[np.ndarray], np.ndarray]] | None:
    """Where a Llama-layout tensor goes in this model's parameters, and how it is laid out there
    (Hugging Face stores a linear layer as [out, in]; this model as [in, ...out])."""
    d, heads, head_dim = hf["hidden_size"], hf["num_attention_heads"], None
    head_dim = hf.get("head_dim") or d // heads
    kv = hf.get("num_key_value_heads") or heads
    if name == "model.embed_tokens.weight":
        return ("embed",), lambda w: w
    if name == "model.norm.weight":
        return ("final_norm", "scale"), lambda w: w
    if name == "lm_head.weight":
        return ("lm_head",), lambda w: w.T
    parts = name.split(".")
    if parts[:2] != ["model", "layers"] or len(parts) < 5:
        return None
    layer, rest = parts[2], ".".join(parts[3:])
    by_name = {
        "self_attn.q_proj.weight": (("attn", "q", "kernel"), lambda w: w.T.reshape(d, heads, head_dim)),
        "self_attn.k_proj.weight": (("attn", "k", "kernel"), lambda w: w.T.reshape(d, kv, head_dim)),
        "self_attn.v_proj.weight": (("attn", "v", "kernel"), lambda w: w.T.reshape(d, kv, head_dim)),
        "self_attn.o_proj.weight": (("attn", "o", "kernel"), lambda w: w.T.reshape(heads, head_dim, d)),
        "mlp.gate_proj.weight": (("mlp", "gate", "kernel"), lambda w: w.T),
        "mlp.up_proj.weight": (("mlp", "up", "kernel"), lambda w: w.T),
        "mlp.down_proj.weight": (("mlp", "down", "kernel"), lambda w: w.T),
        "input_layernorm.weight": (("attn_norm", "scale"), lambda w: w),
        "post_attention_layernorm.weight": (("mlp_norm", "scale"), lambda w: w),
    }
    if rest not in by_name:
        return None
    path, layout = by_name[rest]
    return ("blocks", layer, *path), layout


def load_weights(model_dir: Path, hf: dict, abstract: dict) -> dict:
    """The model's parameters, each tensor read, laid out and placed into its sharding in turn
    (host memory: one tensor at a time); ConvertError naming the first tensor that is unknown,
    missing or of the wrong shape for the config."""
    flat = {
        tuple(str(getattr(k, "key", k)) for k in path): leaf
        for path, leaf in jax.tree_util.tree_flatten_with_path(abstract)[0]
    }
    done = {}
    for name, array in _tensors(model_dir):
        if name.endswith(IGNORED):
            continue
        target = _target(name, hf)
        if target is None or target[0] not in flat:
            raise ConvertError(f"{model_dir}: tensor {name} is not one a {hf['architectures'][0]} has here")
        key, layout = target
        value, want = layout(array), flat[key]
        if value.shape != want.shape:
            raise ConvertError(
                f"{model_dir}: tensor {name} of shape {array.shape} does not match its config "
                f"(expected {want.shape} as {'/'.join(key)})"
            )
        done[key] = jax.device_put(value.astype(want.dtype), want.sharding)
    if missing := [k for k in flat if k not in done]:
        raise ConvertError(f"{model_dir}: no tensor for {'/'.join(missing[0])} ({len(missing)} missing)")
    return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(abstract), [done[k] for k in flat])


def check_tokenizer(model_dir: Path, vocab_size: int) -> Path:
    from effattn_jax.data.corpus import DataError
    from effattn_jax.data.tokenizer import load_tokenizer

    path = model_dir / "tokenizer.json"
    if not path.exists():
        raise ConvertError(f"{model_dir}: no tokenizer.json")
    try:
        tok, _, _ = load_tokenizer(str(path))
    except DataError as e:
        raise ConvertError(str(e)) from None
    if (n := tok.get_vocab_size(True)) > vocab_size:
        raise ConvertError(f"{path}: {n} tokens, more than the model's {vocab_size} vocabulary rows")
    return path


def from_hf(model_dir: str | Path, out: str | Path, overrides: list[str] = ()) -> Path:
    """Converts `model_dir` into the run directory `out` (step 0); returns it. Everything is
    checked (config, tokenizer, every tensor) before anything is written."""
    from effattn_jax import checkpoint
    from effattn_jax.config import load_config
    from effattn_jax.sharding import make_mesh
    from effattn_jax.train.loop import record_provenance
    from effattn_jax.train.run_dir import exclusive
    from effattn_jax.train.state import init_state, make_setup

    model_dir, out = Path(model_dir), Path(out).absolute()
    if out.exists() and any(out.iterdir()):
        raise ConvertError(f"--out={out}: not empty; convert into a new run directory")
    hf = read_hf_config(model_dir)
    keys = config_overrides(hf, model_dir) | {"train.run_dir": str(out)}
    keys["data.tokenizer"] = str(out / "tokenizer.json")
    cfg = load_config(None, [f"{k}={v}" for k, v in keys.items()] + list(overrides))
    source_tokenizer = check_tokenizer(model_dir, cfg.model.vocab_size)
    setup = make_setup(cfg, make_mesh(1, 1, 1, devices=jax.local_devices()[:1]))
    params = load_weights(model_dir, hf, setup.abstract_state["params"])
    out.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(source_tokenizer, out / "tokenizer.json")
    with exclusive(out):
        record_provenance(out, cfg)
        saver = checkpoint.Checkpoints(out, async_save=False)
        try:
            saver.save(0, init_state(setup, params), None, cfg.to_dict())
        finally:
            saver.close()
    return out


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(prog="python -m effattn_jax.convert", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("from-hf", help="a Hugging Face model directory -> a run directory")
    p.add_argument("--model", required=True, help="the Hugging Face model directory")
    p.add_argument("--out", required=True, help="the new run directory")
    p.add_argument("overrides", nargs="*", help="config overrides, key=value")
    args = parser.parse_args(argv)
    from effattn_jax.config import ConfigError

    try:
        out = from_hf(args.model, args.out, args.overrides)
    except (ConvertError, ConfigError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"converted {args.model} -> {out} (step 0)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
