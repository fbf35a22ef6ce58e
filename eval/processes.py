"""Evaluation in a multi-process run (effattn_jax/launch.py; e.g. one process per host of a TPU
pod slice): each process evaluates its share of the work on its own devices, the shares are
summed over processes, and process 0 alone prints, draws and writes files. With one process
every function here is the identity.

A share is a round-robin slice of the work items (documents, questions); each result array
holds the process's own items and zeros elsewhere, so the sum over processes is exact.

Also what every evaluation entry point (`python -m eval`, the harness model) does at start-up:
the persistent compilation cache, and a line naming the platform."""

from __future__ import annotations

import contextlib
import os

import jax
import numpy as np
from jax.experimental import multihost_utils


def writes() -> bool:
    """Whether this process prints, draws and writes (process 0)."""
    return jax.process_index() == 0


@contextlib.contextmanager
def output_dir(out: str):
    """The local directory a command writes its figures and tables to: `out` itself, or for a
    gs:// URL a temporary one whose files are uploaded to it when the command is done."""
    from effattn_jax import storage

    with storage.staged(out) as stage:
        yield stage.dir


def persistent_compilation_cache() -> None:
    """Compiled scoring programs are kept across runs (a rerun, or curves over many checkpoints in
    separate processes, compiles nothing): jax's persistent cache under the data cache, unless
    JAX_COMPILATION_CACHE_DIR already says where."""
    from effattn_jax.data.fetch import cache_root

    if not os.environ.get("JAX_COMPILATION_CACHE_DIR"):
        jax.config.update("jax_compilation_cache_dir", str(cache_root() / "jax_compilation_cache"))


def platform_line() -> str:
    """What evaluation and the benchmarks run on, said at start-up: jax picks the machine's
    accelerator unless JAX_PLATFORMS names one (the Makefile and the tests set cpu)."""
    backend, kind = jax.default_backend(), jax.devices()[0].device_kind
    on = backend if kind.lower() == backend else f"{backend} ({kind})"
    return (
        f"jax {jax.__version__} on {on}: {jax.device_count()} devices "
        f"({jax.local_device_count()} on this process, {jax.process_count()} processes)"
    )


def share(n: int) -> np.ndarray:
    """Indices of the n work items this process evaluates."""
    return np.arange(jax.process_index(), n, jax.process_count())


def total(x: np.ndarray) -> np.ndarray:
    """x summed over processes, in float64 (each process holds its share, zeros elsewhere).
    Sent as raw bits: jax without x64 would round float64 to float32 on the way."""
    x = np.asarray(x, np.float64)
    if jax.process_count() == 1:
        return x
    bits = np.ascontiguousarray(x.reshape(-1)).view(np.uint32)  # [2 n]
    parts = np.asarray(multihost_utils.process_allgather(bits))  # [processes, 2 n]
    return parts.view(np.float64).sum(0).reshape(x.shape)
