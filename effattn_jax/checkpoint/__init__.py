"""Orbax checkpoints of a run: train, eval and generate all load runs here.

`writer.Checkpoints` saves and resumes training (checksummed steps, retention, quarantine of
corrupt steps); `reader` lists kept steps and restores a step's config or parameters into any
mesh (evaluation loads parameters only, straight into the evaluating process's shardings,
whatever mesh the run was trained on); `store` holds the Orbax manager both use."""

from effattn_jax.checkpoint.reader import (
    init_source,
    kept_steps,
    load_params,
    load_run_config,
    restore_config,
    restore_params,
    saved_config,
    saved_params,
    select_steps,
    shape_changes,
)
from effattn_jax.checkpoint.store import CheckpointError, SaveError, check_writable, manager, sync
from effattn_jax.checkpoint.writer import Checkpoints

__all__ = [
    "CheckpointError",
    "Checkpoints",
    "SaveError",
    "check_writable",
    "init_source",
    "kept_steps",
    "load_params",
    "load_run_config",
    "manager",
    "restore_config",
    "restore_params",
    "saved_config",
    "saved_params",
    "select_steps",
    "shape_changes",
    "sync",
]
