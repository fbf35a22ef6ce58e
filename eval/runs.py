"""What the eval commands share about runs: finding them (`--runs` globs), naming their
attention, counting their parameters, and per-checkpoint result caches (curves over many
checkpoints, and reruns, evaluate only what is new). Loading runs is
`effattn_jax.checkpoint.load_params`."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path

from effattn_jax import storage
from effattn_jax.config import Config


def cached(run_dir: str | Path, step: int, name: str, key: dict, compute: Callable[[], dict]) -> dict:
    """`compute()`'s result for (run, step, name, key), stored in <run>/eval/ and reused. In a
    multi-process run every process computes (its share), process 0 writes, all wait for it."""
    from effattn_jax.checkpoint import sync
    from eval.processes import writes

    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:12]
    path = storage.path(run_dir) / "eval" / f"{name}_step{step}_{digest}.json"
    if path.exists():
        return json.loads(storage.read_text(path))
    result = compute()
    if writes():
        path.parent.mkdir(parents=True, exist_ok=True)
        storage.write_atomic(path, json.dumps(result, indent=1))
    sync(f"cached-{path.name}")
    return result


def expand_runs(spec: str) -> list[Path]:
    """Comma-separated globs of run directories (local, or gs://) -> the run directories (sorted,
    each once)."""
    runs = sorted(
        {
            p
            for pattern in spec.split(",")
            for p in storage.glob(pattern.strip())
            if (p / "checkpoints").is_dir()
        },
        key=str,
    )
    if not runs:
        raise ValueError(f"--runs={spec!r}: matches no run directory (one with checkpoints/ inside)")
    return runs


def attention_label(cfg: Config) -> str:
    """The attention of a run in a few words: kind and core, hybrids, EG-MLA's table width and
    MLA's non-gating token table (`mla.token_table_dim`)."""
    specs = [cfg.layer_spec(i) for i in range(cfg.model.num_layers)]
    kinds = sorted({k for k, _ in specs})
    cores = [c for _, c in specs]
    kind = "+".join(kinds)
    if kinds == ["eg_mla"]:
        kind += f" emb{cfg.eg_mla.gate_dim}"
        if cfg.eg_mla.gate_at != "latent":  # the default goes unnamed
            kind += f" {cfg.eg_mla.gate_at}" + (
                f"{cfg.eg_mla.projected_dim}" if cfg.eg_mla.projected_dim else ""
            )
    if cfg.mla.token_table_dim and "mla" in kinds:  # EG-MLA's control: MLA plus a non-gating table
        kind += f" table{cfg.mla.token_table_dim}"
    if len(set(cores)) == 1:
        label = f"{kind} {cores[0]}"
    else:
        label = f"{kind} {'/'.join(f'{c}x{cores.count(c)}' for c in dict.fromkeys(cores))}"
    if cfg.full_attention_from_step:
        label += f" (dense from step {cfg.full_attention_from_step})"
    return label


def model_param_counts(cfg: Config) -> dict[str, int]:
    """`param_counts` of the model a config builds, without allocating it."""
    from flax import nnx

    from effattn_jax.model import Transformer, param_counts

    return param_counts(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0))))
