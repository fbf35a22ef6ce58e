"""What a run directory records of each launch, beside its checkpoints: the resolved config and
where it ran (command line, git commit, package versions, devices). Written by training and by
`convert from-hf`, which both start runs."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path

import jax

from effattn_jax import storage
from effattn_jax.config import Config, to_yaml
from effattn_jax.storage import AnyPath

PACKAGES = (
    "jax",
    "jaxlib",
    "flax",
    "optax",
    "orbax-checkpoint",
    "grain",
    "tensorboard",
    "numpy",
    "tokenizers",
)


def git_commit() -> str:
    """The checkout's HEAD commit, or "unknown" outside a git checkout."""
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            cwd=Path(__file__).parent,
            capture_output=True,
            text=True,
            timeout=10,
        )
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"


def _versions() -> dict[str, str]:
    out = {}
    for p in PACKAGES:
        try:
            out[p] = metadata.version(p)
        except metadata.PackageNotFoundError:
            out[p] = "not installed"
    return out


def record_provenance(run_dir: AnyPath, cfg: Config) -> None:
    """Resolved config (config.yaml, written once per launch) and one line per launch in
    launches.jsonl, rewritten whole (an object store has no append)."""
    storage.write_atomic(run_dir / "config.yaml", to_yaml(cfg))
    entry = {
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "argv": sys.argv,
        "git_commit": git_commit(),
        "packages": _versions(),
        "devices": [str(d) for d in jax.devices()],
        "process_count": jax.process_count(),
    }
    launches = run_dir / "launches.jsonl"
    before = storage.read_text(launches) if launches.exists() else ""
    storage.write_atomic(launches, before + json.dumps(entry) + "\n")
