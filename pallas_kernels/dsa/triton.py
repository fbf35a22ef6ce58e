"""DSA's sparse attention on GPU (Pallas -> Triton): each query attends to its selected keys only
(docs/dsa.md, item 8; `effattn_jax.ops.dsa.sparse_attention` is the XLA path it equals), their
rows gathered `CHUNK` at a time by pointer (Triton takes an index vector where a slice would go).
No [T, S] array is formed.

One program per (batch row, query, KV head), its rows the G = H / Hkv query heads that read the
KV head (padded to 16, the tensor cores' smallest M): in MLA's absorbed form (one latent KV head
for every head) each selected row is read once for all heads, as V3.2's kernels do. The forward
runs an online softmax over the K picks, a chunk at a time (-1 picks masked). The backward
recomputes a chunk's probabilities from the saved log-sum-exp, writes dq once, and adds the
chunk's dK/dV rows into float32 buffers with atomic adds: queries share keys in no fixed pattern.

Triton's blocks are powers of two. A query/key width that is a multiple of 16 runs as the sum of
its binary parts, one dot each (V3.2's 192 as 128 + 64), reading K in place; any other width, and
the value width, are zero-padded to the next power of two.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.common import NT, TN, triton_params, used_chunks
from pallas_kernels.moba.common import online_softmax_init, online_softmax_step

CHUNK = 32  # selected rows gathered per loop step
MIN_ROWS = 16  # the smallest M of a tensor-core dot
FWD_WARPS, BWD_WARPS = 4, 8  # 8 for the backward: 4 spill at head dim 192 on an A100 (jax 0.11.2)


def _pow2(n: int, floor: int = 16) -> int:
    return max(floor, pl.next_power_of_2(n))


def width_parts(d: int) -> tuple[int, ...]:
    """The column widths a query/key width runs as: its binary parts, largest first, where each is
    at least 16 (192 -> 128, 64); else the next power of two of at least 16, padded (12 -> 16)."""
    if d % 16:
        return (_pow2(d),)
    return tuple(1 << i for i in reversed(range(d.bit_length())) if d >> i & 1)


def _offsets(parts):
    return [sum(parts[:i]) for i in range(len(parts))]


def _rows(k_ref, v_ref, idx_ref, b, h, j, parts):
    """The chunk's picks (clamped to 0 where unused), which are valid, their key rows in column
    parts and their value rows."""
    idx = idx_ref[pl.ds(j * CHUNK, CHUNK)]
    valid, safe = idx >= 0, jnp.maximum(idx, 0)
    keys = [k_ref[b, safe, h, pl.ds(o, w)] for o, w in zip(_offsets(parts), parts, strict=True)]
    return safe, valid, keys, v_ref[b, safe, h, :]


def _scores(qs, ks, scale):
    """q . k over the column parts: [G', C] float32."""
    dots = [
        jax.lax.dot_general(q, k, NT, preferred_element_type=jnp.float32) for q, k in zip(qs, ks, strict=True)
    ]
    return functools.reduce(jnp.add, dots) * scale


USED_SPEC = pl.BlockSpec((None, None, 1), lambda b, t, *_: (b, t, 0))  # used_chunks' entry


def _fwd_kernel(idx_ref, used_ref, *refs, scale, parts):
    q_refs, (k_ref, v_ref, o_ref, lse_ref) = refs[: len(parts)], refs[len(parts) :]
    b, h = pl.program_id(0), pl.program_id(2)
    qs = [r[...] for r in q_refs]  # [G', w] each

    def body(j, carry):
        _, valid, ks, v = _rows(k_ref, v_ref, idx_ref, b, h, j, parts)
        s = _scores(qs, ks, scale)
        return online_softmax_step(carry, jnp.where(valid[None, :], s, -jnp.inf), v)

    init = online_softmax_init(qs[0].shape[0], o_ref.shape[-1])
    m, l, acc = jax.lax.fori_loop(0, used_ref[0], body, init)
    safe_l = jnp.where(l > 0, l, 1.0)  # a query with no pick (padding) outputs 0
    o_ref[...] = (acc / safe_l).astype(o_ref.dtype)
    lse_ref[...] = (jnp.where(l > 0, m, 0.0) + jnp.log(safe_l))[:, 0]


def _bwd_kernel(idx_ref, used_ref, *refs, scale, parts):
    n = len(parts)
    q_refs, (k_ref, v_ref, do_ref, lse_ref, delta_ref, dk_in, dv_in) = refs[:n], refs[n : n + 7]
    dq_refs, (dk_ref, dv_ref) = refs[n + 7 : 2 * n + 7], refs[2 * n + 7 :]
    del dk_in, dv_in  # the same buffers as dk_ref, dv_ref (aliased): accumulated into in place
    b, h = pl.program_id(0), pl.program_id(2)
    qs, do = [r[...] for r in q_refs], do_ref[...]
    lse, delta = lse_ref[...][:, None], delta_ref[...][:, None]

    def body(j, dqs):
        safe, valid, ks, v = _rows(k_ref, v_ref, idx_ref, b, h, j, parts)
        p = jnp.where(valid[None, :], jnp.exp(_scores(qs, ks, scale) - lse), 0.0)  # [G', C]
        dp = jax.lax.dot_general(do, v, NT, preferred_element_type=jnp.float32)
        ds = p * (dp - delta)
        # unused picks add into a spare row S (no mask: the interpreter has none for atomics, and
        # their zeros must not race a real pick of row 0)
        rows = jnp.where(valid, safe, dk_ref.shape[1] - 1)[:, None]
        for q, o, w in zip(qs, _offsets(parts), parts, strict=True):
            dk = jax.lax.dot_general(ds.astype(q.dtype), q, TN, preferred_element_type=jnp.float32) * scale
            pltriton.atomic_add(dk_ref, (b, rows, h, o + jnp.arange(w)[None, :]), dk)
        dv = jax.lax.dot_general(p.astype(do.dtype), do, TN, preferred_element_type=jnp.float32)
        pltriton.atomic_add(dv_ref, (b, rows, h, jnp.arange(dv.shape[1])[None, :]), dv)
        return [
            dq + jnp.dot(ds.astype(k.dtype), k, preferred_element_type=jnp.float32) * scale
            for dq, k in zip(dqs, ks, strict=True)
        ]

    dqs = jax.lax.fori_loop(0, used_ref[0], body, [jnp.zeros(r.shape, jnp.float32) for r in dq_refs])
    for r, dq in zip(dq_refs, dqs, strict=True):
        r[...] = dq.astype(r.dtype)


def _specs(gp: int, kp: int, *widths: int):
    """BlockSpecs over grid (B, T, Hkv): the picks [K'], then one [G', width] block per width."""
    picks = pl.BlockSpec((None, None, kp), lambda b, t, h: (b, t, 0))
    return [picks] + [
        pl.BlockSpec((None, None, None, gp, w), lambda b, t, h: (b, t, h, 0, 0)) for w in widths
    ]


def _heads_block(x, hkv: int, gp: int, width: int):
    """[B, T, H, D] -> [B, T, Hkv, G', D'] (each KV head's query heads, zero-padded)."""
    b, t, h, d = x.shape
    x = x.reshape(b, t, hkv, h // hkv, d)
    return jnp.pad(x, ((0, 0), (0, 0), (0, 0), (0, gp - h // hkv), (0, width - d)))


def _prepare(q, k, v, indices):
    """The kernels' inputs: the picks padded to whole chunks, q's column parts as [B, T, Hkv, G',
    w] blocks, k (padded only where its width is not a multiple of 16) and v (padded to a power of
    two); and (G', K', the parts, Dv')."""
    b, t, h, d = q.shape
    hkv, dv, kk = k.shape[2], v.shape[3], indices.shape[-1]
    parts = width_parts(d)
    gp, dvp, kp = _pow2(h // hkv, MIN_ROWS), _pow2(dv), -(-kk // CHUNK) * CHUNK
    pad = lambda x, w: jnp.pad(x, ((0, 0), (0, 0), (0, 0), (0, w - x.shape[-1])))
    idx = jnp.pad(indices.astype(jnp.int32), ((0, 0), (0, 0), (0, kp - kk)), constant_values=-1)
    qb = _heads_block(q, hkv, gp, sum(parts))
    q_parts = [qb[..., o : o + w] for o, w in zip(_offsets(parts), parts, strict=True)]
    return (idx, q_parts, pad(k, sum(parts)), pad(v, dvp)), (gp, kp, parts, dvp)


def _forward(q, k, v, indices, scale, interpret):
    b, t, h, _ = q.shape
    hkv, dv = k.shape[2], v.shape[3]
    (idx, q_parts, kb, vb), (gp, kp, parts, dvp) = _prepare(q, k, v, indices)
    whole = pl.no_block_spec
    o, lse = pl.pallas_call(
        functools.partial(_fwd_kernel, scale=scale, parts=parts),
        grid=(b, t, hkv),
        in_specs=[_specs(gp, kp)[0], USED_SPEC, *_specs(gp, kp, *parts)[1:], whole, whole],
        out_specs=[
            _specs(gp, kp, dvp)[1],
            pl.BlockSpec((None, None, None, gp), lambda b, t, h: (b, t, h, 0)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((b, t, hkv, gp, dvp), q.dtype),
            jax.ShapeDtypeStruct((b, t, hkv, gp), jnp.float32),
        ],
        compiler_params=triton_params(num_warps=FWD_WARPS),
        interpret=bool(interpret),
        name="dsa_sparse_attention_fwd",
    )(idx, used_chunks(idx, CHUNK), *q_parts, kb, vb)
    out = o[:, :, :, : h // hkv, :dv].reshape(b, t, h, dv)
    return out, (o, lse)


def _backward(q, k, v, indices, o, lse, dout, scale, interpret):
    b, t, h, d = q.shape
    s, hkv, dv = k.shape[1], k.shape[2], v.shape[3]
    (idx, q_parts, kb, vb), (gp, kp, parts, dvp) = _prepare(q, k, v, indices)
    dp = sum(parts)
    dob = _heads_block(dout, hkv, gp, dvp)
    delta = jnp.sum(o.astype(jnp.float32) * dob.astype(jnp.float32), axis=-1)  # [B, T, Hkv, G']
    whole = pl.no_block_spec
    lse_spec = pl.BlockSpec((None, None, None, gp), lambda b, t, h: (b, t, h, 0))
    zeros = lambda w: jnp.zeros((b, s + 1, hkv, w), jnp.float32)  # row S: the unused picks
    n = len(parts)
    outs = pl.pallas_call(
        functools.partial(_bwd_kernel, scale=scale, parts=parts),
        grid=(b, t, hkv),
        in_specs=[
            _specs(gp, kp)[0],
            USED_SPEC,
            *_specs(gp, kp, *parts)[1:],
            whole,
            whole,
            _specs(gp, kp, dvp)[1],
            lse_spec,
            lse_spec,
            whole,
            whole,
        ],
        out_specs=[*_specs(gp, kp, *parts)[1:], whole, whole],
        out_shape=[
            *(jax.ShapeDtypeStruct((b, t, hkv, gp, w), q.dtype) for w in parts),
            jax.ShapeDtypeStruct((b, s + 1, hkv, dp), jnp.float32),
            jax.ShapeDtypeStruct((b, s + 1, hkv, dvp), jnp.float32),
        ],
        input_output_aliases={n + 7: n, n + 8: n + 1},
        compiler_params=triton_params(num_warps=BWD_WARPS),
        interpret=bool(interpret),
        name="dsa_sparse_attention_bwd",
    )(idx, used_chunks(idx, CHUNK), *q_parts, kb, vb, dob, lse, delta, zeros(dp), zeros(dvp))
    dq, dk, dv_ = jnp.concatenate(outs[:n], axis=-1), outs[n], outs[n + 1]
    dq = dq[:, :, :, : h // hkv, :d].reshape(b, t, h, d)
    return dq, dk[:, :s, :, :d].astype(k.dtype), dv_[:, :s, :, :dv].astype(v.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _attention(q, k, v, indices, scale, interpret):
    return _forward(q, k, v, indices, scale, interpret)[0]


def _attention_fwd(q, k, v, indices, scale, interpret):
    out, (o, lse) = _forward(q, k, v, indices, scale, interpret)
    return out, (q, k, v, indices, o, lse)


def _attention_bwd(scale, interpret, residuals, dout):
    q, k, v, indices, o, lse = residuals
    dq, dk, dv = _backward(q, k, v, indices, o, lse, dout, scale, interpret)
    return dq, dk, dv, None


_attention.defvjp(_attention_fwd, _attention_bwd)


def sparse_attention_gpu(q, k, v, indices, *, scale=None, interpret=False):
    """`sparse_attention`'s contract: q [B, T, H, D], k [B, S, Hkv, D], v [B, S, Hkv, Dv], indices
    [B, T, K] (-1: none) -> [B, T, H, Dv] in q's dtype; gradients for q, k and v, none for the
    indices."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    return _attention(q, k, v, jax.lax.stop_gradient(indices), scale, interpret)
