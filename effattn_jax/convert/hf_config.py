"""Hugging Face `config.json` <-> this project's config: the families converted, the keys each
maps to, what is refused, and the config an export declares."""

from __future__ import annotations

import json
from pathlib import Path

from effattn_jax.config import ModelConfig

ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",  # biases on q, k and v
    "Qwen3ForCausalLM": "qwen3",  # RMSNorm of each q and k head
    "DeepseekV2ForCausalLM": "deepseek",  # MLA; layers with a dense MLP only
    "DeepseekV3ForCausalLM": "deepseek",
    "DeepseekV32ForCausalLM": "deepseek",  # and DSA on every layer (`is_dsa`)
}

HF_CONFIG = "hf_config.json"  # a converted run's source config.json (its family, for to-hf)


class ConvertError(ValueError):
    """A model directory this cannot convert; the message is one line."""


# config.json's sizes this reads: every family's, then DeepSeek's (q_lora_rank may be null)
SIZE_KEYS = ("hidden_size", "num_attention_heads", "num_hidden_layers", "vocab_size", "intermediate_size",
             "max_position_embeddings")  # fmt: skip
MLA_SIZE_KEYS = ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
OPTIONAL_SIZE_KEYS = ("num_key_value_heads", "head_dim", "q_lora_rank")
DSA_SIZE_KEYS = ("index_n_heads", "index_head_dim", "index_topk", "q_lora_rank")  # its indexer reads c'


def read_hf_config(model_dir: Path) -> dict:
    if model_dir.exists() and not model_dir.is_dir():
        raise ConvertError(f"{model_dir}: a file; --model takes the model's directory (config.json, weights)")
    try:
        hf = json.loads((model_dir / "config.json").read_text())
    except FileNotFoundError:
        raise ConvertError(f"{model_dir}: no config.json; not a Hugging Face model directory") from None
    except ValueError as e:
        raise ConvertError(f"{model_dir / 'config.json'}: not JSON ({e})") from None
    if not isinstance(hf, dict):
        raise ConvertError(f"{model_dir / 'config.json'}: a JSON {type(hf).__name__}, not an object")
    arch = (hf.get("architectures") or ["<none>"])[0]
    if arch not in ARCHITECTURES:
        raise ConvertError(
            f"{model_dir}: architecture {arch!r} is not one this converts ({', '.join(ARCHITECTURES)})"
        )
    _check_sizes(hf, model_dir / "config.json")
    return hf


def _check_sizes(hf: dict, path: Path) -> None:
    """ConvertError, one line naming the key, where a size config.json must give is missing or not a
    positive integer (an interrupted download or a hand edit)."""
    required = (
        SIZE_KEYS
        + (MLA_SIZE_KEYS if family(hf) == "deepseek" else ())
        + (DSA_SIZE_KEYS if is_dsa(hf) else ())
    )
    for key in required + OPTIONAL_SIZE_KEYS:
        value = hf.get(key)
        if value is None and key in OPTIONAL_SIZE_KEYS and key not in required:
            continue
        if value is None:
            raise ConvertError(f"{path}: no {key!r}; a {hf['architectures'][0]} config needs it (an integer)")
        if (
            not isinstance(value, int)
            or isinstance(value, bool)
            or value < (0 if key in OPTIONAL_SIZE_KEYS else 1)
        ):
            raise ConvertError(f"{path}: {key} is {value!r}; a positive integer is wanted")


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
        "model.qkv_bias": family(hf) == "qwen2",
        "model.qk_norm": family(hf) == "qwen3",
        "attention.kind": "mha",
        "attention.core": "dense",
        "data.seq_len": hf["max_position_embeddings"],
    }
    if family(hf) == "deepseek":
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
    if is_dsa(hf):
        keys |= {
            "attention.core": "dsa",
            "dsa.index_n_heads": hf["index_n_heads"],
            "dsa.index_head_dim": hf["index_head_dim"],
            "dsa.index_topk": hf["index_topk"],
        }
    return keys | (_rope_keys(kind, scaling) if kind in ROPE_KEYS else {})


