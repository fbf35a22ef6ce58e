"""The platform the ops are traced for: this process's JAX backend, or the target of an
ahead-of-time compile (a dry run for a TPU slice, traced on a CPU host). Kernel dispatch
(`resolve_impl` here, shared by the MoBA and MLA ops; `ops.dense.resolve_dense_impl`) asks
here, so an AOT compile gets the real kernels, not their CPU interpretation."""

from __future__ import annotations

import contextlib
import contextvars

import jax

from pallas_kernels.gpu_dispatch import GPU_BACKENDS

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


def resolve_impl(impl: str, backend: str | None = None) -> tuple[str, str | None, bool]:
    """(path, kernel backend, interpret) for an impl name on a JAX backend.

    auto: the Pallas kernels on TPU and GPU, xla elsewhere. pallas: the kernel
    for this backend, interpreted on CPU (TPU kernel). pallas_tpu/pallas_gpu:
    that kernel, interpreted unless running on its own hardware. pallas_mosaic/pallas_triton:
    the GPU kernels written for that Pallas GPU backend (pallas_gpu picks one per device:
    pallas_kernels/gpu_dispatch.py); the kernel backend is then "mosaic" or "triton"."""
    backend = backend or target_backend()
    on = {"tpu": "tpu", "gpu": "gpu", "cuda": "gpu", "rocm": "gpu"}.get(backend)
    if impl == "auto":
        impl = "pallas" if on else "xla"
    if impl in ("reference", "xla"):
        return impl, None, False
    kernel = impl.removeprefix("pallas_") if impl != "pallas" else (on or "tpu")
    hardware = "gpu" if kernel in GPU_BACKENDS else kernel
    return "pallas", kernel, hardware != on
