"""Hugging Face checkpoints into runs of this project.

    python -m effattn_jax.convert from-hf --model DIR --out RUN_DIR [key=value ...]
    python -m effattn_jax.convert to-hf --run RUN_DIR [--step N] --out DIR

reads a Hugging Face model directory (`config.json`, `*.safetensors` with or without an index,
`tokenizer.json`) and writes a run directory whose step-0 checkpoint train.py, `python -m eval`
and `effattn_jax.generate` use like any other (and `train.init_from=RUN_DIR` starts new runs
from). The config is derived from `config.json` (the `key=value` overrides come after, e.g.
`data.seq_len=2048`); the tokenizer is copied into the run and recorded as `data.tokenizer`, so
data preparation, eval and generation tokenize the same way. Weights stream tensor by tensor
into their shardings. Families: Llama (with Llama 3's RoPE scaling), Mistral, Qwen2 (q/k/v
biases) and Qwen3 (q/k norms), without a sliding window. Anything else is refused in one line,
exit 2, nothing written.

`to-hf` writes a run's step back out: MHA/GQA models as Llama, Qwen2 or Qwen3 by their
architecture (or as the family they came from),
MoBA models as their dense architecture (the weights are the same), with a note; EG-MLA has no
Hugging Face equivalent and is refused.
"""

from __future__ import annotations

import json
import math
import shutil
import struct
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import jax
import numpy as np

from effattn_jax import storage
from effattn_jax.cli import ArgumentParser

ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",  # biases on q, k and v
    "Qwen3ForCausalLM": "qwen3",  # RMSNorm of each q and k head
    "DeepseekV2ForCausalLM": "deepseek",  # MLA; layers with a dense MLP only
    "DeepseekV3ForCausalLM": "deepseek",
}
IGNORED = (".rotary_emb.inv_freq",)  # buffers some checkpoints carry; recomputed here
HF_CONFIG = "hf_config.json"  # a converted run's source config.json (its family, for to-hf)


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
    """This project's config keys for a Hugging Face `config.json`."""
    rope = hf.get("rope_parameters") or {}  # transformers 5; older files: rope_theta, rope_scaling
    theta = hf.get("rope_theta", rope.get("rope_theta", 10000.0))
    scaling = hf.get("rope_scaling") or rope
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    window = (hf.get("sliding_window") or 0) if hf.get("use_sliding_window", True) else 0
    unsupported = {
        f"rope scaling {kind!r}": kind not in ("default", "llama3", "yarn"),
        "output projection biases": hf.get("attention_bias"),
        "MLP biases": hf.get("mlp_bias"),
        "a sliding window": 0 < window < hf["max_position_embeddings"],
        f"activation {hf.get('hidden_act')!r}": hf.get("hidden_act", "silu") != "silu",
    }
    if found := [what for what, present in unsupported.items() if present]:
        raise ConvertError(f"{model_dir}: {', '.join(found)}: not converted yet")
    if moe := _moe_layers(hf):
        raise ConvertError(
            f"{model_dir}: layers {moe[0]}-{moe[-1]} are mixture-of-experts layers "
            f"({len(moe)} of {hf['num_hidden_layers']}): only layers with a dense MLP convert"
        )
    heads = hf["num_attention_heads"]
    keys = {
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
        "model.qkv_bias": _family(hf) == "qwen2",
        "model.qk_norm": _family(hf) == "qwen3",
        "attention.kind": "mha",
        "attention.core": "dense",
        "data.seq_len": hf["max_position_embeddings"],
    }
    if _family(hf) == "deepseek":
        keys |= {
            "attention.kind": "mla",
            "model.num_kv_heads": 0,
            "model.head_dim": 0,
            "mla.kv_lora_rank": hf["kv_lora_rank"],
            "mla.q_lora_rank": hf.get("q_lora_rank") or 0,
            "mla.qk_nope_head_dim": hf["qk_nope_head_dim"],
            "mla.qk_rope_head_dim": hf["qk_rope_head_dim"],
            "mla.v_head_dim": hf["v_head_dim"],
        }
    rescaled = {"llama3": _llama3_rope, "yarn": _yarn_rope}.get(kind)
    return keys | (rescaled(scaling) if rescaled else {})


