"""Where a run's checkpoints live and what both sides use: the Orbax manager of
`<run_dir>/checkpoints`, the error every reader raises, and the barrier of all processes."""

from __future__ import annotations

from pathlib import Path

import jax
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils


class CheckpointError(RuntimeError):
    pass


def manager(
    run_dir: str | Path, *, async_save: bool = True, read_only: bool = False
) -> ocp.CheckpointManager:
    """The Orbax manager of `<run_dir>/checkpoints`; retention is `Checkpoints`', not Orbax's."""
    options = ocp.CheckpointManagerOptions(
        max_to_keep=None, enable_async_checkpointing=async_save, create=not read_only, read_only=read_only
    )
    return ocp.CheckpointManager(Path(run_dir).absolute() / "checkpoints", options=options)


def sync(name: str) -> None:
    """A barrier of all processes (nothing with one)."""
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices(name)
