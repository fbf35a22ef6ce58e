"""The absorbed MLA decode kernel alone against the XLA step it replaces (the GPU suite's
latent_decode section): one single-token step over a full cache of `context` slots, latent and
RoPE key in `dtype`, at the heads and batches the issue names (16 and 128 heads, batch 1 and 16).
The cache bytes a step reads (latent + RoPE key of every slot, once) over its time, against a
device-to-device copy's bytes per second, and the XLA step's time over the kernel's."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from effattn_jax.ops.mla_decode import absorbed_attention
from eval.timing import alternated, seconds
from pallas_kernels import gpu_memory
from pallas_kernels.mla_decode import gpu as mla_gpu


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
    """One row: ms of the kernel (`impl`) and of XLA, the slices the kernel split each row into, and
    bytes per second read against `copy` (bytes/s of a device-to-device copy)."""
    keys = jax.random.split(jax.random.key(context + batch + heads), 4)
    q_lat = jax.random.normal(keys[0], (batch, 1, heads, latent), dtype)
    q_rope = jax.random.normal(keys[1], (batch, 1, heads, rope), dtype)
    lat = jax.random.normal(keys[2], (batch, context, latent), dtype)
    kr = jax.random.normal(keys[3], (batch, context, rope), dtype)
    pos = jnp.full((batch, 1), context - 1, jnp.int32)
    step = lambda impl: jax.jit(lambda *x: absorbed_attention(*x, pos, 0.1, impl))
    fns = {name: step(name) for name in (impl, "xla")}
    args = (q_lat, q_rope, lat, kr)
    for fn in fns.values():
        jax.block_until_ready(fn(*args))  # compiled before the timing
    ms = alternated({name: seconds(fn, *args) for name, fn in fns.items()}, repeats)
    group, tile = mla_gpu.head_group(heads, latent, rope, jnp.dtype(dtype).itemsize)
    groups = -(-heads // group)
    slices = mla_gpu.slices(batch, groups, context, tile, gpu_memory.multiprocessors())[0]
    read = batch * context * (latent + rope) * jnp.dtype(dtype).itemsize
    kernel_s, xla_s = ms[impl], ms["xla"]
    return {
        "kernel": "mla_decode_gpu",
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
