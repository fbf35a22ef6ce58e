"""Where a run's checkpoints live and what both sides use: the Orbax manager of
`<run_dir>/checkpoints`, the errors readers and the writer raise, and the barrier of all processes."""

from __future__ import annotations

import contextlib
import errno
import os
import re
from pathlib import Path

import jax
import orbax.checkpoint as ocp
from absl import logging as absl_logging
from jax.experimental import multihost_utils

from effattn_jax import storage
from effattn_jax.storage import AnyPath


class CheckpointError(RuntimeError):
    pass


class SaveError(CheckpointError):
    """A checkpoint that cannot be written (no space, no permission, a read-only filesystem):
    training stops with its own exit status (3), the last good step untouched."""


# how the OS error number shows in the text of errors raised below Python (tensorstore, Orbax)
_ERRNO_IN_TEXT = (re.compile(r"os_error_code='(\d+)'"), re.compile(r"\[Errno (\d+)\]"))


def os_error_of(e: BaseException) -> str | None:
    """'No space left on device (ENOSPC)' when `e` or an exception it chains from is an OS error
    (also one that C++ code reports in its message); None otherwise."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        code = e.errno if isinstance(e, OSError) else None
        for pattern in _ERRNO_IN_TEXT:
            if code is None and (m := pattern.search(str(e))):
                code = int(m.group(1))
        if code:
            return f"{os.strerror(code)} ({errno.errorcode.get(code, code)})"
        e = e.__cause__ or e.__context__
    return None


def manager(
    run_dir: str | Path, *, async_save: bool = True, read_only: bool = False, save_concurrent_gb: int = 0
) -> ocp.CheckpointManager:
    """The Orbax manager of `<run_dir>/checkpoints` (a local directory, or Orbax's own Cloud
    Storage path: no temporary directory, a step is committed by its commit_success.txt object);
    retention is `Checkpoints`', not Orbax's. `save_concurrent_gb`: at most this many GB of the
    state in flight while saving (0: Orbax's default, 96), which bounds the host memory a save
    takes beside the state."""
    with _quiet_if(read_only):  # Orbax warns that a read-only manager is read-only: what we asked for
        options = ocp.CheckpointManagerOptions(
            max_to_keep=None, enable_async_checkpointing=async_save, create=not read_only, read_only=read_only
        )
        handlers = None  # Orbax picks each item's handler from its arguments
        if save_concurrent_gb:  # then every item must be named
            handlers = {"state": ocp.StandardCheckpointHandler(save_concurrent_gb=save_concurrent_gb)}
            json_items = ("config", "data_state", "params_only")
            handlers |= {item: ocp.JsonCheckpointHandler() for item in json_items}
        return ocp.CheckpointManager(
            storage.path(run_dir) / "checkpoints", options=options, item_handlers=handlers
        )


@contextlib.contextmanager
def _quiet_if(quiet: bool):
    level = absl_logging.get_verbosity()
    if quiet:
        absl_logging.set_verbosity(absl_logging.ERROR)
    try:
        yield
    finally:
        absl_logging.set_verbosity(level)


def unwritable(directory: AnyPath) -> str | None:
    """Why `directory` cannot be created or a file written in it ('Read-only file system
    (EROFS)', or why its bucket cannot be reached); None when it can."""
    if why := storage.unreachable(directory):
        return why
    try:
        directory.mkdir(parents=True, exist_ok=True)
        probe = directory / f".writable-{jax.process_index()}"
        probe.touch()
        probe.unlink()
    except OSError as e:  # an object store's refusal (403, no such bucket) has no errno
        return os_error_of(e) or f"{type(e).__name__}: {e}".splitlines()[0][:200]
    return None


def check_writable(directory: AnyPath) -> None:
    """SaveError when the checkpoint directory cannot be written (checked before training starts)."""
    if why := unwritable(directory):
        raise SaveError(f"{directory} cannot be written: {why}")


def sync(name: str) -> None:
    """A barrier of all processes (nothing with one)."""
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices(name)
