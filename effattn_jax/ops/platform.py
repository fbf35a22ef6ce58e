"""The platform the ops are traced for: this process's JAX backend, or the target of an
ahead-of-time compile (a dry run for a TPU slice, traced on a CPU host). Kernel dispatch
(`resolve_impl`, `resolve_dense_impl`) asks here, so an AOT compile gets the real kernels,
not their CPU interpretation."""

from __future__ import annotations

import contextlib
import contextvars

import jax

_TARGET: contextvars.ContextVar[str | None] = contextvars.ContextVar("effattn_target_platform", default=None)


def target_backend() -> str:
    return _TARGET.get() or jax.default_backend()


@contextlib.contextmanager
def tracing_for(platform: str):
    """Within this block, ops dispatch as if running on `platform` (e.g. "tpu")."""
    token = _TARGET.set(platform)
    try:
        yield
    finally:
        _TARGET.reset(token)
