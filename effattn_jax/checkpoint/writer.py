"""The writer: a run's checkpoints as training saves and resumes them (train state, data
iterator state and the resolved config, in `<run_dir>/checkpoints/<step>/`).

Orbax writes each step to a temporary directory and renames it when complete (on Cloud
Storage, which has no rename, it commits the step with a commit_success.txt object), so a save cut
short (even by kill -9) is never listed. A checksum manifest written after that
(effattn_jax/checksums.py) is verified before a step is restored: a step that fails (flipped,
truncated or missing files, or no manifest at all) is never loaded.
"""

from __future__ import annotations

import itertools
import logging
import sys
import threading
from pathlib import Path

import grain
import jax
import numpy as np
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils

from effattn_jax import checksums, storage
from effattn_jax.checkpoint.reader import restore_params
from effattn_jax.checkpoint.store import SaveError, manager, os_error_of, sync
from effattn_jax.storage import AnyPath


class Checkpoints:
    """A run's checkpoints as training writes and resumes them.

    Each save is completed by a checksum manifest (written by process 0 in a background thread
    once Orbax has committed the step). Older steps are deleted only after a newer one is complete
    and checksummed, so a run always keeps a good step. On resume each step is verified before it
    is restored; a step that fails (on any process: they agree on each step), or has no manifest
    (killed between Orbax's commit and the manifest, or the manifest removed), is moved to
    `checkpoints/corrupt/` (reported once) so the run can save that step again. The data
    iterator's state is saved as JSON (the same on every process), so a run may resume with
    another process count."""

    def __init__(
        self,
        run_dir: str | Path,
        *,
        keep_last: int = 2,
        keep_every: int = 0,
        async_save: bool = True,
        save_concurrent_gb: int = 0,
    ):
        self.directory = storage.path(run_dir) / "checkpoints"
        self.mngr = manager(run_dir, async_save=async_save, save_concurrent_gb=save_concurrent_gb)
        self.keep_last, self.keep_every = keep_last, keep_every
        self._pending: tuple[int, threading.Thread] | None = None
        self._error: BaseException | None = None  # of the pending save's background thread
        self._failed = False
        self._quiet = _FilesystemErrors()  # SaveError says it in one line
        _ABSL.addFilter(self._quiet)
        if jax.process_index() == 0:  # the run is locked: a temporary step is a save that died
            self._remove_partial()

    def all_steps(self) -> list[int]:
        return sorted(self.mngr.all_steps())

    def _step_dir(self, step: int) -> AnyPath:
        return self.directory / str(step)

    def _quarantine(self, step: int, why: str | None) -> None:
        """Moves a step that failed on some process aside (process 0 moves, all wait): a rename
        locally, a copy and then a deletion on an object store."""
        if why and jax.process_index() > 0:
            print(f"process {jax.process_index()}: checkpoint step {step}: {why[:200]}", file=sys.stderr)
        why = why or "it failed on another process; see that process's log"
        dest = self.directory / "corrupt" / str(step)
        if jax.process_index() == 0:
            for again in itertools.count(1):  # the same step set aside before: <step>-<n>
                if not dest.exists():
                    break
                dest = dest.with_name(f"{step}-{again}")
            dest.parent.mkdir(exist_ok=True)
            storage.move(self._step_dir(step), dest)
            unverified = why.startswith(checksums.MissingManifest.__name__)
            verdict = "cannot be verified" if unverified else "is corrupt"
            print(f"checkpoint step {step} {verdict} ({why[:200]}); moved to {dest}", file=sys.stderr)
        sync(f"quarantine-{step}")
        self.mngr.reload()

    def restore_latest(self, abstract_state, data_iter=None):
        """(step, state) of the newest step that verifies and restores, restoring `data_iter` in
        place; (None, None) when none does (a run with no checkpoint, or only corrupt ones). A
        step saved with parameters only (a converted model) comes back with `opt_state` None."""
        for step in sorted(self.mngr.all_steps(), reverse=True):
            why = None
            try:
                checksums.verify(self._step_dir(step))
            except Exception as e:  # noqa: BLE001 - any failure means this step is unusable
                why = _reason(e)
            if _everywhere(why is None):  # every process restores, or none
                try:
                    restored = self._restore(step, abstract_state, data_iter)
                except Exception as e:  # noqa: BLE001
                    why = _reason(e)
            if not _everywhere(why is None):  # the processes agree on every step's verdict
                self._quarantine(step, why)
                continue
            if "data_state" in restored:
                data_iter.set_state(restored["data_state"])
            return step, restored["state"]
        return None, None

    def _restore(self, step: int, abstract_state, data_iter) -> dict:
        if (self._step_dir(step) / PARAMS_ONLY).is_dir():  # through a manager of its own: the
            # item "state" of this one must keep the handler that saves whole states
            params = restore_params(self.directory.parent, step, abstract_state["params"], verified=True)
            return {"state": {"params": params, "opt_state": None}}
        return self.mngr.restore(step, args=_restore_args(self._step_dir(step), abstract_state, data_iter))

    def save(self, step: int, state, data_iter, config: dict) -> None:
        """Starts saving `step` (async unless configured otherwise) after completing the previous
        save; SaveError (nothing half-written left behind) when the step cannot be written."""
        self.finish()
        self._check_room(step, state)
        items = {"state": ocp.args.StandardSave(state), "config": ocp.args.JsonSave(config)}
        if "opt_state" not in state:  # parameters only: a converted model, no optimizer state yet
            items[PARAMS_ONLY] = ocp.args.JsonSave({"optimizer_state": False})
        if data_iter is not None:
            items["data_state"] = ocp.args.JsonSave(data_iter.get_state())
        try:
            self.mngr.save(step, args=ocp.args.Composite(**items), force=True)
        except Exception as e:  # noqa: BLE001 - an OS error becomes SaveError, anything else is raised
            self._fail(step, e)
        thread = threading.Thread(target=self._complete, args=(step,), daemon=True)
        thread.start()
        self._pending = (step, thread)

    def _complete(self, step: int) -> None:
        try:
            self.mngr.wait_until_finished()
            if jax.process_index() == 0:
                checksums.write_manifest(self._step_dir(step))
        except Exception as e:  # noqa: BLE001 - finish() raises it in the training thread
            self._error = e

    def finish(self) -> None:
        """Waits for the pending save and its manifest, then applies retention."""
        if self._pending is None:
            return
        step, thread = self._pending
        thread.join()
        self._pending = None
        if self._error is None:
            try:
                self.mngr.check_for_errors()
            except Exception as e:  # noqa: BLE001
                self._error = e
        if not _everywhere(self._error is None):  # one process's failed save fails it for all
            self._fail(step, self._error)
        sync(f"checksummed-{step}")
        steps = self.all_steps()
        keep = set(steps[-self.keep_last :]) | {step}
        keep |= {s for s in steps if self.keep_every and s % self.keep_every == 0}
        for s in steps:
            if s < step and s not in keep:
                self.mngr.delete(s)

    def _check_room(self, step: int, state) -> None:
        """SaveError before Orbax writes anything when the filesystem lacks room for the step
        (its arrays' bytes and some slack), on any process; an object store's room is its quota's."""
        free = storage.free_bytes(self.directory)
        if free is None:
            return
        need = sum(leaf.nbytes for leaf in jax.tree.leaves(state)) * 1.05 + (1 << 20)
        if not _everywhere(free >= need):
            self._failed = True
            raise SaveError(
                f"cannot save step {step} in {self.directory}: No space left on device (ENOSPC): "
                f"{free / 2**20:,.1f} MiB free, the step needs {need / 2**20:,.1f} MiB; "
                f"{self._last_good()}; free space and rerun to resume from it"
            )

    def _fail(self, step: int, error: BaseException | None) -> None:
        """Removes what the failed save of `step` left and raises SaveError naming the OS error;
        an error that is not the filesystem's is raised as it is."""
        self._failed = True
        if jax.process_index() == 0:
            self._remove_partial(step)
        why = os_error_of(error) if error is not None else "it failed on another process"
        if why is None:
            raise error
        raise SaveError(
            f"cannot save step {step} in {self.directory}: {why}; {self._last_good()}; "
            "fix the directory (space, permissions) and rerun to resume from it"
        ) from None

    def _remove_partial(self, step: int | None = None) -> None:
        """Deletes Orbax's unfinished steps (a temporary directory, or on Cloud Storage a step
        without its commit_success.txt), and `step` if committed without its manifest."""
        if not self.directory.exists():  # an object store has no empty directory
            return
        for p in self.directory.iterdir():
            unfinished = p.name == str(step) and not checksums.has_manifest(p)
            if (p.name[:1].isdigit() and not ocp.step.is_path_finalized(p)) or unfinished:
                storage.remove_tree(p)

    def _last_good(self) -> str:
        good = [s for s in self.all_steps() if checksums.has_manifest(self._step_dir(s))]
        return f"the last good step is {good[-1]}" if good else "no step was saved yet"

    def close(self) -> None:
        try:
            if not self._failed:  # after a failed save Orbax's close would wait on it and report it again
                self.finish()
                self.mngr.close()
        finally:
            _ABSL.removeFilter(self._quiet)


