"""Non-finite steps (`train.nonfinite`): each step's flag stays on the device and is read only at
log and save steps (no extra host sync per step); `skip` counts such steps (the step kept its
state), `stop` ends the run at the first. A state about to be saved that is not finite always
ends it, so a saved checkpoint is always finite."""

from __future__ import annotations

import jax

from effattn_jax.train.step import all_finite


class NonFiniteError(RuntimeError):
    """A step's loss or gradients, or the state about to be saved, is not finite
    (`train.nonfinite=stop`); the message is one line naming the last good checkpoint."""


class FiniteCheck:
    """The non-finite flags of a run's steps; `steps` counts those found so far."""

    def __init__(self, policy: str, checkpoints, last_saved: int):
        self.policy, self.checkpoints, self.last_saved = policy, checkpoints, last_saved
        self.pending: list = []  # (step, device flag) not read yet
        self.steps = 0

    def add(self, step: int, flag) -> None:
        self.pending.append((step, flag))

    def check(self, step: int, state=None) -> None:
        """Reads the pending flags; NonFiniteError with train.nonfinite=stop and a flagged step,
        or when `state` (about to be saved after `step`) is not finite."""
        bad, self.pending = _flagged(self.pending), []
        self.steps += len(bad)
        why = None
        if bad and self.policy == "stop":
            why = f"non-finite loss or gradients at step {bad[0]}"
        elif state is not None and not bool(all_finite(state)):
            why = f"the state after step {step} is not finite"
        if why:
            kept = f"step {self.last_saved}" if self.last_saved else "none"
            raise NonFiniteError(
                f"{why}; nothing saved after it; last good checkpoint: {kept} in {self.checkpoints} "
                "(train.nonfinite=skip resumes skipping such steps; a lower train.lr needs a new run_dir)"
            )


def _flagged(flags: list) -> list[int]:
    """The steps among (step, device flag) pairs whose flag is set: one host transfer for all."""
    values = jax.device_get([f for _, f in flags]) if flags else []
    return [s for (s, _), v in zip(flags, values, strict=True) if int(v)]
