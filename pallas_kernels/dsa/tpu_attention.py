"""DSA's sparse attention on TPU (Pallas -> Mosaic), forward and backward: each query attends to
its selected keys only (docs/dsa.md, item 8; `effattn_jax.ops.dsa.sparse_attention` is the XLA
path it equals, pallas_kernels/dsa/triton.py the GPU kernel). No [T, S] array is formed, and no
[T, K] gather reaches HBM.

The grid is (batch row, query, chunk of picks). k [B, S, Hkv, D] and v [B, S, Hkv, Dv] stay in
HBM; each step copies its chunk's rows by DMA, one [Hkv, D] slab per pick (the sequence axis is
untiled, so any row and any dtype copies whole), into one of two VMEM slots while the next chunk's
copies run into the other (the decode kernel's pattern, tpu_decode.py). A pick's heads stay on the
sublanes and its features on the lanes throughout, so a query's scores are lane sums of the slab
times q, [C, Hkv, 1] per query head of a group, and its output a sum over the chunk's leading axis:
work on the vector unit, one use per copied element, as a per-head gather is bound by the copies
anyway. The query heads of a KV head (G = H / Hkv) are looped over. Online softmax in float32.

The backward recomputes the probabilities from the forward's log-sum-exp, keeps dq in VMEM across
the query's chunks, and adds each chunk's dK/dV rows into float32 buffers in HBM by
read-add-write DMAs. Queries share keys in no fixed pattern and a TPU has no atomic adds, so the
backward's grid runs in order on one core (every axis "arbitrary"), each chunk's writes finished
before the next chunk reads; a query's valid picks must be distinct (as `dsa_select`'s are).
Unused picks (-1) copy row 0, are masked, and write nothing; the chunks past a query's last pick
copy and compute nothing.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.common import attention_cost, smem_row_length, tpu_interpret, used_chunks
from pallas_kernels.dsa import tpu_latent_attention as latent
from pallas_kernels.dsa.tpu_chunks import (
    over_chunks,
    partial_finish,
    partial_init,
    softmax_finish,
    softmax_init,
)

MIN_CHUNK, MAX_CHUNK = 8, 128  # picks a grid step attends to
CHUNK_F32_BYTES = 1 << 20  # a chunk's [C, Hkv, D + Dv] in float32 at most, padded to (8, 128) tiles


def chunk_size(kv_heads: int, d: int, dv: int) -> int:
    """Picks per grid step: the largest power of two up to MAX_CHUNK whose float32 slabs (heads
    padded to 8 sublanes, features to 128 lanes) fit CHUNK_F32_BYTES, and at least MIN_CHUNK (V3.2's
    128 heads of 192 + 128 get 8, 1.5 MiB), so the backward's buffers and temporaries stay within a
    v5e's scoped VMEM."""
    pad = lambda n, m: -(-n // m) * m
    per_pick = 4 * pad(kv_heads, 8) * (pad(d, 128) + pad(dv, 128))
    c = MAX_CHUNK
    while c > MIN_CHUNK and c * per_pick > CHUNK_F32_BYTES:
        c //= 2
    return c


def _copies(idx_ref, pairs, sem, b, chunk, slot, *, size, valid_only=False):
    """The DMAs of chunk `chunk`'s picks, one slab per pick from each (HBM, VMEM slots) pair, as
    (start, wait) callables; `valid_only`: none for an unused pick (-1). A pair's VMEM side is
    [slots, C, ...] (`slot` picks one) or, where slot is None, [C, ...]; HBM is [B, S, ...]."""

    def each(fn, reverse=False):
        def body(r, carry):
            pick = idx_ref[chunk * size + r]
            row = jnp.maximum(pick, 0)
            for hbm, buf in pairs:
                dst = buf if slot is None else buf.at[slot]
                src, dst = hbm.at[b, pl.ds(row, 1)], dst.at[pl.ds(r, 1)]
                copy = pltpu.make_async_copy(*((dst, src) if reverse else (src, dst)), sem)
                if valid_only:
                    pl.when(pick >= 0)(lambda copy=copy: fn(copy))
                else:
                    fn(copy)
            return carry

        jax.lax.fori_loop(0, size, body, 0)

    start = lambda reverse=False: each(lambda c: c.start(), reverse)
    wait = lambda reverse=False: each(lambda c: c.wait(), reverse)
    return start, wait


def _valid(idx_ref, mask_sc, chunk, size):
    """[C, 1, 1] bool: which of chunk `chunk`'s picks are used, written into `mask_sc` from the
    picks in SMEM (a mask array in HBM would pad each pick's [1, 1] to a whole (8, 128) tile)."""

    def body(r, carry):
        mask_sc[pl.ds(r, 1)] = jnp.full((1, 1, 1), idx_ref[chunk * size + r], jnp.int32)
        return carry

    jax.lax.fori_loop(0, size, body, 0)
    return mask_sc[...] >= 0


def _scores(kc, q, scale):
    """[C, Hkv, D] slab rows against one head of each group q [Hkv, D] -> [C, Hkv, 1] float32."""
    return jnp.sum(kc * q[None], axis=-1, keepdims=True) * scale


def _fwd_kernel(
    used_ref, q_ref, idx_ref, k_hbm, v_hbm, o_ref, lse_ref,
    k_buf, v_buf, sem, mask_sc, m_sc, l_sc, acc_sc, *, scale, size,
):  # fmt: skip
    b = pl.program_id(0)
    gather = lambda chunk, slot: _copies(
        idx_ref, ((k_hbm, k_buf), (v_hbm, v_buf)), sem.at[slot], b, chunk, slot, size=size
    )

    def step(j, slot, arrived):
        arrived()
        kc, vc = k_buf[slot].astype(jnp.float32), v_buf[slot].astype(jnp.float32)
        valid = _valid(idx_ref, mask_sc, j, size)

        def head(g, carry):  # one query head of every KV head's group
            s = jnp.where(valid, _scores(kc, q_ref[g].astype(jnp.float32), scale), -jnp.inf)
            m_prev = m_sc[g]  # [Hkv, 1]
            m_new = jnp.maximum(m_prev, jnp.max(s, axis=0))
            m_safe = jnp.where(m_new > -jnp.inf, m_new, 0.0)  # a chunk of unused picks adds nothing
            p = jnp.exp(s - m_safe[None])  # [C, Hkv, 1]
            alpha = jnp.exp(m_prev - m_safe)
            l_sc[g] = alpha * l_sc[g] + jnp.sum(p, axis=0)
            acc_sc[g] = alpha * acc_sc[g] + jnp.sum(p * vc, axis=0)  # [Hkv, Dv]
            m_sc[g] = m_new
            return carry

        jax.lax.fori_loop(0, q_ref.shape[0], head, 0)

    over_chunks(
        used_ref, gather, init=lambda: softmax_init(m_sc, l_sc, acc_sc), step=step,
        finish=lambda: softmax_finish(o_ref, lse_ref, m_sc, l_sc, acc_sc),
    )  # fmt: skip


def _bwd_kernel(
    used_ref, q_ref, do_ref, lse_ref, delta_ref, idx_ref, k_hbm, v_hbm, dk_in, dv_in,
    dq_ref, dk_hbm, dv_hbm, k_buf, v_buf, dk_buf, dv_buf, sem, acc_sem, mask_sc, dq_sc, *, scale, size,
):  # fmt: skip
    del dk_in, dv_in  # the same buffers as dk_hbm, dv_hbm (aliased): accumulated into in place
    b = pl.program_id(0)
    gather = lambda chunk, slot: _copies(
        idx_ref, ((k_hbm, k_buf), (v_hbm, v_buf)), sem.at[slot], b, chunk, slot, size=size
    )
    rows = lambda chunk: _copies(
        idx_ref, ((dk_hbm, dk_buf), (dv_hbm, dv_buf)), acc_sem.at[0], b, chunk, None, size=size,
        valid_only=True,
    )  # fmt: skip

    def step(j, slot, arrived):
        read_start, read_wait = rows(j)
        read_start()  # the rows' sums so far: the previous chunk's writes have finished
        arrived()
        kc, vc = k_buf[slot].astype(jnp.float32), v_buf[slot].astype(jnp.float32)
        valid = _valid(idx_ref, mask_sc, j, size)

        def head(g, grads):
            dk, dv = grads
            q, do = q_ref[g].astype(jnp.float32), do_ref[g].astype(jnp.float32)  # [Hkv, D | Dv]
            p = jnp.where(valid, jnp.exp(_scores(kc, q, scale) - lse_ref[g][None]), 0.0)  # [C, Hkv, 1]
            dp = jnp.sum(vc * do[None], axis=-1, keepdims=True)
            ds = p * (dp - delta_ref[g][None]) * scale
            dq_sc[g] += jnp.sum(ds * kc, axis=0)
            return dk + ds * q[None], dv + p * do[None]

        zeros = (jnp.zeros(kc.shape, jnp.float32), jnp.zeros(vc.shape, jnp.float32))
        dk, dv = jax.lax.fori_loop(0, q_ref.shape[0], head, zeros)
        read_wait()
        dk_buf[...] += dk
        dv_buf[...] += dv
        write_start, write_wait = rows(j)
        write_start(reverse=True)
        write_wait(reverse=True)

    over_chunks(used_ref, gather, init=partial_init(dq_sc), step=step, finish=partial_finish(dq_ref, dq_sc))


def _prepare(q, k, indices, size):
    """q as [B, T, G, Hkv, D] (a query head of every group per leading index), the picks padded to
    a 1-D block's length [B * T * K'] (flat: a [B, T, K'] block would need whole T, and [B * T, K'] rows
    of 1 are no block either) and the chunks up to each query's last pick [B * T]."""
    b, t, h, d = q.shape
    hkv, kk = k.shape[2], indices.shape[-1]
    kp = smem_row_length(kk)  # a multiple of every chunk size
    idx = jnp.pad(indices.astype(jnp.int32), ((0, 0), (0, 0), (0, kp - kk)), constant_values=-1)
    groups = q.reshape(b, t, hkv, h // hkv, d).swapaxes(2, 3)
    return groups, idx.reshape(-1), used_chunks(idx, size).reshape(b * t), kp


def _grid_specs(t, kp, heads):
    """The query's picks (SMEM) and a per-query [G, Hkv, w] block maker. The float blocks come
    before the picks, so the dry run's SMEM count reads `used` alone as the scalar table."""
    picks = pl.BlockSpec((kp,), lambda i, n, j, u: (i * t + n,), memory_space=pltpu.SMEM)
    g, hkv = heads
    query = lambda w: pl.BlockSpec((None, None, g, hkv, w), lambda i, n, j, u: (i, n, 0, 0, 0))
    return picks, query


def _forward(q, k, v, indices, scale, interpret):
    b, t, h, d = q.shape
    hkv, dv = k.shape[2], v.shape[3]
    g, size = h // hkv, chunk_size(hkv, d, dv)
    qg, idx, used, kp = _prepare(q, k, indices, size)
    picks, query = _grid_specs(t, kp, (g, hkv))
    hbm = pl.BlockSpec(memory_space=pl.ANY)
    dtype = q.dtype
    o, lse = pl.pallas_call(
        functools.partial(_fwd_kernel, scale=scale, size=size),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1,
            grid=(b, t, kp // size),
            in_specs=[query(d), picks, hbm, hbm],
            out_specs=[query(dv), query(1)],
            scratch_shapes=[
                pltpu.VMEM((2, size, hkv, d), dtype),
                pltpu.VMEM((2, size, hkv, dv), dtype),
                pltpu.SemaphoreType.DMA((2,)),
                pltpu.VMEM((size, 1, 1), jnp.int32),
                pltpu.VMEM((g, hkv, 1), jnp.float32),
                pltpu.VMEM((g, hkv, 1), jnp.float32),
                pltpu.VMEM((g, hkv, dv), jnp.float32),
            ],
        ),
        out_shape=[
            jax.ShapeDtypeStruct((b, t, g, hkv, dv), dtype),
            jax.ShapeDtypeStruct((b, t, g, hkv, 1), jnp.float32),
        ],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary")),
        interpret=tpu_interpret(interpret),
        name="dsa_sparse_attention_fwd_tpu",
        cost_estimate=attention_cost(
            b * t * h * kp, d, dv, b * t * kp * hkv * (d + dv) * jnp.dtype(dtype).itemsize
        ),
    )(used, qg, idx, k.astype(dtype), v.astype(dtype))
    return o, lse


def _backward(q, k, v, indices, o, lse, dout, scale, interpret):
    b, t, h, d = q.shape
    s, hkv, dv = k.shape[1], k.shape[2], v.shape[3]
    g, size = h // hkv, chunk_size(hkv, d, dv)
    qg, idx, used, kp = _prepare(q, k, indices, size)
    picks, query = _grid_specs(t, kp, (g, hkv))
    hbm = pl.BlockSpec(memory_space=pl.ANY)
    dtype = q.dtype
    do = dout.reshape(b, t, hkv, g, dv).swapaxes(2, 3)
    # [B, T, G, Hkv, 1]: each head's sum of dO * O
    delta = jnp.sum(o.astype(jnp.float32) * do.astype(jnp.float32), axis=-1, keepdims=True)
    dq, dk, dv_ = pl.pallas_call(
        functools.partial(_bwd_kernel, scale=scale, size=size),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1,
            grid=(b, t, kp // size),
            in_specs=[query(d), query(dv), query(1), query(1), picks, hbm, hbm, hbm, hbm],
            out_specs=[query(d), hbm, hbm],
            scratch_shapes=[
                pltpu.VMEM((2, size, hkv, d), dtype),
                pltpu.VMEM((2, size, hkv, dv), dtype),
                pltpu.VMEM((size, hkv, d), jnp.float32),
                pltpu.VMEM((size, hkv, dv), jnp.float32),
                pltpu.SemaphoreType.DMA((2,)),
                pltpu.SemaphoreType.DMA((1,)),
                pltpu.VMEM((size, 1, 1), jnp.int32),
                pltpu.VMEM((g, hkv, d), jnp.float32),
            ],
        ),
        out_shape=[
            jax.ShapeDtypeStruct((b, t, g, hkv, d), dtype),
            jax.ShapeDtypeStruct((b, s, hkv, d), jnp.float32),
            jax.ShapeDtypeStruct((b, s, hkv, dv), jnp.float32),
        ],
        input_output_aliases={8: 1, 9: 2},  # the zeros (operands 8, 9, the prefetch counted) -> dk, dv
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary", "arbitrary", "arbitrary")),
        interpret=tpu_interpret(interpret),
        name="dsa_sparse_attention_bwd_tpu",
    )(
        used, qg, do.astype(dtype), lse, delta, idx, k.astype(dtype), v.astype(dtype),
        jnp.zeros((b, s, hkv, d), jnp.float32), jnp.zeros((b, s, hkv, dv), jnp.float32),
    )  # fmt: skip
    return dq.swapaxes(2, 3).reshape(b, t, h, d), dk.astype(k.dtype), dv_.astype(v.dtype)


def _ungroup(o):
    """[B, T, G, Hkv, Dv] -> [B, T, H, Dv] (head n * G + g)."""
    b, t, g, hkv, dv = o.shape
    return o.swapaxes(2, 3).reshape(b, t, g * hkv, dv)


def _run_forward(q, k, v, indices, scale, interpret):
    """(out [B, T, H, Dv], the backward's residuals (o, lse) in its path's layout): one KV head
    on the MXU (tpu_latent_attention.py), else per head on the vector unit."""
    if k.shape[2] == 1:
        o, lse = latent.forward(q, k, v, indices, scale, interpret)
        return o, (o, lse)
    o, lse = _forward(q, k, v, indices, scale, interpret)
    return _ungroup(o), (o, lse)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _attention(q, k, v, indices, scale, interpret):
    return _run_forward(q, k, v, indices, scale, interpret)[0]


def _attention_fwd(q, k, v, indices, scale, interpret):
    out, (o, lse) = _run_forward(q, k, v, indices, scale, interpret)
    return out, (q, k, v, indices, o, lse)


def _attention_bwd(scale, interpret, residuals, dout):
    q, k, v, indices, o, lse = residuals
    run = latent.backward if k.shape[2] == 1 else _backward
    dq, dk, dv = run(q, k, v, indices, o, lse, dout, scale, interpret)
    return dq, dk, dv, None


_attention.defvjp(_attention_fwd, _attention_bwd)


def sparse_attention_tpu(q, k, v, indices, *, scale=None, interpret=False):
    """`sparse_attention`'s contract: q [B, T, H, D], k [B, S, Hkv, D], v [B, S, Hkv, Dv], indices
    [B, T, K] (-1: none; a query's valid picks distinct) -> [B, T, H, Dv] in q's dtype; gradients
    for q, k and v, none for the indices. One KV head (`dsa.absorb`'s form) runs on the MXU
    (tpu_latent_attention.py). `interpret`: True, or "tpu" for the TPU interpreter."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    return _attention(q, k, v, jax.lax.stop_gradient(indices), scale, interpret)
