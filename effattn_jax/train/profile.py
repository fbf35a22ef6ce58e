"""The profiler window `train.profile_steps: [start, stop]`: a jax trace of the steps after step
`start` up to step `stop`, in `<run_dir>/profile`. The profiler writes local files only: a gs://
run's trace is staged locally and uploaded when it stops."""

from __future__ import annotations

import contextlib

import jax

from effattn_jax import storage


class Profiler:
    """Starts the trace when step `start` is done and stops it when step `stop` is. A run resumed
    inside the window never started one: nothing is traced, and nothing is stopped."""

    def __init__(self, window: list[int], run_dir):
        self.window, self.target = window, run_dir / "profile"
        self._trace: contextlib.ExitStack | None = None

    def before(self, step: int) -> None:
        if self.window and step == self.window[0]:
            self._trace = contextlib.ExitStack()
            stage = self._trace.enter_context(storage.staged(self.target))
            jax.profiler.start_trace(str(stage.dir))

    def after(self, step: int, state) -> None:
        if self._trace is not None and step == self.window[1]:
            jax.block_until_ready(state)
            jax.profiler.stop_trace()
            self._trace.close()  # uploads a staged trace
            self._trace = None
