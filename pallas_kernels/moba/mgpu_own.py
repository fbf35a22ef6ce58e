"""MoBA's own block on Hopper GPUs (Pallas -> Mosaic GPU): the same schedule, tables and layouts
as gpu_own.py (the Pallas Triton kernels, kept for GPUs before Hopper), with warpgroup matmuls
(wgmma) on 64-row tiles and TMA copies into a ring of shared-memory stages.

A query t sees the keys [own_start[t], t]. Each kernel runs one warpgroup per program:
* forward and dq: one program per (batch x query head, tile of `q_tile` queries); its query
  tile (dq: and dO) is copied into shared memory once, the K/V sub-blocks of `kv_block` keys
  from the tile's first own-block start (the `first` table) to its last query stream through a
  ring of `num_stages` buffers: the copy of sub-block n + stages is issued as soon as sub-block
  n's matmuls have finished reading its slot, so it overlaps the next steps' compute. The online
  softmax (forward) and dS (dq) stay in registers in the wgmma layout, and p / dS feed the
  second matmul from registers, accumulating into o / dq in place. The forward's float32 o is
  staged for its copy out in the ring's shared memory (a RefUnion), so that at the default tiles
  (64 / 64, two stages, head dim 128) each kernel asks for under half an H100/H200 SM's shared
  memory (smem_bytes) and two programs can share an SM.
* dK/dV: one program per (batch x KV head, sub-block of `kv_block` keys); K and V are copied
  once, and the (query head, query tile) pairs that reach these keys (GQA heads of the KV head,
  tiles up to the `q_end` table) stream q, dO, lse, delta and own starts through the same kind
  of ring; dK and dV accumulate in registers and are written once.
Pipelined: the streamed operands (TMA, `num_stages` slots), and within a step the two matmuls
that need only shared memory (S and dP; dK/dV: S^T and dP^T, then its two accumulations) are
issued together before one wait. Not pipelined: the copies of the once-per-program operands
(waited for before the first step), the write of the results, and a step's matmuls against its
softmax (each step waits for its own wgmmas before the elementwise work). One warpgroup per
program: no producer warpgroup and no ping-pong between two consumer warpgroups (FlashAttention
3's schedule), the next steps for speed.

Interpreted (`interpret=True`), p and dS go through a shared-memory staging buffer into a fresh
accumulator that is then added (mgpu_toolkit.accumulate): the interpreter's wgmma reads only
shared memory and cannot store into an accumulator. Only that operand path differs from the GPU's.
Constraints (`supports`): bf16/f16 inputs, head dims and tiles multiples of 64 up to 256, shared
memory (`smem_bytes`) within an H100/H200's, and a register budget (`live_registers`, LIVE_REGS).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import mgpu_toolkit as kit
from pallas_kernels.common import mosaic_gpu_interpret
from pallas_kernels.gpu_memory import smem_limit
from pallas_kernels.moba.gpu_own import kv_row, own_tables  # noqa: F401  (own_tables: the same tables)

SMEM_LIMIT = smem_limit("9.0")  # bytes of shared memory one block may use on an H100/H200

LOG2E = math.log2(math.e)
LN2 = math.log(2.0)
ROWS = 64  # a warpgroup matmul's rows, and the K dim a 128-byte swizzled bf16 operand comes in
MAX_DIM = 256  # a warpgroup matmul's largest N: head dims and tiles stay within it
# Registers (docs/gpu_registers.md): each kernel is one warpgroup of 128 threads, so ptxas allows a
# thread 255 registers and no setmaxnreg is involved. What a thread keeps live across a step, in
# float32 registers (a [rows, cols] float32 tile is rows * cols / 128 of them): its accumulators
# (forward o, dq, dK and dV), its float32 score tiles (the forward s, dq s and dP, dK/dV s^T and
# dP^T) and, at half that, their bf16 copies fed to the second matmul (p, dS). LIVE_REGS is the most
# of those that compiled without a spill on sm_90a over a grid of tiles, head dims and stages
# (64/128 rows, 64-256 keys, head dims 64-256, 2-4 stages); every set estimated above it spilled
# or sat at 255 registers.
LIVE_REGS = 208
ACC_REGS = 128  # at most in accumulators alone (dK + dV at kv_block 64, head dim 128)
FLOOR = -1e30  # the running max before any key: finite, so a row with no key yet gets p = 0, not NaN
DTYPES = (jnp.bfloat16, jnp.float16)


def smem_bytes(*, q_tile: int, kv_block: int, stages: int, d: int, dv: int, itemsize: int) -> dict:
    """Each compiled kernel's shared memory per block (bytes, by kernel name), as Mosaic GPU lays it
    out: every scratch buffer 1024-byte aligned, 8 bytes per barrier and, in the forward (the only
    one with row reductions), the reduction scratch (CompilerParams' default, 2 KiB). Checked to
    the byte against the lowering's own count (tests/test_moba_mgpu_own.py)."""
    buf = lambda *shape, size=itemsize: -(-math.prod(shape) * size // 1024) * 1024
    vec = buf(q_tile, size=4)
    ring = buf(stages, kv_block, d) + buf(stages, kv_block, dv)
    reduction = 2048
    return {
        "moba_own_fwd_mgpu": reduction
        + buf(q_tile, d)
        + max(ring, buf(q_tile, dv, size=4))  # o is staged where the ring was
        + 2 * vec
        + 8 * (2 + 2 * stages),
        "moba_own_dq_mgpu": buf(q_tile, d) + buf(q_tile, dv) + ring + 3 * vec + 8 * (5 + 2 * stages),
        "moba_own_dkv_mgpu": buf(kv_block, d)
        + buf(kv_block, dv)
        + buf(stages, q_tile, d)
        + buf(stages, q_tile, dv)
        + 3 * buf(stages, q_tile, size=4)
        + 8 * (2 + 5 * stages),
    }


def supports(*, head_dim, v_head_dim, dtype, block_sizes, block_size) -> str | None:
    """None when these kernels compile for this configuration on an H100/H200, else one line
    saying why not (the Triton kernels, gpu_own.py, take it instead). The MoBA block itself
    sets no condition: the tables carry it."""
    del block_size
    if jnp.dtype(dtype) not in [jnp.dtype(t) for t in DTYPES]:
        return f"Mosaic GPU own-block kernels take bfloat16 or float16 inputs, got {jnp.dtype(dtype).name}"
    qt, ck, stages = block_sizes.q_tile, block_sizes.kv_block, block_sizes.num_stages
    sizes = (("the head dim", head_dim), ("the value head dim", v_head_dim), ("moba.q_tile", qt))
    for name, value in (*sizes, ("moba.kv_block", ck)):
        if value is None or value % ROWS or value > MAX_DIM:
            allowed = f"a multiple of {ROWS} up to {MAX_DIM}"
            return f"Mosaic GPU own-block kernels need {name} {allowed}, got {value}"
    if stages is None:
        return "Mosaic GPU own-block kernels need moba.num_stages resolved, got auto"
    sizes = smem_bytes(
        q_tile=qt, kv_block=ck, stages=stages, d=head_dim, dv=v_head_dim, itemsize=jnp.dtype(dtype).itemsize
    )
    name, need = max(sizes.items(), key=lambda item: item[1])
    tiles = f"moba.q_tile={qt} moba.kv_block={ck}"
    if need > SMEM_LIMIT:
        return (
            f"{name} needs about {need} bytes of shared memory with {tiles} "
            f"moba.num_stages={stages}, over the {SMEM_LIMIT} an H100/H200 allows"
        )
    for name, (acc, scores, live) in live_registers(head_dim, v_head_dim, qt, ck, stages).items():
        if acc > ACC_REGS or live > LIVE_REGS:
            return (
                f"{name} would keep about {live} float32 registers a thread live ({acc} accumulator "
                f"registers, score tiles of {scores}; at most {LIVE_REGS}, accumulators {ACC_REGS}) with "
                f"{tiles} at head dims {head_dim}/{v_head_dim}: ptxas would spill"
            )
    return None


def live_registers(head_dim: int, v_head_dim: int, q_tile: int, kv_block: int, stages: int = 2) -> dict:
    """kernel name -> (accumulator registers, one score tile's registers, the estimated live set),
    float32 registers per thread of the kernel's one warpgroup (128 threads): the forward o with s
    and p (bf16: half), dq its accumulator with s, dP and dS, dK/dV both accumulators with s^T, dP^T
    and p^T / dS^T. A ring of stages that is not a power of two costs dK/dV 16 more (its slot, a
    remainder by 3, is not a mask: 64 / 64 at head dim 128 spilled 120 bytes at 3 stages, none at 2
    or 4)."""
    per = lambda rows, cols: rows * cols // 128
    ring = 16 if stages & (stages - 1) else 0
    score = per(q_tile, kv_block)
    fwd, dq, dkv = per(q_tile, v_head_dim), per(q_tile, head_dim), per(kv_block, head_dim + v_head_dim)
    return {
        "moba_own_fwd_mgpu": (fwd, score, fwd + score + score // 2),
        "moba_own_dq_mgpu": (dq, score, dq + 2 * score + score // 2),
        "moba_own_dkv_mgpu": (dkv, score, dkv + 2 * score + score // 2 + ring),
    }


def _own_mask(lo, q0, k0, shape):
    """[Qt, Ck]: key k0 + c is in query q0 + r's own block up to itself (lo: [Qt] starts)."""
    qpos, kpos = q0 + kit.tile_iota(shape, 0), k0 + kit.tile_iota(shape, 1)
    return (kpos >= lax.broadcast_in_dim(lo, shape, [0])) & (kpos <= qpos)


def _fwd_body(
    first_ref,
    q_ref,
    lo_ref,
    k_ref,
    v_ref,
    o_ref,
    lse_ref,
    q_smem,
    lo_smem,
    kv_or_o,
    lse_smem,
    q_bar,
    k_bar,
    v_bar,
    staging,
    *,
    scale,
    qt,
    ck,
    hq,
    hkv,
    nq,
    stages,
):
    (k_smem, v_smem), o_smem = kv_or_o  # o is staged where the K/V ring was: the ring is done by then
    r, i = lax.axis_index("rows"), lax.axis_index("tiles")
    b, kv, q0 = r // hq, kv_row(r, hq, hkv), i * qt
    first = first_ref[b * nq + i]
    steps = (q0 + qt - 1) // ck + 1 - first
    plgpu.copy_gmem_to_smem(q_ref.at[r, pl.ds(q0, qt), :], q_smem, q_bar.at[0])
    plgpu.copy_gmem_to_smem(lo_ref.at[b, pl.ds(q0, qt)], lo_smem, q_bar.at[1])

    def fetch(n):
        slot, keys = lax.rem(n, stages), pl.ds((first + n) * ck, ck)
        plgpu.copy_gmem_to_smem(k_ref.at[kv, keys, :], k_smem.at[slot], k_bar.at[slot])
        plgpu.copy_gmem_to_smem(v_ref.at[kv, keys, :], v_smem.at[slot], v_bar.at[slot])

    kit.fill_ring(steps, stages, fetch)
    plgpu.barrier_wait(q_bar.at[0])
    plgpu.barrier_wait(q_bar.at[1])
    lo = kit.load_rows(lo_smem)
    dv = o_ref.shape[-1]

    def step(n, carry):
        m, l, acc = carry
        slot = lax.rem(n, stages)
        plgpu.barrier_wait(k_bar.at[slot])
        s = kit.matmul(q_smem, k_smem.at[slot].T, (qt, ck))
        mask = _own_mask(lo, q0, (first + n) * ck, (qt, ck))
        s = jnp.where(mask, s * (scale * LOG2E), -jnp.inf)  # log2 units
        p, m_new, l, alpha = kit.softmax_step(s, m, l)
        acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
        plgpu.barrier_wait(v_bar.at[slot])
        (acc,) = kit.accumulate([acc], [p.astype(v_smem.dtype)], [v_smem.at[slot]], staging)
        kit.refill_ring(n, steps, stages, fetch)
        return m_new, l, acc

    m, l, acc = kit.full_rows(qt, FLOOR), kit.full_rows(qt, 0.0), kit.full_tile((qt, dv), 0.0)
    m, l, acc = lax.fori_loop(0, steps, step, (m, l, acc))
    o_smem[...] = acc / lax.broadcast_in_dim(l, acc.shape, [0])  # every row sees itself: l > 0
    lse_smem[...] = (m + jnp.log2(l)) * LN2
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(o_smem, o_ref.at[r, pl.ds(q0, qt), :])
    plgpu.copy_smem_to_gmem(lse_smem, lse_ref.at[r, pl.ds(q0, qt)])
    plgpu.wait_smem_to_gmem(0)


def own_attention_fwd(q, k, v, lo, first, *, scale, block_size, block_sizes, interpret=False):
    """q [B*Hq, S_pad, D], k/v [B*Hkv, S_pad, D|Dv], tables from own_tables ->
    (o [B*Hq, S_pad, Dv] float32, lse [B*Hq, S_pad, 1])."""
    del block_size
    rows, seq_pad, d = q.shape
    qt, ck, dv = block_sizes.q_tile, block_sizes.kv_block, v.shape[-1]
    b = lo.shape[0]
    hq, hkv, nq = rows // b, k.shape[0] // b, seq_pad // qt
    stages = block_sizes.num_stages
    o, lse = plgpu.kernel(
        functools.partial(_fwd_body, scale=scale, qt=qt, ck=ck, hq=hq, hkv=hkv, nq=nq, stages=stages),
        out_type=[
            jax.ShapeDtypeStruct((rows, seq_pad, dv), jnp.float32),
            jax.ShapeDtypeStruct((rows, seq_pad), jnp.float32),
        ],
        scratch_types=[
            kit.swizzled_smem((qt, d), q.dtype),
            plgpu.SMEM((qt,), jnp.int32),
            plgpu.RefUnion(
                (kit.swizzled_smem((stages, ck, d), k.dtype), kit.swizzled_smem((stages, ck, dv), v.dtype)),
                kit.swizzled_smem((qt, dv), jnp.float32),
            ),
            plgpu.SMEM((qt,), jnp.float32),
            plgpu.Barrier(num_barriers=2),
            plgpu.Barrier(num_barriers=stages),
            plgpu.Barrier(num_barriers=stages),
            kit.interpreter_staging((qt, ck), v.dtype, interpret),
        ],
        grid=(rows, nq),
        grid_names=("rows", "tiles"),
        compiler_params=plgpu.CompilerParams(approx_math=True),
        interpret=mosaic_gpu_interpret(interpret),
        kernel_name="moba_own_fwd_mgpu",
    )(first, q, lo.reshape(b, seq_pad), k, v)
    return o, lse[..., None]


def _dq_body(
    first_ref,
    q_ref,
    lo_ref,
    do_ref,
    lse_ref,
    delta_ref,
    k_ref,
    v_ref,
    dq_ref,
    q_smem,
    do_smem,
    lo_smem,
    lse_smem,
    delta_smem,
    k_smem,
    v_smem,
    q_bar,
    k_bar,
    v_bar,
    staging,
    *,
    scale,
    qt,
    ck,
    hq,
    hkv,
    nq,
    stages,
):
    r, i = lax.axis_index("rows"), lax.axis_index("tiles")
    b, kv, q0 = r // hq, kv_row(r, hq, hkv), i * qt
    first = first_ref[b * nq + i]
    steps = (q0 + qt - 1) // ck + 1 - first
    rows = pl.ds(q0, qt)
    once = [
        (q_ref.at[r, rows, :], q_smem),
        (do_ref.at[r, rows, :], do_smem),
        (lo_ref.at[b, rows], lo_smem),
        (lse_ref.at[r, rows], lse_smem),
        (delta_ref.at[r, rows], delta_smem),
    ]
    for n, (src, dst) in enumerate(once):
        plgpu.copy_gmem_to_smem(src, dst, q_bar.at[n])

    def fetch(n):
        slot, keys = lax.rem(n, stages), pl.ds((first + n) * ck, ck)
        plgpu.copy_gmem_to_smem(k_ref.at[kv, keys, :], k_smem.at[slot], k_bar.at[slot])
        plgpu.copy_gmem_to_smem(v_ref.at[kv, keys, :], v_smem.at[slot], v_bar.at[slot])

    kit.fill_ring(steps, stages, fetch)
    for n in range(len(once)):
        plgpu.barrier_wait(q_bar.at[n])
    lo, lse, delta = kit.load_rows(lo_smem), kit.load_rows(lse_smem) * LOG2E, kit.load_rows(delta_smem)
    shape = (qt, ck)

    def step(n, dq):
        slot = lax.rem(n, stages)
        plgpu.barrier_wait(k_bar.at[slot])
        plgpu.barrier_wait(v_bar.at[slot])
        s, dp = kit.matmuls((q_smem, k_smem.at[slot].T), (do_smem, v_smem.at[slot].T), shape=shape)
        mask = _own_mask(lo, q0, (first + n) * ck, shape)
        p = jnp.where(mask, jnp.exp2(s * (scale * LOG2E) - lax.broadcast_in_dim(lse, shape, [0])), 0.0)
        ds = p * (dp - lax.broadcast_in_dim(delta, shape, [0]))
        (dq,) = kit.accumulate([dq], [ds.astype(k_smem.dtype)], [k_smem.at[slot]], staging)
        kit.refill_ring(n, steps, stages, fetch)
        return dq

    dq = lax.fori_loop(0, steps, step, kit.full_tile(q_smem.shape, 0.0))
    q_smem[...] = (dq * scale).astype(q_smem.dtype)  # q's last reader, the last step's matmul, is done
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(q_smem, dq_ref.at[r, rows, :])
    plgpu.wait_smem_to_gmem(0)


def _dkv_body(
    q_end_ref,
    k_ref,
    v_ref,
    q_ref,
    lo_ref,
    do_ref,
    lse_ref,
    delta_ref,
    dk_ref,
    dv_ref,
    k_smem,
    v_smem,
    q_smem,
    do_smem,
    lo_smem,
    lse_smem,
    delta_smem,
    kv_bar,
    q_bar,
    do_bar,
    lo_bar,
    lse_bar,
    delta_bar,
    staging,
    *,
    scale,
    qt,
    ck,
    hq,
    hkv,
    nk,
    stages,
):
    rk, j = lax.axis_index("rows"), lax.axis_index("tiles")
    b, group, k0 = rk // hkv, hq // hkv, j * ck
    i0 = k0 // qt
    tiles = q_end_ref[b * nk + j] - i0  # query tiles that reach these keys, per query head
    steps = group * tiles
    row0 = b * hq + (rk % hkv) * group  # the first query head of this KV head
    keys = pl.ds(k0, ck)
    plgpu.copy_gmem_to_smem(k_ref.at[rk, keys, :], k_smem, kv_bar.at[0])
    plgpu.copy_gmem_to_smem(v_ref.at[rk, keys, :], v_smem, kv_bar.at[1])

    def fetch(n):
        slot, r = lax.rem(n, stages), row0 + n // tiles
        rows = pl.ds((i0 + lax.rem(n, tiles)) * qt, qt)
        plgpu.copy_gmem_to_smem(q_ref.at[r, rows, :], q_smem.at[slot], q_bar.at[slot])
        plgpu.copy_gmem_to_smem(do_ref.at[r, rows, :], do_smem.at[slot], do_bar.at[slot])
        plgpu.copy_gmem_to_smem(lo_ref.at[b, rows], lo_smem.at[slot], lo_bar.at[slot])
        plgpu.copy_gmem_to_smem(lse_ref.at[r, rows], lse_smem.at[slot], lse_bar.at[slot])
        plgpu.copy_gmem_to_smem(delta_ref.at[r, rows], delta_smem.at[slot], delta_bar.at[slot])

    kit.fill_ring(steps, stages, fetch)
    plgpu.barrier_wait(kv_bar.at[0])
    plgpu.barrier_wait(kv_bar.at[1])
    shape = (ck, qt)  # transposed scores: keys x queries

    def step(n, carry):
        dk, dv = carry
        slot, q0 = lax.rem(n, stages), (i0 + lax.rem(n, tiles)) * qt
        plgpu.barrier_wait(q_bar.at[slot])
        plgpu.barrier_wait(do_bar.at[slot])
        s_t, dp_t = kit.matmuls((k_smem, q_smem.at[slot].T), (v_smem, do_smem.at[slot].T), shape=shape)
        plgpu.barrier_wait(lo_bar.at[slot])
        plgpu.barrier_wait(lse_bar.at[slot])
        lo, lse = kit.load_cols(lo_smem.at[slot]), kit.load_cols(lse_smem.at[slot]) * LOG2E
        kpos, qpos = k0 + kit.tile_iota(shape, 0), q0 + kit.tile_iota(shape, 1)
        mask = (kpos >= lax.broadcast_in_dim(lo, shape, [1])) & (kpos <= qpos)
        p_t = jnp.where(mask, jnp.exp2(s_t * (scale * LOG2E) - lax.broadcast_in_dim(lse, shape, [1])), 0.0)
        plgpu.barrier_wait(delta_bar.at[slot])
        ds_t = p_t * (dp_t - lax.broadcast_in_dim(kit.load_cols(delta_smem.at[slot]), shape, [1]))
        cast = lambda x: x.astype(q_smem.dtype)
        dk, dv = kit.accumulate(
            [dk, dv], [cast(ds_t), cast(p_t)], [q_smem.at[slot], do_smem.at[slot]], staging
        )
        kit.refill_ring(n, steps, stages, fetch)
        return dk, dv

    zeros = lambda ref: kit.full_tile(ref.shape, 0.0)
    dk, dv = lax.fori_loop(0, steps, step, (zeros(k_smem), zeros(v_smem)))
    k_smem[...] = (dk * scale).astype(k_smem.dtype)  # K's and V's last readers are done
    v_smem[...] = dv.astype(v_smem.dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(k_smem, dk_ref.at[rk, keys, :])
    plgpu.copy_smem_to_gmem(v_smem, dv_ref.at[rk, keys, :])
    plgpu.wait_smem_to_gmem(0)


def own_attention_bwd(
    q, k, v, lo, first, q_end, do, lse, delta, *, scale, block_size, block_sizes, interpret=False
):
    """q/do [B*Hq, S_pad, D|Dv], lse/delta [B*Hq, S_pad, 1] (padding rows: lse +inf, delta 0)
    -> (dq [B*Hq, S_pad, D], dk, dv [B*Hkv, S_pad, D|Dv]) in the inputs' dtypes (each written
    once from a float32 accumulator)."""
    del block_size
    rows, seq_pad, d = q.shape
    qt, ck, dv = block_sizes.q_tile, block_sizes.kv_block, v.shape[-1]
    b = lo.shape[0]
    hq, hkv, nq, nk = rows // b, k.shape[0] // b, seq_pad // qt, seq_pad // ck
    stages = block_sizes.num_stages
    lo, lse, delta = lo.reshape(b, seq_pad), lse.reshape(rows, seq_pad), delta.reshape(rows, seq_pad)
    sizes = dict(scale=scale, qt=qt, ck=ck, hq=hq, hkv=hkv, stages=stages)
    common = dict(
        compiler_params=plgpu.CompilerParams(approx_math=True), interpret=mosaic_gpu_interpret(interpret)
    )
    dq = plgpu.kernel(
        functools.partial(_dq_body, nq=nq, **sizes),
        out_type=jax.ShapeDtypeStruct((rows, seq_pad, d), q.dtype),
        scratch_types=[
            kit.swizzled_smem((qt, d), q.dtype),
            kit.swizzled_smem((qt, dv), do.dtype),
            plgpu.SMEM((qt,), jnp.int32),
            plgpu.SMEM((qt,), jnp.float32),
            plgpu.SMEM((qt,), jnp.float32),
            kit.swizzled_smem((stages, ck, d), k.dtype),
            kit.swizzled_smem((stages, ck, dv), v.dtype),
            plgpu.Barrier(num_barriers=5),
            plgpu.Barrier(num_barriers=stages),
            plgpu.Barrier(num_barriers=stages),
            kit.interpreter_staging((qt, ck), k.dtype, interpret),
        ],
        grid=(rows, nq),
        grid_names=("rows", "tiles"),
        kernel_name="moba_own_dq_mgpu",
        **common,
    )(first, q, lo, do, lse, delta, k, v)
    dk, dvv = plgpu.kernel(
        functools.partial(_dkv_body, nk=nk, **sizes),
        out_type=[
            jax.ShapeDtypeStruct((k.shape[0], seq_pad, d), k.dtype),
            jax.ShapeDtypeStruct((k.shape[0], seq_pad, dv), v.dtype),
        ],
        scratch_types=[
            kit.swizzled_smem((ck, d), k.dtype),
            kit.swizzled_smem((ck, dv), v.dtype),
            kit.swizzled_smem((stages, qt, d), q.dtype),
            kit.swizzled_smem((stages, qt, dv), do.dtype),
            plgpu.SMEM((stages, qt), jnp.int32),
            plgpu.SMEM((stages, qt), jnp.float32),
            plgpu.SMEM((stages, qt), jnp.float32),
            plgpu.Barrier(num_barriers=2),
            *[plgpu.Barrier(num_barriers=stages)] * 5,
            kit.interpreter_staging((ck, qt), q.dtype, interpret),
        ],
        grid=(k.shape[0], nk),
        grid_names=("rows", "tiles"),
        kernel_name="moba_own_dkv_mgpu",
        **common,
    )(q_end, k, v, q, lo, do, lse, delta)
    return dq, dk, dvv
