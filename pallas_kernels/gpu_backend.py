"""Which Pallas GPU backend a kernel is written for on a given GPU: Mosaic GPU on Hopper (warpgroup
matmuls, TMA copies; jax's default GPU lowering, and the one jax keeps), Triton before it
(sm80/sm89: jax deprecates its Pallas Triton backend, which stays the pre-Hopper path while jax
ships it). One answer for every kernel family, so MoBA, its routing and the decode kernels agree.
"""

from __future__ import annotations

from pallas_kernels.gpu_memory import DEFAULT_CAPABILITY

GPU_BACKENDS = ("mosaic", "triton")


def backend_for(capability: str | None) -> str:
    """ "mosaic" for compute capability 9.x (Hopper: wgmma needs sm_90a), "triton" otherwise
    (Ampere/Ada have no wgmma or TMA; Blackwell's tensor cores take other instructions)."""
    major = int(str(capability or DEFAULT_CAPABILITY).split(".")[0])
    return "mosaic" if major == 9 else "triton"


def device_backend(device=None) -> str:
    """The GPU backend for `device` (default: this process's first device); a machine without a
    GPU (an AOT export for CUDA) gets what an H100/H200 gets."""
    import jax

    device = device or jax.devices()[0]
    capability = getattr(device, "compute_capability", None) if device.platform == "gpu" else None
    return backend_for(capability)
