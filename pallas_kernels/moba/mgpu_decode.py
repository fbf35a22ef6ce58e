"""MoBA decode step on Hopper GPUs (Pallas -> Mosaic GPU), split over the selected blocks exactly as
`gpu_decode.py` (the Pallas Triton kernel, kept for GPUs before Hopper): one program per (batch
row, query head, piece of a selected block), the same tables (`ops.moba_decode.select_blocks`),
the same pieces' partials and the same XLA combine.

A program's one query is padded with zero rows to the 64 rows a warpgroup matmul (wgmma) takes:
the matmuls do 64x the useful work, which still leaves the step memory-bound (64 multiply-adds per
cache element read), and only row 0's output and statistics are written. The piece's K and V stream
in TILE-slot tiles by TMA through a ring of SMEM slots (the copy of tile n + stages issued once tile
n's matmuls are done), with an online softmax in registers; one warpgroup per program, no memory
warpgroup. A TMA copy reads whole 8-row tiles: the cache length and the block (`size`) must be
multiples of 8 and of TILE respectively, which `supports` checks.

Interpreted (the tests), p goes through SMEM to its matmul and each product is added to the
accumulator in registers (mgpu_toolkit.accumulate: the Mosaic GPU interpreter's wgmma reads only
SMEM operands and it has no pl.run_state).
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

ROWS = 64  # a warpgroup matmul's rows: the query padded to them
TILE = 64  # cache slots per step
MAX_STAGES = 4
MAX_DIM = 256  # wgmma's largest N: head dims within it
FLOOR = -1e30  # the running max before any slot: finite, so a tile with no slot that counts adds 0
LOG2E = math.log2(math.e)
DTYPES = (jnp.bfloat16, jnp.float16)
KERNEL = "the Mosaic GPU MoBA decode kernel"  # how its refusals name it


def smem_bytes(d: int, dv: int, itemsize: int, stages: int) -> int:
    """Shared memory per program (bytes), compiled: the padded query, `stages` ring slots of a K and
    a V tile, the output row's and the statistics' staging, 1024-byte aligned, barriers, and the
    reductions' scratch (2 KiB)."""
    buf = lambda n: -(-n // 1024) * 1024
    return (
        buf(ROWS * d * itemsize)
        + stages * (buf(TILE * d * itemsize) + buf(TILE * dv * itemsize))
        + buf(dv * 4)
        + buf(2 * ROWS * 4)
        + 8 * (1 + 2 * stages)
        + 2048
    )


def supports(*, head_dim: int, v_head_dim: int, size: int, length: int, dtype) -> str | None:
    """None when this kernel runs the step (q [B, Hq, head_dim], caches [B, Hkv, length, D|Dv],
    blocks of `size` slots), else one line saying why not (the Triton kernel takes it instead)."""
    if jnp.dtype(dtype) not in map(jnp.dtype, DTYPES):
        return f"{KERNEL} takes bfloat16 or float16 inputs, got {jnp.dtype(dtype).name}"
    for name, width in (("head dim", head_dim), ("value head dim", v_head_dim)):
        if width % 64 or width > MAX_DIM:
            return f"{KERNEL} needs a {name} that is a multiple of 64 up to {MAX_DIM}, got {width}"
    if size % TILE:
        return f"{KERNEL} needs blocks of a multiple of {TILE} cache slots, got {size}"
    if length % 8:
        return f"{KERNEL} needs a cache length that is a multiple of 8, got {length}"
    if smem_bytes(head_dim, v_head_dim, jnp.dtype(dtype).itemsize, 2) > gpu_memory.smem_limit("9.0"):
        return (
            f"{KERNEL} needs more shared memory than an H100/H200 has at head dims {head_dim}, {v_head_dim}"
        )
    return None


def pieces(programs: int, size: int, multiprocessors: int) -> int:
    """Pieces per block (a power of two): the fewest with which `programs` (rows x heads x blocks)
    times pieces cover the multiprocessors, each piece whole TILEs."""
    count = 1
    while programs * count < multiprocessors and (size // TILE) % (2 * count) == 0:
        count *= 2
    return count


def _body(
    start_ref,
    lo_ref,
    hi_ref,
    q_ref,
    k_ref,
    v_ref,
    o_ref,
    m_ref,
    l_ref,
    q_smem,
    k_smem,
    v_smem,
    o_smem,
    stat_smem,
    q_bar,
    k_bar,
    v_bar,
    staging,
    *,
    scale,
    piece,
    parts,
    group,
    blocks,
    stages,
):
    b, h, p = lax.axis_index("row"), lax.axis_index("head"), lax.axis_index("piece")
    nh = lax.axis_size("head")
    j = p // parts  # the selected block this piece belongs to
    entry = (b * nh + h) * blocks + j
    kv, lo, hi = h // group, lo_ref[entry], hi_ref[entry]
    first = start_ref[entry] + lax.rem(p, parts) * piece
    steps = piece // TILE
    plgpu.copy_gmem_to_smem(q_ref.at[b, h], q_smem, q_bar.at[0])

    def fetch(n):
        slot, slots = lax.rem(n, stages), pl.ds(pl.multiple_of(first + n * TILE, 8), TILE)
        plgpu.copy_gmem_to_smem(k_ref.at[b, kv, slots], k_smem.at[slot], k_bar.at[slot])
        plgpu.copy_gmem_to_smem(v_ref.at[b, kv, slots], v_smem.at[slot], v_bar.at[slot])

    kit.fill_ring(steps, stages, fetch)
    plgpu.barrier_wait(q_bar.at[0])

    def step(n, carry):
        acc, m, l = carry
        slot = lax.rem(n, stages)
        plgpu.barrier_wait(k_bar.at[slot])
        s = kit.matmul(q_smem, k_smem.at[slot].T, (ROWS, TILE))
        key = first + n * TILE + kit.col_iota(TILE)
        bias = jnp.where((key >= lo) & (key <= hi), 0.0, -jnp.inf)
        s = s * (scale * LOG2E) + lax.broadcast_in_dim(bias, s.shape, [1])  # base-2 logits
        e, m_new, l, alpha = kit.softmax_step(s, m, l)
        acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
        plgpu.barrier_wait(v_bar.at[slot])
        (acc,) = kit.accumulate([acc], [e.astype(v_smem.dtype)], [v_smem.at[slot]], staging)
        kit.refill_ring(n, steps, stages, fetch)  # slot's last readers, this step's matmuls, are done
        return acc, m_new, l

    m, l = kit.full_rows(ROWS, FLOOR), kit.full_rows(ROWS, 0.0)
    acc = kit.full_tile((ROWS, v_smem.shape[-1]), 0.0)
    acc, m, l = lax.fori_loop(0, steps, step, (acc, m, l))
    norm = jnp.where(l > 0, l, 1.0)  # no slot counts: zeros, l = 0, m = -inf
    first_row = kit.tile_iota(acc.shape, 0) == 0
    out = jnp.where(first_row, acc / lax.broadcast_in_dim(norm, acc.shape, [0]), 0.0)
    o_smem[...] = out.sum(axis=0)  # row 0, the real query's: the other rows are zeroed
    stat_smem.at[0][...] = jnp.where(l > 0, m * (1 / LOG2E), -jnp.inf)
    stat_smem.at[1][...] = l
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(o_smem, o_ref.at[b, h, p])
    plgpu.copy_smem_to_gmem(stat_smem.at[0], m_ref.at[b, h, p])
    plgpu.copy_smem_to_gmem(stat_smem.at[1], l_ref.at[b, h, p])
    plgpu.wait_smem_to_gmem(0)


def moba_decode_mgpu(
    q, k_cache, v_cache, starts, lo, hi, size: int, scale: float, interpret: bool = False, num_pieces=None
):
    """`gpu_decode.moba_decode_gpu`'s contract: q [B, Hq, D] (one new token per row), head-major
    caches [B, Hkv, L, D|Dv] (bf16/f16), tables [B, Hq, blocks] -> [B, Hq, Dv] in q's dtype;
    `supports` says which shapes. `num_pieces` (pieces per block; default `pieces`) divides size /
    TILE."""
    b, hq, d = q.shape
    dv, blocks, length = v_cache.shape[-1], starts.shape[-1], k_cache.shape[2]
    reason = supports(head_dim=d, v_head_dim=dv, size=size, length=length, dtype=k_cache.dtype)
    if reason is None and not q.dtype == k_cache.dtype == v_cache.dtype:
        reason = (
            f"{KERNEL} takes q and the caches in one dtype, got {q.dtype}, {k_cache.dtype}, {v_cache.dtype}"
        )
    if reason is not None:
        raise ValueError(reason)
    parts = num_pieces or pieces(b * hq * blocks, size, gpu_memory.multiprocessors())
    piece = size // parts
    stages = max(1, min(MAX_STAGES, piece // TILE))
    while stages > 1 and smem_bytes(d, dv, q.dtype.itemsize, stages) > gpu_memory.smem_limit("9.0"):
        stages -= 1
    shape = (b, hq, blocks * parts)
    body = kit.named(
        _body,
        "moba_decode_mgpu",
        scale=scale,
        piece=piece,
        parts=parts,
        group=hq // k_cache.shape[1],
        blocks=blocks,
        stages=stages,
    )
    padded = jnp.zeros((b, hq, ROWS, d), q.dtype).at[:, :, 0].set(q)  # the query as row 0 of 64
    flat = lambda x: x.astype(jnp.int32).reshape(-1)
    out, m, l = plgpu.kernel(
        body,
        out_type=[
            jax.ShapeDtypeStruct((*shape, dv), jnp.float32),
            jax.ShapeDtypeStruct((*shape, ROWS), jnp.float32),
            jax.ShapeDtypeStruct((*shape, ROWS), jnp.float32),
        ],
        scratch_types=[
            kit.swizzled_smem((ROWS, d), q.dtype),
            kit.swizzled_smem((stages, TILE, d), q.dtype),
            kit.swizzled_smem((stages, TILE, dv), q.dtype),
            plgpu.SMEM((dv,), jnp.float32),
            plgpu.SMEM((2, ROWS), jnp.float32),
            plgpu.Barrier(num_barriers=1),
            plgpu.Barrier(num_barriers=stages),
            plgpu.Barrier(num_barriers=stages),
            kit.interpreter_staging((ROWS, TILE), q.dtype, interpret),
        ],
        grid=shape,
        grid_names=("row", "head", "piece"),
        compiler_params=plgpu.CompilerParams(approx_math=True),
        interpret=mosaic_gpu_interpret(interpret),
    )(flat(starts), flat(lo), flat(hi), padded, k_cache, v_cache)
    return combine_partials(out, m[..., 0], l[..., 0], axis=2).astype(q.dtype)
