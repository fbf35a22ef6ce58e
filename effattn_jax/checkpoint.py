"""Orbax checkpoints of a run: train state, Grain iterator state and the resolved
config, in `<run_dir>/checkpoints/<step>/`. Train, eval and generate all load runs here.

Orbax writes each step to a temporary directory and renames it when complete,
so a save cut short (even by kill -9) is never listed. A committed step that
fails to restore (corrupt or truncated files) is reported and skipped in favour
of the previous one; it is never loaded.
"""

from __future__ import annotations

import sys
from pathlib import Path

import grain
import orbax.checkpoint as ocp


class CheckpointError(RuntimeError):
    pass


def manager(
    run_dir: str | Path,
    *,
    keep_last: int = 2,
    keep_every: int = 0,
    async_save: bool = True,
    read_only: bool = False,
) -> ocp.CheckpointManager:
    options = ocp.CheckpointManagerOptions(
        max_to_keep=keep_last,
        keep_period=keep_every or None,
        enable_async_checkpointing=async_save,
        create=not read_only,
        read_only=read_only,
    )
    return ocp.CheckpointManager(Path(run_dir).absolute() / "checkpoints", options=options)


def save(
    mngr: ocp.CheckpointManager, step: int, state, data_iter, config: dict, *, force: bool = False
) -> None:
    args = {"state": ocp.args.StandardSave(state), "config": ocp.args.JsonSave(config)}
    if data_iter is not None:
        args["data"] = grain.checkpoint.CheckpointSave(data_iter)
    mngr.save(step, args=ocp.args.Composite(**args), force=force)


def restore_latest(mngr: ocp.CheckpointManager, abstract_state, data_iter=None):
    """(step, state) from the newest checkpoint that restores cleanly, restoring `data_iter` in
    place; (None, None) when the run has no checkpoint."""
    steps = sorted(mngr.all_steps(), reverse=True)
    errors = []
    for step in steps:
        args = {"state": ocp.args.StandardRestore(abstract_state)}
        if data_iter is not None:
            args["data"] = grain.checkpoint.CheckpointRestore(data_iter)
        try:
            restored = mngr.restore(step, args=ocp.args.Composite(**args))
        except Exception as e:  # noqa: BLE001 - any failure means this step is unusable
            msg = (
                f"checkpoint step {step} in {mngr.directory} is corrupt or incomplete, skipped: "
                f"{type(e).__name__}: {e}"
            )
            print(msg.splitlines()[0][:300], file=sys.stderr)
            errors.append(step)
            continue
        return step, restored["state"]
    if errors:
        raise CheckpointError(f"no checkpoint in {mngr.directory} could be restored (tried steps {errors})")
    return None, None


def restore_config(run_dir: str | Path) -> dict:
    """The resolved config saved with the newest checkpoint of a run."""
    mngr = manager(run_dir, read_only=True)
    step = mngr.latest_step()
    if step is None:
        raise CheckpointError(f"{run_dir}: no checkpoint")
    return mngr.restore(step, args=ocp.args.Composite(config=ocp.args.JsonRestore()))["config"]