def _moe_layers(hf: dict) -> list[int]:
    """The DeepSeek layers whose MLP is a mixture of experts (first_k_dense_replace on)."""
    if family(hf) != "deepseek" or not hf.get("n_routed_experts"):
        return []
    if types := hf.get("mlp_layer_types"):  # DeepSeek-V3.2 names each layer's MLP
        return [i for i, kind in enumerate(types) if kind != "dense"]
    first, every = hf.get("first_k_dense_replace", 0), hf.get("moe_layer_freq", 1)
    return [i for i in range(hf["num_hidden_layers"]) if i >= first and i % every == 0]


# a RoPE rescaling's Hugging Face keys -> this project's model keys (both directions)
ROPE_KEYS = {
    "llama3": {
        "factor": "rope_scaling_factor",
        "original_max_position_embeddings": "rope_original_max_positions",
        "low_freq_factor": "rope_low_freq_factor",
        "high_freq_factor": "rope_high_freq_factor",
    },
    "yarn": {
        "factor": "rope_scaling_factor",
        "original_max_position_embeddings": "rope_original_max_positions",
        "beta_fast": "rope_beta_fast",
        "beta_slow": "rope_beta_slow",
        "mscale": "rope_mscale",
        "mscale_all_dim": "rope_mscale_all_dim",
    },
}


def _rope_keys(kind: str, scaling: dict) -> dict:
    """This project's keys of a Hugging Face RoPE rescaling (a key it leaves out: our default)."""
    defaults = ModelConfig()
    theirs = {hf_key: scaling.get(hf_key) for hf_key in ROPE_KEYS[kind]}
    return {"model.rope_scaling": kind} | {
        f"model.{ours}": getattr(defaults, ours) if theirs[hf_key] is None else theirs[hf_key]
        for hf_key, ours in ROPE_KEYS[kind].items()
    }


def family(hf: dict) -> str:
    return ARCHITECTURES[hf["architectures"][0]]


def is_dsa(hf: dict) -> bool:
    """DeepSeek-V3.2: MLA with DSA's indexer on every layer (attention.core=dsa)."""
    return hf["architectures"][0] == "DeepseekV32ForCausalLM"


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


DEEPSEEK_V32 = DEEPSEEK | {"architectures": ["DeepseekV32ForCausalLM"], "model_type": "deepseek_v32"}


def base_config(cfg, source: dict | None, mla: bool, dsa: bool = False) -> dict:
    """The family an export declares: the one it was converted from when its architecture still
    fits, else the one the model's architecture names (DeepSeek-V3.2 for MLA with DSA, DeepSeek-V2
    for MLA, Qwen3 with q/k norms, Qwen2 with q/k/v biases, else Llama)."""
    m = cfg.model
    if m.qkv_bias and m.qk_norm:
        raise ConvertError("model.qkv_bias with model.qk_norm: no Hugging Face family has both")
    want = "deepseek" if mla else "qwen3" if m.qk_norm else "qwen2" if m.qkv_bias else "llama"
    if source is not None and family(source).replace("mistral", "llama") == want and is_dsa(source) == dsa:
        return source
    if dsa:
        return DEEPSEEK_V32
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
    if ids := cfg.data.eos_ids:  # the model's own end-of-text ids (one, or a list of several)
        hf["eos_token_id"] = ids[0] if len(ids) == 1 else list(ids)
    if family(hf) == "deepseek":
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
        if "mlp_layer_types" in hf:
            hf["mlp_layer_types"] = ["dense"] * m.num_layers
    if is_dsa(hf):
        hf |= {
            "index_n_heads": cfg.dsa.index_n_heads,
            "index_head_dim": cfg.dsa.index_head_dim,
            "index_topk": cfg.dsa.index_topk,
            "layer_types": ["indexed_attention"] * m.num_layers,
        }
    scaling = {"rope_type": m.rope_scaling or "default"}
    scaling |= {hf_key: getattr(m, ours) for hf_key, ours in ROPE_KEYS.get(m.rope_scaling, {}).items()}
    if "rope_parameters" in hf:  # the newer layout (transformers 5)
        hf["rope_parameters"] = scaling | {"rope_theta": m.rope_theta}
    else:
        hf["rope_theta"] = m.rope_theta
        hf["rope_scaling"] = None if m.rope_scaling == "" else scaling
    return hf