def _yarn_rope(scaling: dict) -> dict:
    return {
        "model.rope_scaling": "yarn",
        "model.rope_scaling_factor": float(scaling["factor"]),
        "model.rope_original_max_positions": int(scaling["original_max_position_embeddings"]),
        "model.rope_beta_fast": float(scaling.get("beta_fast") or 32.0),
        "model.rope_beta_slow": float(scaling.get("beta_slow") or 1.0),
        "model.rope_mscale": float(scaling.get("mscale") or 0.0),
        "model.rope_mscale_all_dim": float(scaling.get("mscale_all_dim") or 0.0),
    }


def _moe_layers(hf: dict) -> list[int]:
    """The DeepSeek layers whose MLP is a mixture of experts (first_k_dense_replace on)."""
    if _family(hf) != "deepseek" or not hf.get("n_routed_experts"):
        return []
    first, every = hf.get("first_k_dense_replace", 0), hf.get("moe_layer_freq", 1)
    return [i for i in range(hf["num_hidden_layers"]) if i >= first and i % every == 0]


def _llama3_rope(scaling: dict) -> dict:
    return {
        "model.rope_scaling": "llama3",
        "model.rope_scaling_factor": float(scaling["factor"]),
        "model.rope_low_freq_factor": float(scaling["low_freq_factor"]),
        "model.rope_high_freq_factor": float(scaling["high_freq_factor"]),
        "model.rope_original_max_positions": int(scaling["original_max_position_embeddings"]),
    }


def _family(hf: dict) -> str:
    return ARCHITECTURES[hf["architectures"][0]]


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
    """(name, float32 array) of every tensor, one at a time (bf16 and fp16 widened). The files are
    read, not memory-mapped: a mapping's pages would stay resident until the whole file is done.
    The format: a little-endian u64 header length, the JSON header, the tensors' bytes."""
    import ml_dtypes

    dtypes = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16}
    for path in _weight_files(model_dir):
        with open(path, "rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(size))
            header.pop("__metadata__", None)
            for name, entry in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0]):
                if entry["dtype"] not in dtypes:
                    raise ConvertError(f"{path}: tensor {name} is {entry['dtype']}; floating point expected")
                start, end = entry["data_offsets"]
                f.seek(8 + size + start)
                raw = np.frombuffer(f.read(end - start), dtypes[entry["dtype"]]).reshape(entry["shape"])
                yield name, raw.astype(np.float32)


