"""The writer: a run's checkpoints as training saves and resumes them (train state, data
iterator state and the resolved config, in `<run_dir>/checkpoints/<step>/`).

Orbax writes each step to a temporary directory and renames it when complete, so a save cut
short (even by kill -9) is never listed. A checksum manifest written after that
(effattn_jax/checksums.py) is verified before a step is restored: a step that fails (flipped,
truncated or missing files, or no manifest at all) is never loaded.
"""

from __future__ import annotations

import itertools
import shutil
import sys
import threading
from pathlib import Path

import grain
import jax
import numpy as np
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils

from effattn_jax import checksums
from effattn_jax.checkpoint.store import manager, sync


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
        self, run_dir: str | Path, *, keep_last: int = 2, keep_every: int = 0, async_save: bool = True
    ):
        self.mngr = manager(run_dir, async_save=async_save)
        self.directory = Path(self.mngr.directory)
        self.keep_last, self.keep_every = keep_last, keep_every
        self._pending: tuple[int, threading.Thread] | None = None

    def all_steps(self) -> list[int]:
        return sorted(self.mngr.all_steps())

    def _step_dir(self, step: int) -> Path:
        return self.directory / str(step)

    def _quarantine(self, step: int, why: str | None) -> None:
        """Moves a step that failed on some process aside (process 0 moves, all wait)."""
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
            shutil.move(self._step_dir(step), dest)
            unverified = why.startswith(checksums.MissingManifest.__name__)
            verdict = "cannot be verified" if unverified else "is corrupt"
            print(f"checkpoint step {step} {verdict} ({why[:200]}); moved to {dest}", file=sys.stderr)
        sync(f"quarantine-{step}")
        self.mngr.reload()

    def restore_latest(self, abstract_state, data_iter=None):
        """(step, state) of the newest step that verifies and restores, restoring `data_iter` in
        place; (None, None) when none does (a run with no checkpoint, or only corrupt ones)."""
        for step in sorted(self.mngr.all_steps(), reverse=True):
            why = None
            try:
                checksums.verify(self._step_dir(step))
            except Exception as e:  # noqa: BLE001 - any failure means this step is unusable
                why = _reason(e)
            if _everywhere(why is None):  # every process restores, or none
                try:
                    args = _restore_args(self._step_dir(step), abstract_state, data_iter)
                    restored = self.mngr.restore(step, args=args)
                except Exception as e:  # noqa: BLE001
                    why = _reason(e)
            if not _everywhere(why is None):  # the processes agree on every step's verdict
                self._quarantine(step, why)
                continue
            if "data_state" in restored:
                data_iter.set_state(restored["data_state"])
            return step, restored["state"]
        return None, None

    def save(self, step: int, state, data_iter, config: dict) -> None:
        """Starts saving `step` (async unless configured otherwise) after completing the previous save."""
        self.finish()
        items = {"state": ocp.args.StandardSave(state), "config": ocp.args.JsonSave(config)}
        if data_iter is not None:
            items["data_state"] = ocp.args.JsonSave(data_iter.get_state())
        self.mngr.save(step, args=ocp.args.Composite(**items), force=True)
        thread = threading.Thread(target=self._complete, args=(step,), daemon=True)
        thread.start()
        self._pending = (step, thread)

    def _complete(self, step: int) -> None:
        self.mngr.wait_until_finished()
        if jax.process_index() == 0:
            checksums.write_manifest(self._step_dir(step))

    def finish(self) -> None:
        """Waits for the pending save and its manifest, then applies retention."""
        if self._pending is None:
            return
        step, thread = self._pending
        thread.join()
        self._pending = None
        self.mngr.check_for_errors()
        sync(f"checksummed-{step}")
        steps = self.all_steps()
        keep = set(steps[-self.keep_last :]) | {step}
        keep |= {s for s in steps if self.keep_every and s % self.keep_every == 0}
        for s in steps:
            if s < step and s not in keep:
                self.mngr.delete(s)

    def close(self) -> None:
        self.finish()
        self.mngr.close()


def _reason(e: Exception) -> str:
    return f"{type(e).__name__}: {e}".splitlines()[0]


def _everywhere(ok: bool) -> bool:
    """Whether `ok` holds on every process (a restore verdict all processes act on together)."""
    if jax.process_count() == 1:
        return ok
    return bool(np.all(multihost_utils.process_allgather(np.int32(ok))))


def _restore_args(step_dir: Path, abstract_state, data_iter) -> ocp.args.Composite:
    items = {"state": ocp.args.StandardRestore(abstract_state)}
    if data_iter is not None and (step_dir / "data_state").is_dir():
        items["data_state"] = ocp.args.JsonRestore()
    elif data_iter is not None:  # saved by an earlier version: Grain's own per-process files
        items["data"] = grain.checkpoint.CheckpointRestore(data_iter)
    return ocp.args.Composite(**items)
