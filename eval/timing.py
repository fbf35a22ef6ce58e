"""The one timer of the benchmarks and of eval/decoding.py: contenders take turns round by round
and each reports its median. These machines drift (a step measured alone can swing by 2x within
minutes); alternating puts the drift on every contender alike, where timing one after another
would put it on one of them. A contender is `seconds` of a call, `carried` calls over state they
donate (a train state, a decode cache, an output buffer), or any call returning a figure."""

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


class Carry:
    """State that timed calls donate and get back: `value` is always the latest state (a donated
    input is gone after the call). Contenders that share one Carry pass one buffer along from
    contender to contender, as two models decoding into one cache."""

    def __init__(self, value):
        self.value = value


def carried(fn, carry: Carry, *, calls: int = 1, untimed: int = 0) -> Callable[[], float]:
    """A contender over donated state: `fn(state) -> (new state, out)`, each call given the state
    the last call left in `carry`. Its figure is the seconds per call of `calls` calls in a row,
    waiting only for the last `out` (the calls queue as a training loop's do), after `untimed`
    calls, each waited for, that are not timed (so the timed call follows a call of its own, not
    another contender's, as a decode step follows a step of the same model)."""

    def measure() -> float:
        for _ in range(untimed):
            carry.value, out = fn(carry.value)
            jax.block_until_ready(out)
        t = time.perf_counter()
        for _ in range(calls):
            carry.value, out = fn(carry.value)
        jax.block_until_ready(out)
        return (time.perf_counter() - t) / calls

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
