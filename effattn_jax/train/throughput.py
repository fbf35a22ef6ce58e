"""What a run logs every `train.log_every` steps: the step's loss, learning rate and gradient
norm, and the throughput since the last log (tokens/s, model FLOP/s, and MFU where the devices'
peak is known), as TensorBoard scalars and on the progress bar. Time spent evaluating is not
counted: tokens/s is training's."""

from __future__ import annotations

import time

import jax


class Throughput:
    """`peak`: the whole mesh's peak FLOP/s (None where unknown: no MFU)."""

    def __init__(self, step: int, tokens_per_step: int, peak: float | None, writer, bar):
        self.tokens_per_step, self.peak, self.writer, self.bar = tokens_per_step, peak, writer, bar
        self.tick, self.tick_step = time.perf_counter(), step

    def pause_ended(self, step: int) -> None:
        """The next log counts from `step` and now: a pause (an evaluation) is not training time, and
        the steps before it are not counted against the time after it."""
        self.tick, self.tick_step = time.perf_counter(), step

    def log(self, step: int, metrics: dict, flops_per_token: float, counters: dict[str, int]) -> None:
        logged = {k: float(v) for k, v in jax.device_get(metrics).items()}
        now = time.perf_counter()
        tokens_per_sec = (step - self.tick_step) * self.tokens_per_step / (now - self.tick)
        self.tick, self.tick_step = now, step
        flops_per_sec = tokens_per_sec * flops_per_token
        scalars = {
            "loss": logged["loss"],
            "learning_rate": logged["lr"],
            "grad_norm": logged["grad_norm"],
            "tokens_per_sec": tokens_per_sec,
            "tokens_seen": step * self.tokens_per_step,
            "model_flops_per_sec": flops_per_sec,
            **counters,
        }
        if "indexer_kl" in logged:  # a DSA model's indexer loss (train/step.py)
            scalars["indexer_kl"] = logged["indexer_kl"]
        mfu = {"mfu": flops_per_sec / self.peak} if self.peak else {}  # of every device's peak bf16 rate
        self.writer.scalars(step, scalars | mfu)
        shown = {"mfu": f"{mfu['mfu']:.1%}"} if mfu else {}
        self.bar.set_postfix(loss=f"{logged['loss']:.3f}", tok_s=f"{tokens_per_sec:,.0f}", **shown)


class FinishedStepBar:
    """Moves the progress bar when a step has finished, not when it was queued. jax dispatches
    ahead of the device, so a bar moved at dispatch shows the queueing rate (about 10 it/s against
    a real 3 s/it). Each step waits for the one before it: one step stays queued behind the
    running one, so the device never idles on the bar."""

    def __init__(self, bar):
        self.bar, self.queued = bar, None

    def dispatched(self, marker) -> None:
        """`marker`: an output of the step just dispatched (its loss)."""
        self.finish()
        self.queued = marker

    def finish(self) -> None:
        """Counts the queued step once it is done (before a save, a log or the end)."""
        if self.queued is not None:
            jax.block_until_ready(self.queued)
            self.queued = None
            self.bar.update(1)
