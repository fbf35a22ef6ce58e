"""MoBA decode step on GPU (Pallas -> Triton): one program per (batch row, query head) reads
only its selected blocks of the head-major K/V cache [B, Hkv, L, D], in place, with an online
softmax across the blocks.

The tables come from `effattn_jax.ops.moba_decode.select_blocks` (the gate runs in XLA: one
dot product per block): for each (row, head) its own block first, then its picks, as `size`
slots from `starts`, of which slots lo..hi count. A single query per program, so scores are
an elementwise product and a sum rather than a matmul (Triton's dot needs 16 rows).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.common import attention_cost, triton_params


def _decode_kernel(start_ref, lo_ref, hi_ref, q_ref, k_ref, v_ref, o_ref, *, scale, size, blocks, group):
    b, h = pl.program_id(0), pl.program_id(1)
    kv = h // group
    q = q_ref[...].astype(jnp.float32)  # [D]

    def body(j, carry):
        m, l, acc = carry
        start = start_ref[b, h, j]
        slots = pl.ds(start, size)
        s = jnp.sum(k_ref[b, kv, slots, :].astype(jnp.float32) * q[None, :], axis=1) * scale  # [size]
        slot = start + jax.lax.broadcasted_iota(jnp.int32, (size,), 0)
        s = jnp.where((slot >= lo_ref[b, h, j]) & (slot <= hi_ref[b, h, j]), s, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(s))  # finite: the own block comes first and holds the query
        p = jnp.exp(s - m_new)
        alpha = jnp.exp(m - m_new)
        v = v_ref[b, kv, slots, :].astype(jnp.float32)
        return m_new, alpha * l + jnp.sum(p), alpha * acc + jnp.sum(p[:, None] * v, axis=0)

    init = (jnp.float32(-jnp.inf), jnp.float32(0.0), jnp.zeros(o_ref.shape, jnp.float32))
    _, l, acc = jax.lax.fori_loop(0, blocks, body, init)
    o_ref[...] = (acc / l).astype(o_ref.dtype)


def moba_decode_gpu(q, k_cache, v_cache, starts, lo, hi, size: int, scale: float, interpret: bool = False):
    """q [B, Hq, D] (one new token per row), head-major caches [B, Hkv, L, D|Dv], tables [B, Hq, blocks]
    -> [B, Hq, Dv] in q's dtype. `size` must be a power of two (a Triton block)."""
    b, hq, d = q.shape
    dv, blocks = v_cache.shape[-1], starts.shape[-1]
    whole = pl.no_block_spec
    row = lambda width: pl.BlockSpec((None, None, width), lambda i, h: (i, h, 0))
    return pl.pallas_call(
        functools.partial(
            _decode_kernel, scale=scale, size=size, blocks=blocks, group=hq // k_cache.shape[1]
        ),
        grid=(b, hq),
        in_specs=[whole, whole, whole, row(d), whole, whole],
        out_specs=row(dv),
        out_shape=jax.ShapeDtypeStruct((b, hq, dv), q.dtype),
        compiler_params=triton_params(),
        interpret=bool(interpret),
        name="moba_decode_gpu",
        cost_estimate=attention_cost(
            b * hq * blocks * size, d, dv, b * hq * blocks * size * (d + dv) * k_cache.dtype.itemsize
        ),
    )(starts.astype(jnp.int32), lo.astype(jnp.int32), hi.astype(jnp.int32), q, k_cache, v_cache)
