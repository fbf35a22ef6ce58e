"""Orbax checkpoints of a run: train, eval and generate all load runs here.

`writer.Checkpoints` saves and resumes training (checksummed steps, retention, quarantine of
corrupt steps); `reader` lists kept steps and restores a step's config or parameters into any
mesh (evaluation loads parameters only, straight into the evaluating process's shardings,
whatever mesh the run was trained on); `store` holds the Orbax manager both use."""

from effattn_jax.checkpoint.reader import (
    kept_steps,
    load_params,
    load_run_config,
    restore_config,
    saved_config,
    select_steps,
)
from effattn_jax.checkpoint.store import CheckpointError, SaveError, check_writable, manager, sync
from effattn_jax.checkpoint.writer import Checkpoints

__all__ = [
    "CheckpointError",
    "Checkpoints",
    "SaveError",
    "check_writable",
    "kept_steps",
    "load_params",
    "load_run_config",
    "manager",
    "restore_config",
    "saved_config",
    "select_steps",
    "sync",
]
