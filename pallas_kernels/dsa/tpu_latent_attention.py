"""DSA's sparse attention on TPU with one KV head (Pallas -> Mosaic), forward and backward: the form
`dsa.absorb` trains in, every query head over the same gathered latent rows (docs/dsa.md,
"Absorbed training"). `sparse_attention_tpu` sends one-KV-head calls here; the per-head form runs
in tpu_attention.py.

The decode kernel's layout (tpu_decode.py): the grid is (batch row, query, chunk of picks), each
pick's key and value rows come by DMA into one of two VMEM slots, and a query's H heads are the rows
of one [H, C'] score matrix on the MXU (q . k^T, then p . v). Mosaic slices a packed dtype's rows
only at multiples of its packing, so a bf16 pick copies the row pair that holds it (C' = C * pack
rows) and the other row is masked; the mask, one row per pick pair, is built in VMEM from the
picks in SMEM and turned to lanes by a transpose.

The backward recomputes p from the forward's log-sum-exp, keeps dq in VMEM across the chunks and
forms the chunk's dK = dS^T q and dV = p^T dO rows on the MXU; each pick's own row is then added
into float32 buffers in HBM by read-add-write DMAs (float32 rows copy singly at any offset), the
grid in order on one core (every axis "arbitrary"; a query's valid picks distinct), as in
tpu_attention.py.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.common import NT, TN, attention_cost, smem_row_length, tpu_interpret, used_chunks
from pallas_kernels.dsa.tpu_chunks import (
    over_chunks,
    partial_finish,
    partial_init,
    softmax_finish,
    softmax_init,
    softmax_step,
)

CHUNK = 128  # picks a grid step attends to


def _copies(idx_ref, pairs, sem, b, chunk, slot, *, pack):
    """(start, wait) of chunk `chunk`'s row copies from each (HBM [B, S, w], VMEM [slots, C', w])
    pair: a pick brings the `pack` rows that share its 32-bit words, into rows r * pack."""

    def each(fn):
        def body(r, carry):
            row = jnp.maximum(idx_ref[chunk * CHUNK + r], 0)
            start = pl.multiple_of(jax.lax.div(row, pack) * pack, pack)
            at = pl.multiple_of(r * pack, pack)
            for hbm, buf in pairs:
                fn(pltpu.make_async_copy(hbm.at[b, pl.ds(start, pack)], buf.at[slot, pl.ds(at, pack)], sem))
            return carry

        jax.lax.fori_loop(0, CHUNK, body, 0)

    return lambda: each(lambda c: c.start()), lambda: each(lambda c: c.wait())


def _mask(idx_ref, mask_sc, chunk, *, pack):
    """[1, C'] bool: 1 at each used pick's own row among the rows its copy brought. Written a pick
    at a time as rows of `mask_sc` [C', 128] (a dynamic sublane offset), then transposed to lanes."""
    lane_rows = jax.lax.broadcasted_iota(jnp.int32, (pack, 128), 0)

    def body(r, carry):
        pick = idx_ref[chunk * CHUNK + r]
        own = (pick >= 0) & (lane_rows == jax.lax.rem(jnp.maximum(pick, 0), pack))
        mask_sc[pl.ds(pl.multiple_of(r * pack, pack), pack)] = own.astype(jnp.float32)
        return carry

    jax.lax.fori_loop(0, CHUNK, body, 0)
    return mask_sc[...].T[:1] > 0


def _fwd_kernel(
    used_ref, q_ref, idx_ref, k_hbm, v_hbm, o_ref, lse_ref,
    k_buf, v_buf, sem, mask_sc, m_sc, l_sc, acc_sc, *, scale, pack,
):  # fmt: skip
    b = pl.program_id(0)
    gather = lambda chunk, slot: _copies(
        idx_ref, ((k_hbm, k_buf), (v_hbm, v_buf)), sem.at[slot], b, chunk, slot, pack=pack
    )

    def step(j, slot, arrived):
        arrived()
        k, v = k_buf[slot], v_buf[slot]  # [C', D], [C', Dv]
        s = jax.lax.dot_general(q_ref[...], k, NT, preferred_element_type=jnp.float32) * scale
        s = jnp.where(_mask(idx_ref, mask_sc, j, pack=pack), s, -jnp.inf)  # [H, C']
        softmax_step(s, v, m_sc, l_sc, acc_sc)

    over_chunks(
        used_ref, gather, init=lambda: softmax_init(m_sc, l_sc, acc_sc), step=step,
        finish=lambda: softmax_finish(o_ref, lse_ref, m_sc, l_sc, acc_sc),
    )  # fmt: skip


def _row_updates(idx_ref, pairs, sem, b, chunk, *, pack):
    """(read start, read wait, write start, write wait) of each used pick's own row between the
    float32 sums in HBM [B, S, w] and the staging rows in VMEM [C', w] (row r * pack + pick % pack)."""

    def each(fn, write):
        def body(r, carry):
            pick = idx_ref[chunk * CHUNK + r]

            @pl.when(pick >= 0)
            def _():
                at = r * pack + jax.lax.rem(pick, pack)
                for hbm, buf in pairs:
                    src, dst = hbm.at[b, pl.ds(pick, 1)], buf.at[pl.ds(at, 1)]
                    fn(pltpu.make_async_copy(*((dst, src) if write else (src, dst)), sem))

            return carry

        jax.lax.fori_loop(0, CHUNK, body, 0)

    return (
        lambda: each(lambda c: c.start(), False),
        lambda: each(lambda c: c.wait(), False),
        lambda: each(lambda c: c.start(), True),
        lambda: each(lambda c: c.wait(), True),
    )


def _bwd_kernel(
    used_ref, q_ref, do_ref, lse_ref, delta_ref, idx_ref, k_hbm, v_hbm, dk_in, dv_in,
    dq_ref, dk_hbm, dv_hbm, k_buf, v_buf, dk_buf, dv_buf, sem, acc_sem, mask_sc, dq_sc, *, scale, pack,
):  # fmt: skip
    del dk_in, dv_in  # the same buffers as dk_hbm, dv_hbm (aliased): accumulated into in place
    b = pl.program_id(0)
    gather = lambda chunk, slot: _copies(
        idx_ref, ((k_hbm, k_buf), (v_hbm, v_buf)), sem.at[slot], b, chunk, slot, pack=pack
    )

    def step(j, slot, arrived):
        read, read_wait, write, write_wait = _row_updates(
            idx_ref, ((dk_hbm, dk_buf), (dv_hbm, dv_buf)), acc_sem.at[0], b, j, pack=pack
        )
        read()  # the rows' sums so far: the previous chunk's writes have finished
        arrived()
        k, v, q, do = k_buf[slot], v_buf[slot], q_ref[...], do_ref[...]
        s = jax.lax.dot_general(q, k, NT, preferred_element_type=jnp.float32) * scale
        p = jnp.where(_mask(idx_ref, mask_sc, j, pack=pack), jnp.exp(s - lse_ref[...]), 0.0)  # [H, C']
        dp = jax.lax.dot_general(do, v, NT, preferred_element_type=jnp.float32)
        ds = p * (dp - delta_ref[...]) * scale
        dq_sc[...] += jnp.dot(ds.astype(k.dtype), k, preferred_element_type=jnp.float32)
        dk = jax.lax.dot_general(ds.astype(q.dtype), q, TN, preferred_element_type=jnp.float32)  # [C', D]
        dv = jax.lax.dot_general(p.astype(do.dtype), do, TN, preferred_element_type=jnp.float32)
        read_wait()
        dk_buf[...] += dk
        dv_buf[...] += dv
        write()
        write_wait()

    over_chunks(used_ref, gather, init=partial_init(dq_sc), step=step, finish=partial_finish(dq_ref, dq_sc))


def _prepare(k, v, indices, dtype):
    """k, v as [B, S', w] in `dtype` (S' padded to a whole row pair in bf16), the picks padded to
    whole chunks [B * T * K'] and the chunks up to each query's last pick [B * T]; and pack."""
    pack = max(1, 4 // jnp.dtype(dtype).itemsize)  # rows per 32-bit sublane word
    k, v = k[:, :, 0].astype(dtype), v[:, :, 0].astype(dtype)
    pad = -k.shape[1] % pack  # an odd length in bf16 gets its last pair whole
    k, v = (jnp.pad(x, ((0, 0), (0, pad), (0, 0))) for x in (k, v))
    b, t, kk = indices.shape
    kp = smem_row_length(kk)  # a multiple of every chunk size
    idx = jnp.pad(indices.astype(jnp.int32), ((0, 0), (0, 0), (0, kp - kk)), constant_values=-1)
    return k, v, idx.reshape(-1), used_chunks(idx, CHUNK).reshape(b * t), kp, pack


def _specs(t, kp, h):
    picks = pl.BlockSpec((kp,), lambda i, n, j, u: (i * t + n,), memory_space=pltpu.SMEM)
    heads = lambda w: pl.BlockSpec((None, None, h, w), lambda i, n, j, u: (i, n, 0, 0))
    return picks, heads


def forward(q, k, v, indices, scale, interpret):
    """-> (out [B, T, H, Dv] in q's dtype, lse [B, T, H, 1] float32)."""
    b, t, h, d = q.shape
    dv, dtype = v.shape[-1], q.dtype
    k, v, idx, used, kp, pack = _prepare(k, v, indices, dtype)
    picks, heads = _specs(t, kp, h)
    hbm = pl.BlockSpec(memory_space=pl.ANY)
    rows = CHUNK * pack
    return pl.pallas_call(
        functools.partial(_fwd_kernel, scale=scale, pack=pack),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1,
            grid=(b, t, kp // CHUNK),
            in_specs=[heads(d), picks, hbm, hbm],
            out_specs=[heads(dv), heads(1)],
            scratch_shapes=[
                pltpu.VMEM((2, rows, d), dtype),
                pltpu.VMEM((2, rows, dv), dtype),
                pltpu.SemaphoreType.DMA((2,)),
                pltpu.VMEM((rows, 128), jnp.float32),
                pltpu.VMEM((h, 1), jnp.float32),
                pltpu.VMEM((h, 1), jnp.float32),
                pltpu.VMEM((h, dv), jnp.float32),
            ],
        ),
        out_shape=[
            jax.ShapeDtypeStruct((b, t, h, dv), dtype),
            jax.ShapeDtypeStruct((b, t, h, 1), jnp.float32),
        ],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary")),
        interpret=tpu_interpret(interpret),
        name="dsa_latent_attention_fwd_tpu",
        cost_estimate=attention_cost(
            b * t * h * kp * pack, d, dv, b * t * kp * pack * (d + dv) * jnp.dtype(dtype).itemsize
        ),
    )(used, q, idx, k, v)


def backward(q, k, v, indices, o, lse, dout, scale, interpret):
    """-> dq [B, T, H, D], dk [B, S, 1, D], dv [B, S, 1, Dv]."""
    b, t, h, d = q.shape
    s, dv, dtype = k.shape[1], v.shape[-1], q.dtype
    kb, vb, idx, used, kp, pack = _prepare(k, v, indices, dtype)
    picks, heads = _specs(t, kp, h)
    hbm = pl.BlockSpec(memory_space=pl.ANY)
    rows, length = CHUNK * pack, kb.shape[1]
    delta = jnp.sum(o.astype(jnp.float32) * dout.astype(jnp.float32), axis=-1, keepdims=True)  # [B, T, H, 1]
    dq, dk, dv_ = pl.pallas_call(
        functools.partial(_bwd_kernel, scale=scale, pack=pack),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1,
            grid=(b, t, kp // CHUNK),
            in_specs=[heads(d), heads(dv), heads(1), heads(1), picks, hbm, hbm, hbm, hbm],
            out_specs=[heads(d), hbm, hbm],
            scratch_shapes=[
                pltpu.VMEM((2, rows, d), dtype),
                pltpu.VMEM((2, rows, dv), dtype),
                pltpu.VMEM((rows, d), jnp.float32),
                pltpu.VMEM((rows, dv), jnp.float32),
                pltpu.SemaphoreType.DMA((2,)),
                pltpu.SemaphoreType.DMA((1,)),
                pltpu.VMEM((rows, 128), jnp.float32),
                pltpu.VMEM((h, d), jnp.float32),
            ],
        ),
        out_shape=[
            jax.ShapeDtypeStruct((b, t, h, d), dtype),
            jax.ShapeDtypeStruct((b, length, d), jnp.float32),
            jax.ShapeDtypeStruct((b, length, dv), jnp.float32),
        ],
        input_output_aliases={8: 1, 9: 2},  # the zeros (operands 8, 9, the prefetch counted) -> dk, dv
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary", "arbitrary", "arbitrary")),
        interpret=tpu_interpret(interpret),
        name="dsa_latent_attention_bwd_tpu",
    )(
        used, q, dout.astype(dtype), lse, delta, idx, kb, vb,
        jnp.zeros((b, length, d), jnp.float32), jnp.zeros((b, length, dv), jnp.float32),
    )  # fmt: skip
    return dq, dk[:, :s, None].astype(k.dtype), dv_[:, :s, None].astype(v.dtype)
