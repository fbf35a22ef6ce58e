"""MoBA's selected earlier blocks on Hopper GPUs (Pallas -> Mosaic GPU): the same entry points,
layouts and schedule as gpu_blocks.py (the Triton kernels, kept for GPUs before Hopper), for
bf16/f16 inputs; `supports` says which configurations. A tile is `past_q_tile` rows of one
(batch, KV head, block) group (schedule.past_tiles); a row sees its whole block.

Every kernel is warp specialised: one memory warpgroup streams `kv_block`-row sub-blocks (the
forward and dq: K and V of the tile's block; dK/dV: the group's q and dO tiles with their lse
and delta) by TMA into a ring of `num_stages` SMEM slots (at least 2), with a "loaded" and a
"consumed" barrier per slot, while compute warpgroups of 64 rows each run warpgroup matmuls
(wgmma) on them: the forward and dq one warpgroup per 64 query rows of the tile (past_q_tile
64 or 128), dK/dV one per 64 keys of the block's sub-block. What stays in registers: the
online softmax (forward), dq (dq), dK and dV (dK/dV); p and dS feed their matmuls from
registers. What is not pipelined: the one-off loads of a program's own tile (q, dO, lse,
delta; K and V in dK/dV) and its output stores, and the scalar tables (each tile's KV row and
block start, each group's first tile and tile count), read from global memory once per
program. The compute warpgroups do not ping-pong their matmuls (FlashAttention 3 does), and a
step's softmax does not overlap its own matmuls.

A TMA copy into the matmuls' tiled SMEM starts on a whole 8-row tile, so a block is read from
its start rounded down to 8 (its window) and, when it does not start there (packed
documents), in one sub-block more; keys outside the block are masked (see _sub_blocks). dK/dV
come out per window of block_size + 8 rows (`window`, `window_starts`).

Interpreted (the tests), the running accumulations differ in form only (mgpu_toolkit.accumulate):
the Mosaic GPU interpreter's wgmma reads both operands from SMEM and it has no pl.run_state, so
there p and dS go through SMEM and each product is added to the accumulator in registers.
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
from pallas_kernels.common import mosaic_gpu_interpret
from pallas_kernels.moba import gpu_blocks

ROWS = 64  # rows of a compute warpgroup's matmuls (wgmma's M)
SLACK = 8  # rows of a tiled SMEM tile: a TMA copy into one starts on a multiple (see _sub_blocks)
LOG2E = math.log2(math.e)
DTYPES = (jnp.bfloat16, jnp.float16)


def window(block_size: int, dtype) -> int:
    """Rows of a group's dK/dV window: the block and SLACK rows before or after it."""
    return block_size + SLACK


def window_starts(block_start: jax.Array, block_size: int, seq_len: int, dtype) -> jax.Array:
    """tpu_blocks.window_starts' contract: each block's window starts at the block's start rounded
    down to SLACK rows (a TMA copy into tiled SMEM starts on a whole tile)."""
    start = block_start.astype(jnp.int32)
    return start - start % SLACK


def _stages(block_sizes, steps: int) -> int:
    """SMEM slots of a ring: num_stages, at least 2, at most the steps it streams."""
    return max(1, min(max(2, block_sizes.num_stages), steps))