def _layouts(hf: dict) -> dict[str, tuple[tuple[str, ...], Callable, Callable]]:
    """Hugging Face tensor name -> (this model's parameter path, to ours, back to theirs), for
    every tensor of a Llama-layout model. Hugging Face stores a linear layer as [out, in]; this
    model as [in, ...out]."""
    d, heads = hf["hidden_size"], hf["num_attention_heads"]
    head_dim = hf.get("head_dim") or d // heads
    kv = hf.get("num_key_value_heads") or heads
    same = lambda w: w
    t = lambda w: w.T
    split = lambda *shape: lambda w: w.T.reshape(*shape)
    split_bias = lambda *shape: lambda w: w.reshape(*shape)
    flat = lambda w: w.reshape(-1)
    merge_out = lambda w: w.reshape(d, -1).T  # [d, heads, head_dim] -> [heads * head_dim, d]
    merge_in = lambda w: w.reshape(-1, d).T  # [heads, head_dim, d] -> [d, heads * head_dim]
    per_layer = {
        "self_attn.q_proj.weight": (("attn", "q", "kernel"), split(d, heads, head_dim), merge_out),
        "self_attn.k_proj.weight": (("attn", "k", "kernel"), split(d, kv, head_dim), merge_out),
        "self_attn.v_proj.weight": (("attn", "v", "kernel"), split(d, kv, head_dim), merge_out),
        "self_attn.o_proj.weight": (("attn", "o", "kernel"), split(heads, head_dim, d), merge_in),
        "mlp.gate_proj.weight": (("mlp", "gate", "kernel"), t, t),
        "mlp.up_proj.weight": (("mlp", "up", "kernel"), t, t),
        "mlp.down_proj.weight": (("mlp", "down", "kernel"), t, t),
        "input_layernorm.weight": (("attn_norm", "scale"), same, same),
        "post_attention_layernorm.weight": (("mlp_norm", "scale"), same, same),
    }
    if _family(hf) == "qwen2":
        for proj, n in (("q", heads), ("k", kv), ("v", kv)):
            per_layer[f"self_attn.{proj}_proj.bias"] = (("attn", proj, "bias"), split_bias(n, head_dim), flat)
    if _family(hf) == "qwen3":
        for proj in ("q", "k"):
            per_layer[f"self_attn.{proj}_norm.weight"] = (("attn", f"{proj}_norm", "scale"), same, same)
    if _family(hf) == "deepseek":
        per_layer = {k: v for k, v in per_layer.items() if not k.startswith("self_attn.")} | _mla_layouts(hf)
    out = {
        "model.embed_tokens.weight": (("embed",), same, same),
        "model.norm.weight": (("final_norm", "scale"), same, same),
    }
    if not hf.get("tie_word_embeddings", False):
        out["lm_head.weight"] = (("lm_head",), t, t)
    for i in range(hf["num_hidden_layers"]):
        for name, (path, ours, theirs) in per_layer.items():
            out[f"model.layers.{i}.{name}"] = (("blocks", str(i), *path), ours, theirs)
    return out