_ABSL = logging.getLogger("absl")
PARAMS_ONLY = "params_only"  # the item marking a step saved without optimizer state


class _FilesystemErrors(logging.Filter):
    """Drops Orbax's log records (with tracebacks, from its background threads) of a write that
    failed for a filesystem reason; the writer reports it as SaveError."""

    def filter(self, record: logging.LogRecord) -> bool:
        if "orbax" not in record.pathname or record.levelno < logging.ERROR:
            return True
        error = record.exc_info[1] if record.exc_info else None
        return not (os_error_of(error) if error else os_error_of(RuntimeError(record.getMessage())))


def _reason(e: Exception) -> str:
    return f"{type(e).__name__}: {e}".splitlines()[0]


def _everywhere(ok: bool) -> bool:
    """Whether `ok` holds on every process (a restore verdict all processes act on together)."""
    if jax.process_count() == 1:
        return ok
    return bool(np.all(multihost_utils.process_allgather(np.int32(ok))))


def _restore_args(step_dir: AnyPath, abstract_state, data_iter) -> ocp.args.Composite:
    items = {"state": ocp.args.StandardRestore(abstract_state)}
    if data_iter is not None and (step_dir / "data_state").is_dir():
        items["data_state"] = ocp.args.JsonRestore()
    elif data_iter is not None and (step_dir / "data").is_dir():  # an earlier version's: Grain's files
        items["data"] = grain.checkpoint.CheckpointRestore(data_iter)
    # no data position at all (a converted model's step 0): the data starts from the beginning
    return ocp.args.Composite(**items)
