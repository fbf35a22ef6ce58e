"""The one timer of the benchmarks and of eval/decoding.py: contenders take turns round by round
and each reports its median. These machines drift (a step measured alone can swing by 2x within
minutes); alternating puts the drift on every contender alike, where timing one after another
would put it on one of them."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import jax


def seconds(fn, *args) -> Callable[[], float]:
    """A contender: the wall seconds of one call of fn(*args), waiting for its result."""

    def measure() -> float:
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        return time.perf_counter() - t

    return measure


def alternated(contenders: dict, rounds: int, *, warmup: int = 1) -> dict:
    """name -> median of `rounds` measurements of each contender (a call returning one measurement:
    seconds, or any figure, e.g. a rate, or a dict of named figures, each its own median), the
    contenders called in turn, round after round, after `warmup` rounds that are not kept."""
    kept: dict = {}
    for i in range(warmup + rounds):
        for name, measure in contenders.items():
            value = measure()
            if i >= warmup:
                for key, v in value.items() if isinstance(value, dict) else [(name, value)]:
                    kept.setdefault(key, []).append(v)
    return {key: statistics.median(values) for key, values in kept.items()}
