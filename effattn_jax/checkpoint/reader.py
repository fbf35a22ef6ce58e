"""The reader: what eval, generate and a resumed run's config check read from a run directory
(its kept steps, a step's config, a step's parameters into any mesh), never writing to it."""

from __future__ import annotations

from pathlib import Path

import jax
import orbax.checkpoint as ocp
from flax import nnx

from effattn_jax import checksums, storage
from effattn_jax.checkpoint.store import CheckpointError, manager
from effattn_jax.config import ConfigError, config_from_dict
from effattn_jax.model import abstract_params, new_model
from effattn_jax.sharding import leaves_by_path, make_mesh


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
    if not (storage.path(run_dir) / "checkpoints").is_dir():
        return None
    for step in sorted(manager(run_dir, read_only=True).all_steps(), reverse=True):
        try:
            return restore_config(run_dir, step)
        except Exception:  # noqa: BLE001, S112 - an unreadable step is restore_latest's to report
            continue
    return None


def kept_steps(run_dir: str | Path) -> list[int]:
    """The committed checkpoint steps of a run, oldest first; a clear error when there is no run."""
    if not (storage.path(run_dir) / "checkpoints").is_dir():
        raise CheckpointError(f"{run_dir}: not a run directory (no checkpoints/ inside)")
    steps = sorted(manager(run_dir, read_only=True).all_steps())
    if not steps:
        raise CheckpointError(f"{run_dir}: the run has no checkpoint yet")
    return steps


def select_steps(
    run_dir: str | Path, which: str | int = "latest", *, option: str = "--step", allow_all: bool = True
) -> list[int]:
    """A step choice (N, 'latest', or 'all' where `allow_all`) -> kept steps, or a clear error naming
    the kept ones; `option`: how the caller's user gave it (a flag, a --model_args key)."""
    steps = kept_steps(run_dir)
    if which == "all" and allow_all:
        return steps
    if which == "latest":
        return steps[-1:]
    try:
        step = int(which)
    except ValueError:
        allowed = "a step number, latest or all" if allow_all else "a step number or latest"
        raise CheckpointError(f"{option}={which!r}: expected {allowed}") from None
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
    restored into the shardings of `mesh` (default: this process's first local device), with the
    config the run saved as of that step (`Config.at_step`: dense after a MoBA -> dense switch).
    Raises CheckpointError when the step or its config cannot be read."""
    cfg = load_run_config(run_dir, step).at_step(step)
    mesh = make_mesh(1, 1, 1, devices=jax.local_devices()) if mesh is None else mesh
    graphdef, params = abstract_params(cfg, mesh)
    return cfg, graphdef, restore_params(run_dir, step, params)


def restore_params(run_dir: str | Path, step: int, abstract: dict, *, verified: bool = False) -> dict:
    """The parameters of a kept step (verified against its manifest unless the caller just did),
    restored into `abstract`'s shapes, dtypes and shardings; CheckpointError when they cannot be."""
    mngr = manager(run_dir, read_only=True)
    item = {"params": abstract}
    args = ocp.args.PyTreeRestore(
        item=item, restore_args=ocp.checkpoint_utils.construct_restore_args(item), partial_restore=True
    )
    try:
        if not verified:
            checksums.verify(storage.path(mngr.directory) / str(step))
        restored = mngr.restore(step, args=ocp.args.Composite(state=args))
    except Exception as e:  # noqa: BLE001 - any failure means this step cannot be used
        raise CheckpointError(
            f"{run_dir}: step {step} cannot be restored: {type(e).__name__}: {e}".splitlines()[0][:300]
        ) from None
    return restored["state"]["params"]


def init_source(spec: str) -> tuple[str, int]:
    """`train.init_from` (`RUN_DIR[@STEP]`, default its newest step) -> (run dir, kept step),
    the step verified against its checksums (a new run must not start from a corrupt one)."""
    run_dir, _, which = spec.rpartition("@") if "@" in spec else (spec, "", "latest")
    step = select_steps(run_dir, which, option=f"train.init_from={run_dir}@STEP: STEP", allow_all=False)[0]
    try:
        checksums.verify(storage.path(manager(run_dir, read_only=True).directory) / str(step))
    except checksums.ChecksumError as e:
        raise CheckpointError(f"{run_dir}: step {step} cannot be used: {type(e).__name__}: {e}") from None
    return run_dir, step


def saved_params(run_dir: str | Path, step: int) -> dict:
    """The shapes of a kept step's parameters, by the model of the config saved with it."""
    cfg = load_run_config(run_dir, step).at_step(step)
    return jax.eval_shape(lambda: nnx.to_pure_dict(nnx.split(new_model(cfg))[1]))


def shape_changes(run_dir: str | Path, step: int, abstract: dict, *, fresh=lambda path: False) -> list[str]:
    """`parameter: saved shape -> new shape` for every parameter of `abstract` that a kept step's
    model (by the config saved with it) lacks or holds in another shape, and every one it has
    that `abstract` lacks. `fresh(path)` (a tuple of names): parameters the new model may add,
    initialised rather than restored (DSA's indexers on a dense model)."""
    old, new = leaves_by_path(saved_params(run_dir, step)), leaves_by_path(abstract)
    shape = lambda leaves, path: tuple(leaves[path].shape) if path in leaves else "absent"
    return [
        f"{'/'.join(path)}: {shape(old, path)} -> {shape(new, path)}"
        for path in sorted(set(old) | set(new))
        if shape(old, path) != shape(new, path) and not (path not in old and fresh(path))
    ]
