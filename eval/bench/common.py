"""Small pieces shared by the benchmark scripts."""

from __future__ import annotations

import time

import jax
import numpy as np


def synthetic_batch(batch: int, seq: int, vocab: int = 50_000, seed: int = 0) -> dict[str, np.ndarray]:
    """A training batch of random tokens, one document per row, every target trained."""
    rng = np.random.default_rng(seed)
    return {
        "inputs": rng.integers(0, vocab, (batch, seq), dtype=np.int32),
        "targets": rng.integers(0, vocab, (batch, seq), dtype=np.int32),
        "segment_ids": np.ones((batch, seq), np.int32),
        "loss_mask": np.ones((batch, seq), np.float32),
    }


def compiled_bytes(compiled) -> int:
    """Temp + argument + output bytes of a compiled executable (`memory_analysis()`): the
    memory figure available on CPU, whose devices report no live memory stats."""
    m = compiled.memory_analysis()
    return int(m.temp_size_in_bytes + m.argument_size_in_bytes + m.output_size_in_bytes)


def time_once(fn, args) -> float:
    """Wall seconds of one call, waiting for the result."""
    t = time.perf_counter()
    jax.block_until_ready(fn(*args))
    return time.perf_counter() - t