def smem_bytes(*, head_dim: int, v_head_dim: int, itemsize: int, block_sizes, block_size: int) -> dict:
    """Each kernel's shared memory per block (bytes): its SMEM scratch as allocated below, plus
    a small allowance for barriers and reductions."""
    qt, ck = block_sizes.past_q_tile, block_sizes.kv_block
    d, dv, item = head_dim, v_head_dim, itemsize
    stages, q_stages = _stages(block_sizes, block_size // ck), max(2, block_sizes.num_stages)
    extra = 4096
    fwd = qt * d * item + qt * 4 + stages * ck * (d + dv) * item
    dq = qt * (d + dv) * item + 2 * qt * 4 + stages * ck * (d + dv) * item
    dkv = ck * (d + dv) * item + q_stages * (qt * (d + dv) * item + 2 * qt * 4)
    names = ("moba_block_fwd_mgpu", "moba_block_dq_mgpu", "moba_block_dkv_mgpu")
    return dict(zip(names, (fwd + extra, dq + extra, dkv + extra), strict=True))


def supports(*, head_dim: int, v_head_dim: int, dtype, block_sizes, block_size: int) -> str | None:
    """None when these kernels run this configuration, else one line saying why not (the caller
    then takes the Triton kernels). `auto` tiles are taken as the GPU's (BlockSizes.resolve)."""
    if not block_sizes.resolved:
        shape = dict(head_dim=head_dim, v_head_dim=v_head_dim, itemsize=jnp.dtype(dtype).itemsize)
        block_sizes = block_sizes.resolve("gpu", block_size=block_size, **shape)
    if jnp.dtype(dtype) not in map(jnp.dtype, DTYPES):
        return f"Mosaic GPU block kernels take bfloat16 or float16 inputs, got {jnp.dtype(dtype).name}"
    if head_dim % 64 or v_head_dim % 64:
        return (
            f"Mosaic GPU block kernels need head dims that are multiples of 64, got {head_dim}, {v_head_dim}"
        )
    qt, ck = block_sizes.past_q_tile, block_sizes.kv_block
    if qt not in (64, 128):
        return f"Mosaic GPU block kernels need moba.past_q_tile 64 or 128, got {qt}"
    if ck % 64:
        return f"Mosaic GPU block kernels need moba.kv_block a multiple of 64, got {ck}"
    if ck > 256 or block_size % ck:
        return f"Mosaic GPU block kernels need moba.kv_block <= 256 dividing moba.block_size {block_size}"
    sizes = smem_bytes(
        head_dim=head_dim,
        v_head_dim=v_head_dim,
        itemsize=jnp.dtype(dtype).itemsize,
        block_sizes=block_sizes,
        block_size=block_size,
    )
    kernel, need = max(sizes.items(), key=lambda item: item[1])
    limit = gpu_memory.smem_limit("9.0")
    if need > limit:
        return f"{kernel} needs about {need:,} bytes of shared memory per block, over the {limit:,} of Hopper"
    for kernel, (live, budget) in live_registers(head_dim, v_head_dim, qt, ck).items():
        if live > budget:
            return (
                f"moba_block_{kernel}_mgpu would keep about {live} float32 registers a thread live in "
                f"accumulators and score tiles (at most {budget} at moba.past_q_tile={qt} "
                f"moba.kv_block={ck}, head dims {head_dim}/{v_head_dim}): ptxas would spill"
            )
    return None


# Registers (docs/gpu_registers.md): a kernel of n compute warpgroups and the memory one runs
# 128 (n + 1) threads, and ptxas caps each thread at 65,536 / threads (multiples of 8, at most 255).
# setmaxnreg (mgpu_toolkit's compute_warpgroups and memory_warpgroup) would move the memory
# warpgroup's registers to the compute ones, but where jaxlib compiles through pip's nvJitLink (the
# GPU image's jax[cuda13] install) ptxas ignores it (C7504), so the cap without it is the one
# counted: 255 at one compute warpgroup, 168 at two, 96 at four. LIVE_REGS is the most float32
# registers (accumulators, score tiles and their bf16 copies, live_registers) a compute thread may
# keep live under a cap of 255, measured over a grid of tiles and head dims on sm_90a through
# nvJitLink; LIVE_REGS_SLACK what the rest of the step needs (addresses, row statistics, barriers'
# phases) under a lower cap (168: at most 144 live).
LIVE_REGS = 224
LIVE_REGS_SLACK = 24


def register_cap(compute_warpgroups: int) -> int:
    """Registers a thread gets without setmaxnreg: 64K over the compute and memory warpgroups'."""
    threads = 128 * (compute_warpgroups + 1)
    return min(255, 65536 // threads // 8 * 8)


def live_registers(head_dim: int, v_head_dim: int, qt: int, ck: int) -> dict[str, tuple[int, int]]:
    """kernel -> (float32 registers a compute thread keeps live across its loop, its budget). Each
    compute warpgroup has 64 rows (query rows: forward, dq; keys: dK/dV): the forward o with s and p
    (bf16: half), dq its accumulator with s, dP and dS, dK/dV both accumulators with s^T, dP^T and
    p^T / dS^T. The budget: LIVE_REGS, or the cap without setmaxnreg less LIVE_REGS_SLACK."""
    per = lambda *widths: sum(ROWS * w for w in widths) // 128
    budget = lambda warpgroups: min(LIVE_REGS, register_cap(warpgroups) - LIVE_REGS_SLACK)
    s_fwd, s_dkv = per(ck), per(qt)  # a score tile: [64, ck] (forward, dq), [64 keys, qt] (dK/dV)
    return {
        "fwd": (per(v_head_dim) + s_fwd + s_fwd // 2, budget(qt // ROWS)),
        "dq": (per(head_dim) + 2 * s_fwd + s_fwd // 2, budget(qt // ROWS)),
        "dkv": (per(head_dim, v_head_dim) + 2 * s_dkv + s_dkv // 2, budget(ck // ROWS)),
    }


def _row_bcast(x, shape):
    """A per-row vector [R] broadcast over the columns of shape [R, C]."""
    return lax.broadcast_in_dim(x, shape, [0])


# ---------------------------------------------------------------------------------------------
# A block's sub-blocks. TMA copies into wgmma's tiled SMEM start on whole 8-row tiles, and a
# block may start anywhere (packed documents), so a block starting at `start` is read from its
# window start ws = start rounded down to SLACK rows: `nsub` sub-blocks of ck keys from ws, and
# when start is not aligned one more, the last ck keys before ws + C + SLACK (in bounds: S_pad
# >= S + ALIGN); keys outside [start, start + C) and keys an earlier sub-block had are masked.


def _window_start(start):
    return pl.multiple_of(start - lax.rem(start, SLACK), SLACK)


def _sub_blocks(start, nsub):
    """Sub-blocks of the block starting at `start`: nsub, or nsub + 1 when not aligned."""
    return nsub + (lax.rem(start, SLACK) != 0).astype(jnp.int32)


def _sub_block_row(ws, j, *, ck, block_size):
    """First key of sub-block j of the window starting at ws."""
    return pl.multiple_of(jnp.minimum(ws + j * ck, ws + block_size + SLACK - ck), SLACK)


def _key_mask(shape, dim, first_key, start, ws, j, *, ck, block_size):
    """Which of the sub-block's keys (along `dim` of `shape`, from `first_key`) are this step's:
    in the block, and not in an earlier sub-block."""
    key = first_key + kit.tile_iota(shape, dim)
    return (key >= jnp.maximum(start, ws + j * ck)) & (key < start + block_size)


def _key_bias(first_key, start, ws, j, *, ck, block_size):
    """_key_mask of a [rows, ck] score tile as a column bias [ck]: 0 for this step's keys, -inf
    for the others (one add per score, where the mask is the same for every row)."""
    key = first_key + kit.col_iota(ck)
    mine = (key >= jnp.maximum(start, ws + j * ck)) & (key < start + block_size)
    return jnp.where(mine, 0.0, -jnp.inf)


def _col_bcast(x, shape):
    """A per-column vector [C] broadcast over the rows of shape [R, C]."""
    return lax.broadcast_in_dim(x, shape, [1])


def _kv_fetcher(k_ref, v_ref, kv, ws, k_smem, v_smem, k_bar, v_bar, *, ck, block_size):
    def fetch(j, slot):
        keys = pl.ds(_sub_block_row(ws, j, ck=ck, block_size=block_size), ck)
        plgpu.copy_gmem_to_smem(k_ref.at[kv, keys], k_smem.at[slot], k_bar.at[slot])
        plgpu.copy_gmem_to_smem(v_ref.at[kv, keys], v_smem.at[slot], v_bar.at[slot])

    return fetch


# ---------------------------------------------------------------------------------------------
# forward: one program per tile; W = Qt / 64 compute warpgroups, one memory warpgroup


def _fwd_body(
    kv_ref,
    start_ref,
    q_ref,
    k_ref,
    v_ref,
    o_ref,
    lse_ref,
    q_smem,
    lse_smem,
    k_smem,
    v_smem,
    q_bar,
    k_bar,
    v_bar,
    k_free,
    v_free,
    staging,
    *,
    scale,
    ck,
    block_size,
    stages,
    wgs,
):
    t, wg = lax.axis_index("tile"), lax.axis_index("wg")
    kv, start = kv_ref[t], start_ref[t]
    ws, steps = _window_start(start), _sub_blocks(start, block_size // ck)
    dv, dtype = v_ref.shape[-1], q_ref.dtype
    geometry = dict(ck=ck, block_size=block_size)

    @kit.compute_warpgroups(wg, wgs)
    def _compute():
        rows = pl.ds(wg * ROWS, ROWS)
        plgpu.copy_gmem_to_smem(q_ref.at[t, rows], q_smem.at[wg], q_bar.at[wg])
        plgpu.barrier_wait(q_bar.at[wg])
        m, l, acc = kit.full_rows(ROWS, -jnp.inf), kit.full_rows(ROWS, 0.0), kit.full_tile((ROWS, dv), 0.0)

        def step(j, carry):
            acc, m, l = carry
            slot = lax.rem(j, stages)
            plgpu.barrier_wait(k_bar.at[slot])
            s = kit.matmul(q_smem.at[wg], k_smem.at[slot].transpose((1, 0)), (ROWS, ck))
            plgpu.barrier_arrive(k_free.at[slot])
            bias = _key_bias(_sub_block_row(ws, j, **geometry), start, ws, j, **geometry)
            s = s * (scale * LOG2E) + _col_bcast(bias, s.shape)  # base-2 logits: exp2 below
            p, m_new, l, alpha = kit.softmax_step(s, m, l)  # m_new finite: every row sees a key at step 0
            plgpu.barrier_wait(v_bar.at[slot])
            acc = acc * _row_bcast(alpha, acc.shape)
            (acc,) = kit.accumulate([acc], [p.astype(dtype)], [v_smem.at[slot]], staging, slot=wg)
            plgpu.barrier_arrive(v_free.at[slot])
            return acc, m_new, l

        acc, m, l = lax.fori_loop(0, steps, step, (acc, m, l))
        o_ref.at[t, rows][...] = acc / _row_bcast(l, acc.shape)  # from registers: no SMEM
        lse_smem.at[wg][...] = (m + jnp.log2(l)) * (1 / LOG2E)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(lse_smem.at[wg], lse_ref.at[t, rows])
        plgpu.wait_smem_to_gmem(0)

    fetch = _kv_fetcher(k_ref, v_ref, kv, ws, k_smem, v_smem, k_bar, v_bar, **geometry)
    kit.memory_warpgroup(wg, wgs, steps, stages, fetch, (k_free, v_free))


def block_attention_fwd(
    q_rows,
    k,
    v,
    kv_row,
    block_start,
    tile_group,
    *,
    scale,
    block_size,
    block_sizes,
    num_groups,
    interpret=False,
):
    """gpu_blocks.block_attention_fwd's contract: q_rows [T, Qt, D], k/v [B*Hkv, S_pad, D|Dv],
    kv_row, block_start [T] -> (o [T, Qt, Dv] float32, lse [T, Qt] float32)."""
    ntiles, qt, d = q_rows.shape
    ck, dv, dtype = block_sizes.kv_block, v.shape[-1], q_rows.dtype
    wgs, stages = qt // ROWS, _stages(block_sizes, block_size // ck)
    body = kit.named(
        _fwd_body, "moba_block_fwd_mgpu", scale=scale, ck=ck, block_size=block_size, stages=stages, wgs=wgs
    )
    return plgpu.kernel(
        body,
        out_type=[
            jax.ShapeDtypeStruct((ntiles, qt, dv), jnp.float32),
            jax.ShapeDtypeStruct((ntiles, qt), jnp.float32),
        ],
        scratch_types=[
            kit.swizzled_smem((wgs, ROWS, d), dtype),
            plgpu.SMEM((wgs, ROWS), jnp.float32),
            kit.swizzled_smem((stages, ck, d), dtype),
            kit.swizzled_smem((stages, ck, dv), dtype),
            plgpu.Barrier(num_barriers=wgs),
            plgpu.Barrier(num_barriers=stages),
            plgpu.Barrier(num_barriers=stages),
            plgpu.Barrier(num_arrivals=wgs, num_barriers=stages),
            plgpu.Barrier(num_arrivals=wgs, num_barriers=stages),
            kit.interpreter_staging((wgs, ROWS, ck), dtype, interpret),
        ],
        grid=(ntiles,),
        grid_names=("tile",),
        num_threads=wgs + 1,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True),
        interpret=mosaic_gpu_interpret(interpret),
    )(kv_row.astype(jnp.int32), block_start.astype(jnp.int32), q_rows, k, v)


# ---------------------------------------------------------------------------------------------
# dq: one program per tile, as the forward (a row's dq is complete within its one block)


def _dq_body(
    kv_ref,
    start_ref,
    q_ref,
    k_ref,
    v_ref,
    do_ref,
    lse_ref,
    delta_ref,
    dq_ref,
    q_smem,
    do_smem,
    lse_smem,
    delta_smem,
    k_smem,
    v_smem,
    row_bar,
    k_bar,
    v_bar,
    k_free,
    v_free,
    staging,
    *,
    scale,
    ck,
    block_size,
    stages,
    wgs,
):
    t, wg = lax.axis_index("tile"), lax.axis_index("wg")
    kv, start = kv_ref[t], start_ref[t]
    ws, steps = _window_start(start), _sub_blocks(start, block_size // ck)
    d, dtype = q_ref.shape[-1], q_ref.dtype
    geometry = dict(ck=ck, block_size=block_size)

    @kit.compute_warpgroups(wg, wgs)
    def _compute():
        rows = pl.ds(wg * ROWS, ROWS)
        loads = ((q_ref, q_smem), (do_ref, do_smem), (lse_ref, lse_smem), (delta_ref, delta_smem))
        for i, (src, dst) in enumerate(loads):
            plgpu.copy_gmem_to_smem(src.at[t, rows], dst.at[wg], row_bar.at[i, wg])
        for i in range(len(loads)):
            plgpu.barrier_wait(row_bar.at[i, wg])
        lse, delta = kit.load_rows(lse_smem.at[wg]) * LOG2E, kit.load_rows(delta_smem.at[wg])
        dq = kit.full_tile((ROWS, d), 0.0)

        def step(j, dq):
            slot = lax.rem(j, stages)
            plgpu.barrier_wait(k_bar.at[slot])
            s = kit.matmul(q_smem.at[wg], k_smem.at[slot].transpose((1, 0)), (ROWS, ck))
            bias = _key_bias(_sub_block_row(ws, j, **geometry), start, ws, j, **geometry)
            p = jnp.exp2(s * (scale * LOG2E) - _row_bcast(lse, s.shape) + _col_bcast(bias, s.shape))
            plgpu.barrier_wait(v_bar.at[slot])
            dp = kit.matmul(do_smem.at[wg], v_smem.at[slot].transpose((1, 0)), (ROWS, ck))
            plgpu.barrier_arrive(v_free.at[slot])
            ds = p * (dp - _row_bcast(delta, dp.shape))
            (dq,) = kit.accumulate([dq], [ds.astype(dtype)], [k_smem.at[slot]], staging, slot=wg)
            plgpu.barrier_arrive(k_free.at[slot])
            return dq

        dq = lax.fori_loop(0, steps, step, dq)
        q_smem.at[wg][...] = (dq * scale).astype(dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(q_smem.at[wg], dq_ref.at[t, rows])
        plgpu.wait_smem_to_gmem(0)

    fetch = _kv_fetcher(k_ref, v_ref, kv, ws, k_smem, v_smem, k_bar, v_bar, **geometry)
    kit.memory_warpgroup(wg, wgs, steps, stages, fetch, (k_free, v_free))


# ---------------------------------------------------------------------------------------------
# dK/dV: one program per (group, sub-block of the window), ck / 64 compute warpgroups of 64 keys
# each, looping over the group's tiles (streamed: q, dO, lse, delta) with dK, dV in registers


def _dkv_body(
    first_ref,
    count_ref,
    kv_ref,
    start_ref,
    q_ref,
    k_ref,
    v_ref,
    do_ref,
    lse_ref,
    delta_ref,
    dk_ref,
    dv_ref,
    k_smem,
    v_smem,
    q_smem,
    do_smem,
    lse_smem,
    delta_smem,
    kv_bar,
    q_bar,
    do_bar,
    lse_bar,
    delta_bar,
    free,
    staging,
    *,
    scale,
    ck,
    block_size,
    stages,
    wgs,
):
    g, j, wg = lax.axis_index("group"), lax.axis_index("sub"), lax.axis_index("wg")
    nsub = block_size // ck
    kv, start = kv_ref[g], start_ref[g]
    ws = _window_start(start)
    # the extra sub-block (j = nsub) has keys only when the block is not aligned
    count = jnp.where(j < _sub_blocks(start, nsub), count_ref[g], 0)
    first_tile = first_ref[g]
    qt, d, dv, dtype = q_ref.shape[1], k_ref.shape[-1], v_ref.shape[-1], q_ref.dtype
    geometry = dict(ck=ck, block_size=block_size)

    @kit.compute_warpgroups(wg, wgs)
    def _compute():
        first_key = _sub_block_row(ws, j, **geometry) + wg * ROWS
        keys = pl.ds(first_key, ROWS)
        plgpu.copy_gmem_to_smem(k_ref.at[kv, keys], k_smem.at[wg], kv_bar.at[0, wg])
        plgpu.copy_gmem_to_smem(v_ref.at[kv, keys], v_smem.at[wg], kv_bar.at[1, wg])
        plgpu.barrier_wait(kv_bar.at[0, wg])
        plgpu.barrier_wait(kv_bar.at[1, wg])
        mask = _key_mask((ROWS, qt), 0, first_key, start, ws, j, **geometry)
        dk, dv_acc = kit.full_tile((ROWS, d), 0.0), kit.full_tile((ROWS, dv), 0.0)

        def step(i, carry):
            dk, dv_acc = carry
            slot = lax.rem(i, stages)
            for bar in (q_bar, lse_bar, do_bar, delta_bar):
                plgpu.barrier_wait(bar.at[slot])
            s_t = kit.matmul(k_smem.at[wg], q_smem.at[slot].transpose((1, 0)), (ROWS, qt))
            lse, delta = kit.load_cols(lse_smem.at[slot]) * LOG2E, kit.load_cols(delta_smem.at[slot])
            col = lambda x: lax.broadcast_in_dim(x, s_t.shape, [1])
            p_t = jnp.where(mask, jnp.exp2(s_t * (scale * LOG2E) - col(lse)), 0.0)
            (dv_acc,) = kit.accumulate([dv_acc], [p_t.astype(dtype)], [do_smem.at[slot]], staging, slot=wg)
            dp_t = kit.matmul(v_smem.at[wg], do_smem.at[slot].transpose((1, 0)), (ROWS, qt))
            ds_t = p_t * (dp_t - col(delta))
            (dk,) = kit.accumulate([dk], [ds_t.astype(dtype)], [q_smem.at[slot]], staging, slot=wg)
            plgpu.barrier_arrive(free.at[slot])
            return dk, dv_acc

        dk, dv_acc = lax.fori_loop(0, count, step, (dk, dv_acc))
        k_smem.at[wg][...] = (dk * scale).astype(dtype)
        v_smem.at[wg][...] = dv_acc.astype(dtype)
        plgpu.commit_smem()

        @pl.when(j < nsub)
        def _():
            out = pl.ds(j * ck + wg * ROWS, ROWS)
            plgpu.copy_smem_to_gmem(k_smem.at[wg], dk_ref.at[g, out], commit_group=False)
            plgpu.copy_smem_to_gmem(v_smem.at[wg], dv_ref.at[g, out], commit_group=False)
            plgpu.commit_smem_to_gmem_group()

        @pl.when((j == nsub) & (wg == wgs - 1))
        def _():  # the extra sub-block: its last SLACK keys are the window's last rows
            last, out = pl.ds(ROWS - SLACK, SLACK), pl.ds(block_size, SLACK)
            plgpu.copy_smem_to_gmem(k_smem.at[wg, last], dk_ref.at[g, out], commit_group=False)
            plgpu.copy_smem_to_gmem(v_smem.at[wg, last], dv_ref.at[g, out], commit_group=False)
            plgpu.commit_smem_to_gmem_group()

        plgpu.wait_smem_to_gmem(0)

    def fetch(i, slot):
        t = first_tile + i
        plgpu.copy_gmem_to_smem(q_ref.at[t], q_smem.at[slot], q_bar.at[slot])
        plgpu.copy_gmem_to_smem(lse_ref.at[t], lse_smem.at[slot], lse_bar.at[slot])
        plgpu.copy_gmem_to_smem(do_ref.at[t], do_smem.at[slot], do_bar.at[slot])
        plgpu.copy_gmem_to_smem(delta_ref.at[t], delta_smem.at[slot], delta_bar.at[slot])

    kit.memory_warpgroup(wg, wgs, count, stages, fetch, (free,))


def block_attention_bwd(
    q_rows,
    k,
    v,
    kv_row,
    block_start,
    tile_group,
    group_first,
    do_rows,
    lse,
    delta,
    *,
    scale,
    block_size,
    block_sizes,
    num_groups,
    interpret=False,
):
    """gpu_blocks.block_attention_bwd's contract: do_rows [T, Qt, Dv]; lse, delta [T, Qt] (+inf / 0
    on padding rows). Returns dq [T, Qt, D] in the rows' dtype, and dk [G + 1, W, D], dv [G + 1,
    W, Dv] per group over its window (W = window(block_size), from window_starts), rounded once
    (slot G: padding tiles); the caller adds these windows to the own part's dK/dV."""
    ntiles, qt, d = q_rows.shape
    ck, dv, dtype = block_sizes.kv_block, v.shape[-1], q_rows.dtype
    nsub, wgs = block_size // ck, qt // ROWS
    stages = _stages(block_sizes, nsub)
    kv_row, block_start = kv_row.astype(jnp.int32), block_start.astype(jnp.int32)
    lse, delta = lse.astype(jnp.float32), delta.astype(jnp.float32)
    static = dict(scale=scale, ck=ck, block_size=block_size)
    dq = plgpu.kernel(
        kit.named(_dq_body, "moba_block_dq_mgpu", stages=stages, wgs=wgs, **static),
        out_type=jax.ShapeDtypeStruct((ntiles, qt, d), dtype),
        scratch_types=[
            kit.swizzled_smem((wgs, ROWS, d), dtype),
            kit.swizzled_smem((wgs, ROWS, dv), dtype),
            plgpu.SMEM((wgs, ROWS), jnp.float32),
            plgpu.SMEM((wgs, ROWS), jnp.float32),
            kit.swizzled_smem((stages, ck, d), dtype),
            kit.swizzled_smem((stages, ck, dv), dtype),
            plgpu.Barrier(num_barriers=(4, wgs)),
            plgpu.Barrier(num_barriers=stages),
            plgpu.Barrier(num_barriers=stages),
            plgpu.Barrier(num_arrivals=wgs, num_barriers=stages),
            plgpu.Barrier(num_arrivals=wgs, num_barriers=stages),
            kit.interpreter_staging((wgs, ROWS, ck), dtype, interpret),
        ],
        grid=(ntiles,),
        grid_names=("tile",),
        num_threads=wgs + 1,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True),
        interpret=mosaic_gpu_interpret(interpret),
    )(kv_row, block_start, q_rows, k, v, do_rows, lse, delta)

    tables = gpu_blocks.group_tables(tile_group, kv_row, block_start, num_groups)
    kwgs, qstages = ck // ROWS, max(2, block_sizes.num_stages)  # as smem_bytes
    width = window(block_size, dtype)
    dk, dvv = plgpu.kernel(
        kit.named(_dkv_body, "moba_block_dkv_mgpu", stages=qstages, wgs=kwgs, **static),
        out_type=[
            jax.ShapeDtypeStruct((num_groups + 1, width, d), dtype),
            jax.ShapeDtypeStruct((num_groups + 1, width, dv), dtype),
        ],
        scratch_types=[
            kit.swizzled_smem((kwgs, ROWS, d), dtype),
            kit.swizzled_smem((kwgs, ROWS, dv), dtype),
            kit.swizzled_smem((qstages, qt, d), dtype),
            kit.swizzled_smem((qstages, qt, dv), dtype),
            plgpu.SMEM((qstages, qt), jnp.float32),
            plgpu.SMEM((qstages, qt), jnp.float32),
            plgpu.Barrier(num_barriers=(2, kwgs)),
            plgpu.Barrier(num_barriers=qstages),
            plgpu.Barrier(num_barriers=qstages),
            plgpu.Barrier(num_barriers=qstages),
            plgpu.Barrier(num_barriers=qstages),
            plgpu.Barrier(num_arrivals=kwgs, num_barriers=qstages),
            kit.interpreter_staging((kwgs, ROWS, qt), dtype, interpret),
        ],
        grid=(num_groups + 1, nsub + 1),
        grid_names=("group", "sub"),
        num_threads=kwgs + 1,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True),
        interpret=mosaic_gpu_interpret(interpret),
    )(*tables, q_rows, k, v, do_rows, lse, delta)
    return dq, dk, dvv
