"""Per-checkpoint result caches of the eval commands (curves over many checkpoints, and
reruns, evaluate only what is new). Loading runs is `effattn_jax.checkpoint.load_params`."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path


def cached(run_dir: str | Path, step: int, name: str, key: dict, compute: Callable[[], dict]) -> dict:
    """`compute()`'s result for (run, step, name, key), stored in <run>/eval/ and reused."""
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:12]
    path = Path(run_dir) / "eval" / f"{name}_step{step}_{digest}.json"
    if path.exists():
        return json.loads(path.read_text())
    result = compute()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(result, indent=1))
    tmp.rename(path)
    return result
