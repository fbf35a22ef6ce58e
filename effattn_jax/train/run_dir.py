"""Guards of a run directory, checked before training touches it: one writer at a time (a lock
file naming its host and pid), and a resumed run trains the model it was started with."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import sys
import time

from effattn_jax import storage
from effattn_jax.config import Config, ConfigError, config_from_dict
from effattn_jax.storage import AnyPath

LOCK_NAME = "run.lock"
# what a resumed run may change; any other difference from the saved config is refused
RESUMABLE = (
    "train.steps",
    "train.log_every",
    "train.progress",
    "train.profile_steps",
    "train.nonfinite",
    "train.resume",
    "train.run_dir",
    "train.init_from",  # where step 0 came from; a resumed run continues from its own steps
    "model.loss_chunk_tokens",  # memory and speed of the loss, not the model
    "data.on_corrupt",  # how to go on past a corrupt record, once one is found
    "data.shard_cache_gb",  # where records are read from, not which
    # the kernels' tiles and pipelining: speed and memory, not the math (a run may move to a GPU)
    "moba.q_tile",
    "moba.kv_block",
    "moba.past_q_tile",
    "moba.key_tile",
    "moba.num_warps",
    "moba.num_stages",
)
RESUMABLE_SECTIONS = ("checkpoint", "eval", "mesh", "distributed")


def _holder(path: AnyPath) -> tuple[dict | None, int | None]:
    """(the lock's holder, the lock's generation on Cloud Storage)."""
    text, generation = storage.read_versioned(path)
    try:
        return json.loads(text), generation
    except (TypeError, ValueError):
        return None, generation  # gone, or cut short while being written


def _is_stale(holder: dict | None) -> bool:
    """A lock is stale when unreadable or held by a process of this host that no longer runs;
    one from another host cannot be checked from here, so it holds."""
    if holder is None:
        return True
    if holder.get("host") != socket.gethostname():
        return False
    try:
        os.kill(int(holder["pid"]), 0)  # signal 0: only asks whether the process exists
    except ProcessLookupError:
        return True
    except (PermissionError, KeyError, ValueError, TypeError):
        pass  # alive under another user, or a lock we cannot read the pid of: it holds
    return False


@contextlib.contextmanager
def exclusive(run_dir: AnyPath):
    """Holds `<run_dir>/run.lock` for the body; a second launch on the directory fails with one
    line naming the holder. The lock is created only where none exists (O_EXCL locally; on Cloud
    Storage a create conditioned on no live object), so of two launches one wins. A stale lock
    (its process is gone, e.g. after kill -9) is replaced."""
    path = run_dir / LOCK_NAME
    mine = {"host": socket.gethostname(), "pid": os.getpid(), "since": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    while not storage.create_exclusive(path, json.dumps(mine)):
        holder, generation = _holder(path)
        if not _is_stale(holder):
            raise ConfigError(
                "train.run_dir",
                str(run_dir),
                f"in use by pid {holder.get('pid')} on {holder.get('host')} since {holder.get('since')} "
                f"(one writer per run; if that process is gone, delete {path})",
            ) from None
        print(f"removing a stale lock of a finished process: {path} {holder}", file=sys.stderr)
        storage.remove_version(path, generation)  # only the lock read: not one created since
    try:
        yield
    finally:
        holder, generation = _holder(path)
        if holder == mine:
            storage.remove_version(path, generation)


def set_aside(run_dir: AnyPath) -> AnyPath | None:
    """`train.resume=false`: moves the run's checkpoints, metrics and saved config into
    `<run_dir>/previous-<time>/` (nothing is deleted; on an object store a copy, then the
    deletion); None when there was nothing to move."""
    old = [p for p in run_dir.iterdir() if p.name in ("checkpoints", "config.yaml") or ".tfevents." in p.name]
    if not old:
        return None
    dest = run_dir / f"previous-{time.strftime('%Y%m%d-%H%M%S')}"
    dest.mkdir()
    for p in old:
        storage.move(p, dest / p.name)
    print(f"train.resume=false: the previous run's checkpoints and metrics moved to {dest}", file=sys.stderr)
    return dest


def _flat(tree: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[prefix + k] = v
    return out


def config_changes(saved: dict, cfg: Config) -> list[str]:
    """`key: saved -> new` for every difference a resumed run may not make. The moba.* keys count
    only where a MoBA layer does, in the saved run or the new one: a dense run resumes whatever
    MoBA block its config file names for `attention.core=moba`."""
    moba_counts = True
    with contextlib.suppress(ConfigError):  # with this version's defaults filled in, as the run will be read
        saved_cfg = config_from_dict(saved)
        saved = saved_cfg.to_dict()
        moba_counts = saved_cfg.uses_moba or cfg.uses_moba
    old, new = _flat(saved), _flat(cfg.to_dict())
    changes = []
    for key in sorted(set(old) | set(new)):
        if key in RESUMABLE or key.split(".")[0] in RESUMABLE_SECTIONS:
            continue
        if key.startswith("moba.") and not moba_counts:
            continue
        if old.get(key, "<unset>") != new.get(key, "<unset>"):
            changes.append(f"{key}: {old.get(key, '<unset>')!r} -> {new.get(key, '<unset>')!r}")
    return changes


def check_resumable(saved: dict | None, cfg: Config) -> None:
    """Refuses (one line, before anything is written) a rerun whose model, data or optimizer
    config differs from the one the run's checkpoints were trained with."""
    if saved is None:
        return
    changes = config_changes(saved, cfg)
    if changes:
        allowed = ", ".join(RESUMABLE + tuple(f"{s}.*" for s in RESUMABLE_SECTIONS))
        raise ConfigError(
            "train.run_dir",
            cfg.train.run_dir,
            f"the run was trained with a different config ({'; '.join(changes)}); a resumed run may "
            f"change only {allowed}: use another run_dir or the run's own config",
        )
