"""A Hugging Face model directory into a run directory and back."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import jax
import numpy as np
from tokenizers import Tokenizer

from effattn_jax import storage
from effattn_jax.convert.eos import declared_eos_ids
from effattn_jax.convert.hf_config import (
    HF_CONFIG,
    ConvertError,
    base_config,
    config_overrides,
    family,
    hf_config_of,
    read_hf_config,
)
from effattn_jax.convert.weights import (
    Unstacked,
    layouts,
    load_weights,
    mla_tensors,
    stacked_layers,
    write_safetensors,
)
from effattn_jax.sharding import leaves_by_path


def check_tokenizer(model_dir: Path, vocab_size: int) -> tuple[Path, list[int]]:
    """The model's tokenizer.json and its end-of-text ids (declared by the model's own files,
    convert/eos.py; [] for the tokenizer's own, which it must then have)."""
    from effattn_jax.data.corpus import DataError
    from effattn_jax.data.tokenizer import load_tokenizer

    path = model_dir / "tokenizer.json"
    if not path.is_file():
        raise ConvertError(f"{model_dir}: no tokenizer.json")
    try:
        tok, _, _ = load_tokenizer(str(path))  # a tokenizers file at all (the EOS: below)
    except DataError as e:
        if "no end-of-text token" not in str(e):
            raise ConvertError(str(e)) from None
        tok = Tokenizer.from_file(str(path))
    if not (eos_ids := declared_eos_ids(model_dir, tok)):
        try:
            load_tokenizer(str(path))
        except DataError as e:
            raise ConvertError(f"{e}; nor does the model declare one (eos_token_id, eos_token)") from None
    if (n := tok.get_vocab_size(True)) > vocab_size:
        raise ConvertError(f"{path}: {n} tokens, more than the model's {vocab_size} vocabulary rows")
    return path, eos_ids


def check_out(out, what: str) -> None:
    """--out must be a new or empty directory."""
    if out.exists() and not out.is_dir():
        raise ConvertError(f"--out={out}: a file, not a directory; {what}")
    if out.exists() and any(out.iterdir()):
        raise ConvertError(f"--out={out}: not empty; {what}")


def make_out(out) -> None:
    """Creates --out, once everything else is checked; one line when it cannot be created or
    written (a read-only file system, a file in the way), and no directory left behind."""
    from effattn_jax.checkpoint.store import unwritable

    existed = out.exists()
    if why := unwritable(out):
        if not existed and out.exists():
            shutil.rmtree(out, ignore_errors=True)
        raise ConvertError(f"--out={out}: cannot be written ({why})")


def check_fixed_keys(keys: dict, overrides, model_dir: Path) -> None:
    """ConvertError, one line, where an override changes what the checkpoint fixes: its sizes, its
    attention kind and RoPE (`config_overrides`' model.*, mla.* and attention.kind keys) and DSA's
    indexer widths; the core, the indexer's top-k, data, training and everything else stay the
    user's."""
    shaped = ("model.", "mla.", "dsa.index_n_heads", "dsa.index_head_dim")  # the weights' shapes
    fixed = sorted(k for k in keys if k.startswith(shaped) or k == "attention.kind")
    for override in overrides:
        key, _, value = override.partition("=")
        if key in fixed and value != str(keys[key]):
            raise ConvertError(
                f"{key}={value}: {model_dir}/config.json fixes it ({keys[key]}); the checkpoint fixes "
                f"{', '.join(fixed)}"
            )


