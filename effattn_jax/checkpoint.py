"""Orbax checkpoints of a run: train state, Grain iterator state and the resolved
config, in `<run_dir>/checkpoints/<step>/`. Train, eval and generate all load runs here.

Orbax writes each step to a temporary directory and renames it when complete,
so a save cut short (even by kill -9) is never listed. A committed step that
fails to restore (corrupt or truncated files) is reported and skipped in favour
of the previous one; it is never loaded.

Evaluation loads parameters only (`load_params`), restored straight into the shardings of
the evaluating process's mesh, whatever mesh the run was trained on.
"""

from __future__ import annotations

import sys
from pathlib import Path

import grain
import orbax.checkpoint as ocp

from effattn_jax.config import ConfigError, config_from_dict
from effattn_jax.sharding import make_mesh
from effattn_jax.train.state import abstract_params


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


def restore_config(run_dir: str | Path, step: int | None = None) -> dict:
    """The resolved config saved with a checkpoint of a run (default: the newest)."""
    mngr = manager(run_dir, read_only=True)
    step = mngr.latest_step() if step is None else step
    if step is None:
        raise CheckpointError(f"{run_dir}: no checkpoint")
    return mngr.restore(step, args=ocp.args.Composite(config=ocp.args.JsonRestore()))["config"]


def saved_config(run_dir: str | Path) -> dict | None:
    """The config saved with the newest checkpoint whose config reads (a resumed run is checked
    against it); None for a directory without checkpoints."""
    if not (Path(run_dir) / "checkpoints").is_dir():
        return None
    for step in sorted(manager(run_dir, read_only=True).all_steps(), reverse=True):
        try:
            return restore_config(run_dir, step)
        except Exception:  # noqa: BLE001, S112 - an unreadable step is restore_latest's to report
            continue
    return None


def kept_steps(run_dir: str | Path) -> list[int]:
    """The committed checkpoint steps of a run, oldest first; a clear error when there is no run."""
    run_dir = Path(run_dir)
    if not (run_dir / "checkpoints").is_dir():
        raise CheckpointError(f"{run_dir}: not a run directory (no checkpoints/ inside)")
    steps = sorted(manager(run_dir, read_only=True).all_steps())
    if not steps:
        raise CheckpointError(f"{run_dir}: the run has no checkpoint yet")
    return steps


def select_steps(run_dir: str | Path, which: str | int = "latest") -> list[int]:
    """`--step` value (N, 'latest' or 'all') -> kept steps, or a clear error naming the kept ones."""
    steps = kept_steps(run_dir)
    if which == "all":
        return steps
    if which == "latest":
        return steps[-1:]
    try:
        step = int(which)
    except ValueError:
        raise CheckpointError(f"--step={which!r}: expected a step number, latest or all") from None
    if step not in steps:
        raise CheckpointError(f"{run_dir}: no checkpoint at step {step}; kept steps: {steps}")
    return [step]


def load_run_config(run_dir: str | Path, step: int):
    """The Config a run saved with a step; CheckpointError when this version cannot read it."""
    try:
        return config_from_dict(restore_config(run_dir, step))
    except ConfigError as e:
        raise CheckpointError(f"{run_dir}: this version cannot read the run's config: {e}") from None


def load_params(run_dir: str | Path, step: int, mesh=None):
    """(config, graphdef, params) of one kept step: parameters only (the optimizer state is not read),
    restored into the shardings of `mesh` (default: this process's first device), with the
    config the run saved as of that step (`Config.at_step`: dense after a MoBA -> dense switch).
    Raises CheckpointError when the step or its config cannot be read."""
    mngr = manager(run_dir, read_only=True)
    cfg = load_run_config(run_dir, step).at_step(step)
    graphdef, params = abstract_params(cfg, make_mesh(1, 1, 1) if mesh is None else mesh)
    abstract = {"params": params}
    args = ocp.args.PyTreeRestore(
        item=abstract,
        restore_args=ocp.checkpoint_utils.construct_restore_args(abstract),
        partial_restore=True,
    )
    try:
        restored = mngr.restore(step, args=ocp.args.Composite(state=args))
    except Exception as e:  # noqa: BLE001 - any failure means this step cannot be evaluated
        raise CheckpointError(
            f"{run_dir}: step {step} cannot be restored: {type(e).__name__}: {e}".splitlines()[0][:300]
        ) from None
    return cfg, graphdef, restored["state"]["params"]
