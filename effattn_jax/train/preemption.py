"""Preemption: SIGTERM/SIGINT stop a run after its current step, which is checkpointed; the run
prints `preempted step=<n> run_dir=<path>` and exits with status 143 (rerun to resume)."""

from __future__ import annotations

import os
import signal
from typing import NoReturn

import jax
from jax.experimental import multihost_utils

PREEMPTED_EXIT = 143


class Preempted(SystemExit):
    pass


class StopFlag:
    """SIGTERM/SIGINT, checked after each step. One process: a flag set by our handler. Several:
    jax's preemption service owns SIGTERM (SIGINT is turned into a SIGTERM) and agrees on one step
    at which every process stops, whichever process got the signal."""

    def __init__(self):
        self.signal = None
        self.multi = jax.process_count() > 1

    def __call__(self, signum, frame):
        if self.multi:
            os.kill(os.getpid(), signal.SIGTERM)  # to jax's preemption notifier
        self.signal = signum

    def install(self):
        signals = (signal.SIGINT,) if self.multi else (signal.SIGTERM, signal.SIGINT)
        self.previous = {s: signal.signal(s, self) for s in signals}

    def restore(self):
        for s, h in self.previous.items():
            signal.signal(s, h)

    def reached(self, step: int) -> bool:
        if self.multi:
            return multihost_utils.reached_preemption_sync_point(step)
        return self.signal is not None


def exit_preempted(step: int, run_dir) -> NoReturn:
    """The preempted run's last line, and its exit (after its step is checkpointed)."""
    print(f"preempted step={step} run_dir={run_dir}", flush=True)
    raise Preempted(PREEMPTED_EXIT)
