"""Which Pallas GPU backend a kernel is written for on a given GPU: Mosaic GPU on Hopper (warpgroup
matmuls, TMA copies; jax's default GPU lowering, and the one jax keeps), Triton before it
(sm80/sm89: jax deprecates its Pallas Triton backend, which stays the pre-Hopper path while jax
ships it). One answer for every kernel family, so MoBA, its routing and the decode kernels agree.

`pallas_gpu` (and `auto` on a GPU) runs the Mosaic GPU kernels on Hopper only once
`MOSAIC_BY_DEFAULT` is set: they pass their tests interpreted and lower for CUDA, but have not yet
run on a GPU, where the Triton kernels have (BENCHMARKS.md, "GPU"). Until the GPU suite's
correctness section has checked them on one, `pallas_mosaic` asks for them.
"""

from __future__ import annotations

from pallas_kernels.gpu_memory import DEFAULT_CAPABILITY

GPU_BACKENDS = ("mosaic", "triton")
# set once `python -m eval.bench.gpu_suite --sections correctness` passes on a Hopper
MOSAIC_BY_DEFAULT = False


def backend_for(capability: str | None) -> str:
    """ "mosaic" for compute capability 9.x (Hopper: wgmma needs sm_90a), "triton" otherwise
    (Ampere/Ada have no wgmma or TMA; Blackwell's tensor cores take other instructions)."""
    major = int(str(capability or DEFAULT_CAPABILITY).split(".")[0])
    return "mosaic" if major == 9 else "triton"


def device_backend(device=None) -> str:
    """The GPU backend `device` can run best (default: this process's first device); a machine
    without a GPU (an AOT export for CUDA) gets what an H100/H200 gets."""
    import jax

    device = device or jax.devices()[0]
    capability = getattr(device, "compute_capability", None) if device.platform == "gpu" else None
    return backend_for(capability)


def default_backend(device=None) -> str:
    """The GPU backend `pallas_gpu` and `auto` take on `device`: `device_backend`'s answer once
    `MOSAIC_BY_DEFAULT` is set, else Triton (the kernels measured on a GPU so far)."""
    return device_backend(device) if MOSAIC_BY_DEFAULT else "triton"


def asks_mosaic(kernel: str, interpret) -> bool:
    """Whether a kernel backend name (resolve_impl's "gpu", "mosaic" or "triton") runs the Mosaic GPU
    kernel, where it supports the step: "mosaic" always; "gpu" (pallas_gpu, auto) compiled, where
    `default_backend` says so; interpreted (tests on a CPU) "gpu" takes Triton, the fast interpreter.
    One rule for MoBA's kernels, its routing and the decode kernels."""
    return kernel == "mosaic" or (kernel == "gpu" and not interpret and default_backend() == "mosaic")
