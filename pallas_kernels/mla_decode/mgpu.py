"""Absorbed MLA decode step on Hopper GPUs (Pallas -> Mosaic GPU), split over the cache
(flash-decoding) exactly as `gpu.py` (the Pallas Triton kernel, kept for GPUs before Hopper): one
program per (batch row, group of 64 heads, slice of the cache), the same slices, the same partial
outputs (normalised output, softmax max and sum per slice) and the same XLA combine.

Memory-bound design: the slice's latent and RoPE-key tiles of TILE slots stream by TMA into a ring
of SMEM stages (a "loaded" barrier per copy, a "consumed" barrier per slot) while the compute
warpgroups run warpgroup matmuls (wgmma) on them. No memory warpgroup: compute warpgroup 0 issues
the copies (the ring's first fill, then each slot's refill once both warpgroups released it), so
the kernel runs 128 threads per compute warpgroup and each thread keeps the 255 registers ptxas
allows without setmaxnreg. With a memory warpgroup (384 threads) and setmaxnreg dropped, as on
jaxlib's nvJitLink path, a thread had 168 and the latent-512 kernel spilled 512 bytes with its
wgmma serialized (ptxas C7512; docs/gpu_registers.md). A wgmma
takes 64 rows, so a group is 64 heads: 128 heads run as 2 groups (each reads the cache slice),
fewer than 64 heads are padded with zero queries to 64 rows (the matmuls do 64 / H times the
useful work, 4x at 16 heads, which a memory-bound step has to spare, and the padded rows'
partials are written too). Each compute warpgroup owns CHUNK (<= 256, wgmma's widest N) of the
latent's columns of the output: with latent 512 two warpgroups, each holding a [64, 256] float32
accumulator in registers (one [64, 512] would not fit a warpgroup's registers); both compute the
same [64, TILE] scores (q_lat . latent + q_rope . k^R, summed over the latent's chunks) and the same
online softmax, in registers, and feed p from registers to their own chunk's matmul. The
duplicated scores cost matmul work (about 185 flops per cache byte at latent 512 + 64, against
121 with scores computed once and p shared through SMEM, which the 2-slot ring leaves no room
for): docs/mla.md.

A TMA copy reads whole tiles: the cache length must be a multiple of 8 and at least TILE, and the
last tile of a slice that would run past the cache is read from the cache's last TILE slots
instead (slots before the tile's own start or past the row's length are masked).

Interpreted (the tests), the accumulation differs in form only (mgpu_toolkit.accumulate): the
Mosaic GPU interpreter's wgmma reads both operands from SMEM and it has no pl.run_state, so p goes
through SMEM and each product is added to the accumulator in registers.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import gpu_memory
from pallas_kernels import mgpu_toolkit as kit
from pallas_kernels.common import combine_partials, mosaic_gpu_interpret
from pallas_kernels.mla_decode import gpu

ROWS = 64  # heads per group: a warpgroup matmul's rows
TILE = 64  # cache slots per step
CHUNK = 256  # latent columns per compute warpgroup, at most (wgmma's largest N)
ALIGN = 8  # rows of a tiled SMEM tile: a TMA copy's rows start on a multiple
MAX_STAGES = 4
LOG2E = math.log2(math.e)
DTYPES = (jnp.bfloat16, jnp.float16)
KERNEL = "the Mosaic GPU decode kernel"  # how its refusals name it


def _chunk(d: int) -> int:
    return min(d, CHUNK)


def smem_bytes(d: int, dr: int, itemsize: int, stages: int) -> int:
    """Shared memory per program (bytes), compiled: the group's queries, `stages` ring slots of a
    latent and a k^R tile, the softmax statistics' staging, each buffer 1024-byte aligned, plus
    barriers and the reductions' scratch (2 KiB)."""
    buf = lambda n: -(-n // 1024) * 1024
    return (
        buf(ROWS * d * itemsize)
        + buf(ROWS * dr * itemsize)
        + stages * (buf(TILE * d * itemsize) + buf(TILE * dr * itemsize))
        + buf(2 * ROWS * 4)
        + 8 * (1 + d // _chunk(d) + stages * (2 + d // _chunk(d)))
        + 2048
    )


def stages_for(d: int, dr: int, itemsize: int, limit: int | None = None) -> int:
    """The most ring slots (MAX_STAGES down to 2) whose shared memory fits `limit` (default: an
    H100/H200's); 0 when not even 2 fit."""
    limit = limit or gpu_memory.smem_limit("9.0")
    return next((s for s in range(MAX_STAGES, 1, -1) if smem_bytes(d, dr, itemsize, s) <= limit), 0)


def supports(*, heads: int, d: int, dr: int, length: int, dtype, q_dtype=None) -> str | None:
    """None when this kernel runs the step (shapes of q_lat [B, heads, d], k^R [B, length, dr];
    `dtype` the cache's, `q_dtype` the queries', default the same), else one line saying why not
    (the Triton kernel, gpu.py, takes it instead)."""
    del heads  # any count: padded to whole groups of ROWS
    name, itemsize = jnp.dtype(dtype).name, jnp.dtype(dtype).itemsize
    if jnp.dtype(dtype) not in map(jnp.dtype, DTYPES):
        return f"{KERNEL} takes bfloat16 or float16 inputs, got {name}"
    if q_dtype is not None and jnp.dtype(q_dtype) != jnp.dtype(dtype):
        return f"{KERNEL} takes queries in the cache's dtype {name}, got {jnp.dtype(q_dtype).name}"
    if d % 64 or (d > CHUNK and d % CHUNK):
        return f"{KERNEL} needs a latent width that is a multiple of 64 (of {CHUNK} above {CHUNK}), got {d}"
    if dr % 64 or dr > CHUNK:
        return f"{KERNEL} needs a RoPE key width that is a multiple of 64 up to {CHUNK}, got {dr}"
    if length % ALIGN or length < TILE:
        return f"{KERNEL} needs a cache length that is a multiple of {ALIGN}, at least {TILE}, got {length}"
    if not stages_for(d, dr, itemsize):
        need = smem_bytes(d, dr, itemsize, 2)
        return f"{KERNEL} needs about {need:,} bytes of shared memory, over an H100/H200's"
    return None


def _body(
    len_ref,
    ql_ref,
    qr_ref,
    lat_ref,
    kr_ref,
    o_ref,
    m_ref,
    l_ref,
    ql_smem,
    qr_smem,
    lat_smem,
    kr_smem,
    stat_smem,
    q_bar,
    lat_bar,
    kr_bar,
    free,
    staging,
    *,
    scale,
    size,
    stages,
    wgs,
    chunk,
):
    b, g, s, wg = (lax.axis_index(n) for n in ("row", "group", "slice", "wg"))
    first, length = s * size, lat_ref.shape[1]
    end = jnp.minimum(len_ref[b], first + size)  # this slice's slots: first .. end - 1
    steps = pl.cdiv(jnp.maximum(end - first, 0), TILE)
    heads = pl.ds(g * ROWS, ROWS)

    def window(n):
        """First slot of step n's copy: its own start, or the cache's last TILE slots."""
        return pl.multiple_of(jnp.minimum(first + n * TILE, length - TILE), ALIGN)

    def fetch(n, slot):
        """Issue step n's copies (each latent chunk and the k^R tile) into ring slot `slot`."""
        slots = pl.ds(window(n), TILE)
        for c in range(wgs):
            src = lat_ref.at[b, slots, pl.ds(c * chunk, chunk)]
            plgpu.copy_gmem_to_smem(src, lat_smem.at[slot * wgs + c], lat_bar.at[slot * wgs + c])
        plgpu.copy_gmem_to_smem(kr_ref.at[b, slots], kr_smem.at[slot], kr_bar.at[slot])

    # No memory warpgroup: warpgroup 0 issues the copies (TMA: one thread, asynchronous), so the
    # kernel runs wgs x 128 threads and each keeps the 255 registers ptxas allows without
    # setmaxnreg (which the nvJitLink path drops: docs/gpu_registers.md).
    @pl.when(wg == 0)
    def _prologue():
        for c in range(wgs):
            cols = pl.ds(c * chunk, chunk)
            plgpu.copy_gmem_to_smem(ql_ref.at[b, heads, cols], ql_smem.at[c], q_bar.at[c])
        plgpu.copy_gmem_to_smem(qr_ref.at[b, heads], qr_smem, q_bar.at[wgs])
        kit.fill_ring(steps, stages, lambda n: fetch(n, n))

    def _compute():  # every warpgroup
        for c in range(wgs + 1):
            plgpu.barrier_wait(q_bar.at[c])
        m, l, acc = kit.full_rows(ROWS, -jnp.inf), kit.full_rows(ROWS, 0.0), kit.full_tile((ROWS, chunk), 0.0)

        def step(n, carry):
            acc, m, l = carry
            slot = lax.rem(n, stages)

            @pl.when((wg == 0) & (n > 0) & (n - 1 + stages < steps))
            def _refill():  # the previous step's slot, once every warpgroup has released it
                last = lax.rem(n - 1, stages)  # here, not after the step: fewer registers live
                plgpu.barrier_wait(free.at[last])
                fetch(n - 1 + stages, last)

            for c in range(wgs):
                plgpu.barrier_wait(lat_bar.at[slot * wgs + c])
            plgpu.barrier_wait(kr_bar.at[slot])
            pairs = [(ql_smem.at[c], lat_smem.at[slot * wgs + c].T) for c in range(wgs)]
            s = kit.matmul_sum([*pairs, (qr_smem, kr_smem.at[slot].T)], (ROWS, TILE))
            own = first + n * TILE  # the step's first slot; the copy may start earlier
            key = window(n) + kit.col_iota(TILE)
            bias = jnp.where((key >= own) & (key < end), 0.0, -jnp.inf)
            s = s * (scale * LOG2E) + lax.broadcast_in_dim(bias, s.shape, [1])  # base-2 logits
            p, m_new, l, alpha = kit.softmax_step(s, m, l)  # m_new finite: a step's first slot is the row's
            acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
            (acc,) = kit.accumulate(
                [acc], [p.astype(lat_smem.dtype)], [lat_smem.at[slot * wgs + wg]], staging, slot=wg
            )
            plgpu.barrier_arrive(free.at[slot])
            return acc, m_new, l

        acc, m, l = lax.fori_loop(0, steps, step, (acc, m, l))
        norm = jnp.where(l > 0, l, 1.0)  # a slice past the row's end: zeros, l = 0, m = -inf
        o_ref.at[b, s, heads, pl.ds(wg * chunk, chunk)][...] = acc / lax.broadcast_in_dim(
            norm, acc.shape, [0]
        )  # from registers: no SMEM

        @pl.when(wg == 0)
        def _():
            stat_smem.at[0][...] = m * (1 / LOG2E)
            stat_smem.at[1][...] = l
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(stat_smem.at[0], m_ref.at[b, s, heads])
            plgpu.copy_smem_to_gmem(stat_smem.at[1], l_ref.at[b, s, heads])
            plgpu.wait_smem_to_gmem(0)

    _compute()


def mla_decode_mgpu(
    q_lat, q_rope, lat, kr, lengths, scale: float, *, num_slices: int | None = None, interpret=False
):
    """`gpu.mla_decode_gpu`'s contract: q_lat [B, H, d], q_rope [B, H, d_R], latent [B, L, d], k^R
    [B, L, d_R] (bf16 or f16), lengths [B] (>= 1) -> [B, H, d] float32; `supports` says which
    shapes. `num_slices` slices per row (default: `gpu.slices`, for this GPU's multiprocessors)."""
    b, h, d = q_lat.shape
    length, dr = lat.shape[1], kr.shape[-1]
    reason = supports(heads=h, d=d, dr=dr, length=length, dtype=lat.dtype, q_dtype=q_lat.dtype)
    if reason is None and not q_rope.dtype == kr.dtype == lat.dtype:
        reason = f"{KERNEL} takes q_rope and k^R in the latent's dtype, got {q_rope.dtype}, {kr.dtype}"
    if reason is not None:
        raise ValueError(reason)
    rows = -(-h // ROWS) * ROWS
    if num_slices is None:
        count, size = gpu.slices(b, rows // ROWS, length, TILE, gpu_memory.multiprocessors())
    else:
        count, size = gpu.slice_size(length, num_slices, TILE)
    chunk = _chunk(d)
    wgs, stages = d // chunk, stages_for(d, dr, lat.dtype.itemsize)
    pad = lambda x: jnp.pad(x, ((0, 0), (0, rows - h), (0, 0)))
    body = kit.named(_body, "mla_decode_mgpu", scale=scale, size=size, stages=stages, wgs=wgs, chunk=chunk)
    out, m, l = plgpu.kernel(
        body,
        out_type=[
            jax.ShapeDtypeStruct((b, count, rows, d), jnp.float32),
            jax.ShapeDtypeStruct((b, count, rows), jnp.float32),
            jax.ShapeDtypeStruct((b, count, rows), jnp.float32),
        ],
        scratch_types=[
            kit.swizzled_smem((wgs, ROWS, chunk), lat.dtype),
            kit.swizzled_smem((ROWS, dr), lat.dtype),
            kit.swizzled_smem((stages * wgs, TILE, chunk), lat.dtype),
            kit.swizzled_smem((stages, TILE, dr), lat.dtype),
            plgpu.SMEM((2, ROWS), jnp.float32),
            plgpu.Barrier(num_barriers=wgs + 1),
            plgpu.Barrier(num_barriers=stages * wgs),
            plgpu.Barrier(num_barriers=stages),
            plgpu.Barrier(num_arrivals=wgs, num_barriers=stages),
            kit.interpreter_staging((wgs, ROWS, TILE), lat.dtype, interpret),
        ],
        grid=(b, rows // ROWS, count),
        grid_names=("row", "group", "slice"),
        num_threads=wgs,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True),
        interpret=mosaic_gpu_interpret(interpret),
    )(lengths.astype(jnp.int32), pad(q_lat), pad(q_rope), lat, kr)
    out = out[:, 0] if count == 1 else combine_partials(out, m, l, axis=1)
    return out[:, :h]