def _mla_layouts(hf: dict) -> dict:
    """DeepSeek's MLA tensors (import only). Its RoPE rotates interleaved channel pairs (2i, 2i+1);
    this model rotates halves (i, i + d/2): the RoPE channels of q and k^R are reordered alike,
    which leaves every score unchanged. kv_a_proj_with_mqa (the latent and k^R) and kv_b_proj
    (W_UK and W_UV) are each split in two (`_split`)."""
    h, n, r, v = (
        hf[k] for k in ("num_attention_heads", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
    )
    halves = np.concatenate([np.arange(0, r, 2), np.arange(1, r, 2)])  # interleaved -> rotate-half
    q_order = np.concatenate([np.arange(n), n + halves])
    q = lambda w: w.reshape(h, n + r, -1)[:, q_order, :].transpose(2, 0, 1)  # [in, H, n + r]
    up = lambda w: w.transpose(2, 0, 1)  # [H, width, d_c] -> [d_c, H, width]
    t = lambda w: w.T
    out = {
        "self_attn.kv_a_proj_with_mqa.weight:latent": (("attn", "dkv", "kernel"), t, None),
        "self_attn.kv_a_proj_with_mqa.weight:rope": (("attn", "kr", "kernel"), lambda w: w[halves].T, None),
        "self_attn.kv_a_layernorm.weight": (("attn", "kv_norm", "scale"), lambda w: w, None),
        "self_attn.kv_b_proj.weight:k": (("attn", "uk", "kernel"), up, None),
        "self_attn.kv_b_proj.weight:v": (("attn", "uv", "kernel"), up, None),
        "self_attn.o_proj.weight": (("attn", "o", "kernel"), lambda w: w.T.reshape(h, v, -1), None),
    }
    if hf.get("q_lora_rank"):
        out |= {
            "self_attn.q_a_proj.weight": (("attn", "dq", "kernel"), t, None),
            "self_attn.q_a_layernorm.weight": (("attn", "q_norm", "scale"), lambda w: w, None),
            "self_attn.q_b_proj.weight": (("attn", "q", "kernel"), q, None),
        }
    else:
        out["self_attn.q_proj.weight"] = (("attn", "q", "kernel"), q, None)
    return out


def _mla_tensors(flat: dict, hf: dict) -> dict[str, np.ndarray]:
    """DeepSeek's attention tensors of this model's MLA parameters (the inverse of
    `_mla_layouts` and `_split`)."""
    n, r = hf["qk_nope_head_dim"], hf["qk_rope_head_dim"]
    interleaved = np.argsort(np.concatenate([np.arange(0, r, 2), np.arange(1, r, 2)]))
    q_order = np.concatenate([np.arange(n), n + interleaved])
    out = {}
    for i in range(hf["num_hidden_layers"]):
        p = lambda *path: np.asarray(flat[("blocks", str(i), "attn", *path)], np.float32)  # noqa: B023
        name = f"model.layers.{i}.self_attn."
        q = p("q", "kernel")  # [in, H, n + r]
        q = q.transpose(1, 2, 0)[:, q_order, :].reshape(-1, q.shape[0])
        if hf.get("q_lora_rank"):
            out[name + "q_a_proj.weight"] = p("dq", "kernel").T
            out[name + "q_a_layernorm.weight"] = p("q_norm", "scale")
            out[name + "q_b_proj.weight"] = q
        else:
            out[name + "q_proj.weight"] = q
        kr = p("kr", "kernel").T[interleaved]
        out[name + "kv_a_proj_with_mqa.weight"] = np.concatenate([p("dkv", "kernel").T, kr])
        out[name + "kv_a_layernorm.weight"] = p("kv_norm", "scale")
        uk, uv = p("uk", "kernel").transpose(1, 2, 0), p("uv", "kernel").transpose(1, 2, 0)  # [H, width, d_c]
        out[name + "kv_b_proj.weight"] = np.concatenate([uk, uv], axis=1).reshape(-1, uk.shape[-1])
        o = p("o", "kernel")  # [H, v, D]
        out[name + "o_proj.weight"] = o.reshape(-1, o.shape[-1]).T
    return {k: np.ascontiguousarray(v) for k, v in out.items()}


def _split(tensors: Iterator[tuple[str, np.ndarray]], hf: dict, model_dir: Path):
    """DeepSeek's fused tensors as the two parameters each holds (others unchanged)."""
    for name, array in tensors:
        if name.endswith("kv_a_proj_with_mqa.weight"):
            c = hf["kv_lora_rank"]
            yield f"{name}:latent", array[:c]
            yield f"{name}:rope", array[c:]
        elif name.endswith("kv_b_proj.weight"):
            h, n, v = hf["num_attention_heads"], hf["qk_nope_head_dim"], hf["v_head_dim"]
            if array.shape[0] != h * (n + v):
                raise ConvertError(
                    f"{model_dir}: tensor {name} of shape {array.shape} does not match its config "
                    f"({h} heads of {n} + {v} rows)"
                )
            heads = array.reshape(h, n + v, -1)
            yield f"{name}:k", heads[:, :n]
            yield f"{name}:v", heads[:, n:]
        else:
            yield name, array


def load_weights(model_dir: Path, hf: dict, abstract: dict) -> dict:
    """The model's parameters, each tensor read, laid out and placed into its sharding in turn
    (host memory: one tensor at a time); ConvertError naming the first tensor that is unknown,
    missing or of the wrong shape for the config."""
    flat = {
        tuple(str(getattr(k, "key", k)) for k in path): leaf
        for path, leaf in jax.tree_util.tree_flatten_with_path(abstract)[0]
    }
    layouts, done = _layouts(hf), {}
    for name, array in _split(_tensors(model_dir), hf, model_dir):
        if name.endswith(IGNORED):
            continue
        if name not in layouts or layouts[name][0] not in flat:
            raise ConvertError(f"{model_dir}: tensor {name} is not one a {hf['architectures'][0]} has here")
        key, layout, _ = layouts[name]
        value, want = layout(array), flat[key]
        if value.shape != want.shape:
            raise ConvertError(
                f"{model_dir}: tensor {name} of shape {array.shape} does not match its config "
                f"(expected {want.shape} as {'/'.join(key)})"
            )
        done[key] = jax.device_put(np.asarray(value, want.dtype), want.sharding)
        del array, value  # one tensor on the host at a time
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
    from effattn_jax.train.state import make_setup

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
    shutil.copyfile(model_dir / "config.json", out / HF_CONFIG)  # the family, for to-hf
    with exclusive(out):
        record_provenance(out, cfg)
        # at most the largest tensor in flight while saving (whole GB, as Orbax counts), so host
        # memory stays near the model's
        largest = max(leaf.nbytes for leaf in jax.tree.leaves(params))
        saver = checkpoint.Checkpoints(out, async_save=False, save_concurrent_gb=math.ceil(largest / 1e9))
        try:
            saver.save(0, {"params": params}, None, cfg.to_dict())  # no optimizer state: fresh on resume
        finally:
            saver.close()
    return out


LLAMA = {  # what an exported model that did not come from Hugging Face declares besides its sizes
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_act": "silu",
    "attention_bias": False,
    "mlp_bias": False,
    "initializer_range": 0.02,
    "torch_dtype": "float32",
}


QWEN = {  # the same, for a model of this project with q/k/v biases (Qwen2) or q/k norms (Qwen3)
    name: LLAMA | {"architectures": [arch], "model_type": name, "use_sliding_window": False}
    for arch, name in (("Qwen2ForCausalLM", "qwen2"), ("Qwen3ForCausalLM", "qwen3"))
}


DEEPSEEK = LLAMA | {  # an MLA model of this project, as DeepSeek-V2 (every MLP dense)
    "architectures": ["DeepseekV2ForCausalLM"],
    "model_type": "deepseek_v2",
    "n_routed_experts": 1,  # unused: first_k_dense_replace makes every layer dense
}


def _base_config(cfg, source: dict | None, mla: bool) -> dict:
    """The family an export declares: the one it was converted from when its architecture still
    fits, else the one the model's architecture names (DeepSeek-V2 for MLA, Qwen3 with q/k
    norms, Qwen2 with q/k/v biases, else Llama)."""
    m = cfg.model
    if m.qkv_bias and m.qk_norm:
        raise ConvertError("model.qkv_bias with model.qk_norm: no Hugging Face family has both")
    want = "deepseek" if mla else "qwen3" if m.qk_norm else "qwen2" if m.qkv_bias else "llama"
    if source is not None and _family(source).replace("mistral", "llama") == want:
        return source
    return {"deepseek": DEEPSEEK, **QWEN}.get(want, LLAMA)


def hf_config_of(cfg, base: dict) -> dict:
    """`config.json` of a run's model: its family's (`base`), with this model's sizes."""
    m = cfg.model
    hf = dict(base) | {
        "vocab_size": m.vocab_size,
        "hidden_size": m.d_model,
        "num_hidden_layers": m.num_layers,
        "num_attention_heads": m.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "intermediate_size": m.mlp_dim,
        "tie_word_embeddings": m.tie_embeddings,
        "rms_norm_eps": m.norm_eps,
        "max_position_embeddings": cfg.data.seq_len,
    }
    if _family(hf) == "deepseek":
        mla = cfg.mla
        hf |= {
            "kv_lora_rank": mla.kv_lora_rank,
            "q_lora_rank": mla.q_lora_rank or None,
            "qk_nope_head_dim": mla.qk_nope_head_dim,
            "qk_rope_head_dim": mla.qk_rope_head_dim,
            "v_head_dim": mla.v_head_dim,
            "head_dim": mla.qk_rope_head_dim,
            "num_key_value_heads": m.num_heads,
            "first_k_dense_replace": m.num_layers,  # every MLP dense
        }
    scaling = {"rope_type": "default"}
    if m.rope_scaling == "yarn":
        scaling = {
            "rope_type": "yarn",
            "factor": m.rope_scaling_factor,
            "original_max_position_embeddings": m.rope_original_max_positions,
            "beta_fast": m.rope_beta_fast,
            "beta_slow": m.rope_beta_slow,
            "mscale": m.rope_mscale,
            "mscale_all_dim": m.rope_mscale_all_dim,
        }
    if m.rope_scaling == "llama3":
        scaling = {
            "rope_type": "llama3",
            "factor": m.rope_scaling_factor,
            "low_freq_factor": m.rope_low_freq_factor,
            "high_freq_factor": m.rope_high_freq_factor,
            "original_max_position_embeddings": m.rope_original_max_positions,
        }
    if "rope_parameters" in hf:  # the newer layout (transformers 5)
        hf["rope_parameters"] = scaling | {"rope_theta": m.rope_theta}
    else:
        hf["rope_theta"] = m.rope_theta
        hf["rope_scaling"] = None if m.rope_scaling == "" else scaling
    return hf


def to_hf(run_dir: str | Path, out: str | Path, step: str = "latest") -> list[str]:
    """Writes a run's step as a Hugging Face model directory (safetensors, config.json, the
    tokenizer): MHA/GQA models as Llama, or as the family they were converted from. Returns
    notes for the user (MoBA is exported as its dense architecture)."""
    from safetensors.numpy import save_file

    from effattn_jax import checkpoint
    from effattn_jax.data.tokenizer import load_tokenizer

    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise ConvertError(f"--out={out}: not empty; export into a new directory")
    try:
        step = checkpoint.select_steps(run_dir, step)[0]
        cfg, _, params = checkpoint.load_params(run_dir, step)
    except checkpoint.CheckpointError as e:
        raise ConvertError(str(e)) from None
    specs = [cfg.layer_spec(i) for i in range(cfg.model.num_layers)]
    kinds = {kind for kind, _ in specs}
    if "eg_mla" in kinds:
        raise ConvertError(f"{run_dir}: EG-MLA has no Hugging Face equivalent; it is not exported")
    if len(kinds) > 1 or cfg.model.scan_layers:
        why = "layers of two attention kinds" if len(kinds) > 1 else "model.scan_layers=true"
        raise ConvertError(f"{run_dir}: {why}: not exported yet")
    source = storage.path(run_dir) / HF_CONFIG
    converted = json.loads(storage.read_text(source)) if source.exists() else None
    hf = hf_config_of(cfg, _base_config(cfg, converted, mla=kinds == {"mla"}))
    notes = []
    if moba := [i for i, (_, core) in enumerate(specs) if core == "moba"]:
        hf["effattn_moba"] = {"layers": moba, "block_size": cfg.moba.block_size, "top_k": cfg.moba.top_k}
        notes.append(
            "MoBA is an attention pattern the target library will not apply: the model is exported "
            "as its dense architecture (the weights are the same); its MoBA settings are in "
            "config.json's effattn_moba"
        )
    flat = {
        tuple(str(getattr(k, "key", k)) for k in path): leaf
        for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]
    }
    tensors = {
        name: np.ascontiguousarray(theirs(np.asarray(flat[key], np.float32)))
        for name, (key, _, theirs) in _layouts(hf).items()
        if theirs is not None
    }
    if _family(hf) == "deepseek":
        tensors |= _mla_tensors(flat, hf)
    _, _, tokenizer = load_tokenizer(cfg.data.tokenizer)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(hf, indent=2, sort_keys=True) + "\n")
    shutil.copyfile(tokenizer, out / "tokenizer.json")
    return notes


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(prog="python -m effattn_jax.convert", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("from-hf", help="a Hugging Face model directory -> a run directory")
    p.add_argument("--model", required=True, help="the Hugging Face model directory")
    p.add_argument("--out", required=True, help="the new run directory")
    p.add_argument("overrides", nargs="*", help="config overrides, key=value")
    p = sub.add_parser("to-hf", help="a run's checkpoint -> a Hugging Face model directory")
    p.add_argument("--run", required=True, help="the run directory")
    p.add_argument("--step", default="latest", help="a kept step (default: the newest)")
    p.add_argument("--out", required=True, help="the new model directory")
    args = parser.parse_args(argv)
    from effattn_jax.config import ConfigError
    from effattn_jax.data.corpus import DataError

    try:
        if args.command == "from-hf":
            out = from_hf(args.model, args.out, args.overrides)
            print(f"converted {args.model} -> {out} (step 0)")
        else:
            for note in to_hf(args.run, args.out, args.step):
                print(f"note: {note}", file=sys.stderr)
            print(f"exported {args.run} -> {args.out}")
    except (ConvertError, ConfigError, DataError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