def from_hf(model_dir: str | Path, out: str | Path, overrides: list[str] = ()) -> storage.AnyPath:
    """Converts `model_dir` into the run directory `out` (step 0); returns it. Everything is
    checked (config, tokenizer, every tensor) before anything is written."""
    from effattn_jax import checkpoint
    from effattn_jax.config import load_config
    from effattn_jax.sharding import make_mesh
    from effattn_jax.train.provenance import record_provenance
    from effattn_jax.train.run_dir import exclusive
    from effattn_jax.train.state import make_setup

    if why := storage.unreachable(out):
        raise ConvertError(f"--out={out}: {why}")
    model_dir, out = Path(model_dir), storage.path(out)
    check_out(out, "convert into a new run directory")
    hf = read_hf_config(model_dir)
    keys = config_overrides(hf, model_dir) | {"train.run_dir": str(out)}
    keys["data.tokenizer"] = str(out / "tokenizer.json")
    source_tokenizer, keys["data.eos_ids"] = check_tokenizer(model_dir, keys["model.vocab_size"])
    check_fixed_keys(keys, overrides, model_dir)
    cfg = load_config(None, [f"{k}={v}" for k, v in keys.items()] + list(overrides))
    setup = make_setup(cfg, make_mesh(1, 1, 1, devices=jax.local_devices()[:1]))
    params = load_weights(model_dir, hf, setup.abstract_state["params"], stacked_layers(cfg))
    make_out(out)
    storage.copy_file(source_tokenizer, out / "tokenizer.json")
    storage.copy_file(model_dir / "config.json", out / HF_CONFIG)  # the family, for to-hf
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


def to_hf(run_dir: str | Path, out: str | Path, step: str = "latest") -> list[str]:
    """Writes a run's step as a Hugging Face model directory (safetensors, config.json, the
    tokenizer): MHA/GQA models as Llama, or as the family they were converted from. Host
    memory: one tensor at a time (a stacked layer's sliced out of its stack). Returns notes for
    the user (MoBA is exported as its dense architecture)."""
    from effattn_jax import checkpoint
    from effattn_jax.data.tokenizer import load_tokenizer

    out = Path(out)
    check_out(out, "export into a new directory")
    if why := storage.unreachable(run_dir):
        raise ConvertError(f"--run={run_dir}: {why}")
    try:
        step = checkpoint.select_steps(run_dir, step, allow_all=False)[0]
        cfg, _, params = checkpoint.load_params(run_dir, step)
    except checkpoint.CheckpointError as e:
        raise ConvertError(str(e)) from None
    specs = [cfg.layer_spec(i) for i in range(cfg.model.num_layers)]
    kinds = {kind for kind, _ in specs}
    if "eg_mla" in kinds:
        raise ConvertError(f"{run_dir}: EG-MLA has no Hugging Face equivalent; it is not exported")
    if len(kinds) > 1:
        raise ConvertError(f"{run_dir}: layers of two attention kinds: not exported yet")
    dsa = [core == "dsa" for _, core in specs]
    if any(dsa) and not (all(dsa) and kinds == {"mla"} and cfg.mla.q_lora_rank):
        raise ConvertError(
            f"{run_dir}: DSA exports as DeepSeek-V3.2, which runs it on every layer of MLA with a query "
            "latent (attention.kind=mla, mla.q_lora_rank > 0); this model's DSA layers are not that"
        )
    if cfg.mla.token_table_dim and "mla" in kinds:
        raise ConvertError(
            f"{run_dir}: mla.token_table_dim has no Hugging Face equivalent; it is not exported"
        )
    source = storage.path(run_dir) / HF_CONFIG
    converted = json.loads(storage.read_text(source)) if source.exists() else None
    hf = hf_config_of(cfg, base_config(cfg, converted, mla=kinds == {"mla"}, dsa=all(dsa)))
    notes = []
    if moba := [i for i, (_, core) in enumerate(specs) if core == "moba"]:
        hf["effattn_moba"] = {"layers": moba, "block_size": cfg.moba.block_size, "top_k": cfg.moba.top_k}
        notes.append(
            "MoBA is an attention pattern the target library will not apply: the model is exported "
            "as its dense architecture (the weights are the same); its MoBA settings are in "
            "config.json's effattn_moba"
        )
    flat = Unstacked(leaves_by_path(params), stacked_layers(cfg))  # a layer sliced out at a time

    def tensors():  # one at a time, from the parameters on their devices
        for name, (key, _, theirs) in layouts(hf).items():
            if theirs is not None:
                yield name, theirs(np.asarray(flat[key], np.float32))
        if family(hf) == "deepseek":
            yield from mla_tensors(flat, hf)

    _, _, tokenizer = load_tokenizer(cfg.data.tokenizer, cfg.data.eos_ids)
    make_out(out)
    write_safetensors(out / "model.safetensors", tensors(), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(hf, indent=2, sort_keys=True) + "\n")
    shutil.copyfile(tokenizer, out / "tokenizer.json")
    return notes
