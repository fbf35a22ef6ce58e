"""The absorbed MLA decode kernel alone against the XLA step it replaces (the GPU suite's
latent_decode section): one single-token step over a full cache of `context` slots, latent and
RoPE key in `dtype`, at the heads and batches the issue names (16 and 128 heads, batch 1 and 16).
The cache bytes a step reads (latent + RoPE key of every slot, once) over its time, against a
device-to-device copy's bytes per second, and the XLA step's time over the kernel's. Where the
GPU dispatch takes the Mosaic GPU kernel (Hopper, a shape it supports), the Triton kernel is
timed beside it (`triton_*` keys): the kernel_* keys are the one the dispatch runs."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from effattn_jax.ops.mla_decode import absorbed_attention
from eval.bench.gpu_checks import latent_step_inputs
from eval.timing import alternated, seconds
from pallas_kernels import gpu_memory
from pallas_kernels.gpu_dispatch import capability
from pallas_kernels.mla_decode import gpu as mla_gpu
from pallas_kernels.mla_decode import mgpu as mla_mgpu


def latent_kernel_case(
    context: int,
    batch: int,
    heads: int,
    *,
    latent: int,
    rope: int,
    dtype,
    impl: str,
    copy: float,
    repeats: int,
) -> dict:
    """One row: ms of the kernel (`impl`; "pallas_gpu" on Hopper: Mosaic GPU's and Triton's) and of
    XLA, the slices the kernel split each row into, and bytes per second read against `copy`
    (bytes/s of a device-to-device copy)."""
    keys = jax.random.split(jax.random.key(context + batch + heads), 4)
    q_lat, q_rope, lat, kr = latent_step_inputs(keys, batch, heads, context, latent, rope, dtype)
    pos = jnp.full((batch, 1), context - 1, jnp.int32)
    on_gpu = jax.default_backend() == "gpu"
    # the kernels by name, verified or not (pallas_gpu takes only verified ones): on Hopper, where the
    # Mosaic GPU kernel takes the step, it and the Triton one; elsewhere the Triton one
    mosaic = (
        impl == "pallas_gpu"
        and on_gpu
        and capability().startswith("9.")
        and not mla_mgpu.supports(heads=heads, d=latent, dr=rope, length=context, dtype=dtype)
    )
    named = "pallas_triton" if impl == "pallas_gpu" else impl
    impls = {"kernel": "pallas_mosaic", "triton": "pallas_triton"} if mosaic else {"kernel": named}
    step = lambda impl: jax.jit(lambda *x: absorbed_attention(*x, pos, 0.1, impl))
    fns = {name: step(i) for name, i in (impls | {"xla": "xla"}).items()}
    args = (q_lat, q_rope, lat, kr)
    for fn in fns.values():
        jax.block_until_ready(fn(*args))  # compiled before the timing
    ms = alternated({name: seconds(fn, *args) for name, fn in fns.items()}, repeats)
    if mosaic:
        group, tile = mla_mgpu.ROWS, mla_mgpu.TILE
    else:
        group, tile = mla_gpu.head_group(heads, latent, rope, jnp.dtype(dtype).itemsize)
    groups = -(-heads // group)
    slices = mla_gpu.slices(batch, groups, context, tile, gpu_memory.multiprocessors())[0]
    read = batch * context * (latent + rope) * jnp.dtype(dtype).itemsize
    kernel_s, xla_s = ms["kernel"], ms["xla"]
    row = {
        "kernel": "mla_decode_gpu",
        "backend": "mosaic" if mosaic else "triton",
        "context": context,
        "batch": batch,
        "heads": heads,
        "head_group": group,
        "tile": tile,
        "slices": slices,
        "cache_bytes_read": read,
        "kernel_ms": kernel_s * 1e3,
        "xla_ms": xla_s * 1e3,
        "kernel_bytes_per_s": read / kernel_s,
        "kernel_of_copy_bandwidth": read / kernel_s / copy,
        "xla_of_copy_bandwidth": read / xla_s / copy,
        "xla_over_kernel": xla_s / kernel_s,
    }
    if mosaic:
        triton_s = ms["triton"]
        row |= {
            "triton_ms": triton_s * 1e3,
            "triton_of_copy_bandwidth": read / triton_s / copy,
            "triton_over_kernel": triton_s / kernel_s,
        }
    return row
