"""MoBA decode step on TPU (Pallas / Mosaic): for each (batch row, query head) the grid walks
its selected blocks, and the K/V index maps read the block starts from scalar-prefetched
tables (as jax's paged attention steers its page fetches), so only those blocks leave HBM.

The cache is head-major [B, Hkv, L, D]: a block of one KV head is one (size, D) tile at an
element offset along L (a [B, L, Hkv, D] cache is tiled over (Hkv, D), and one head's rows
cannot be sliced from it). Starts are passed in units of ALIGN, so Mosaic can prove the
offsets tile-aligned. An unused pick (hi < lo) repeats the previous slot's start, so Pallas
skips its copy, and skips its compute. The query and an online softmax (m, l, acc) stay in
VMEM across a head's blocks. Tables as in `gpu_decode.py` (from `ops.moba_decode.select_blocks`),
passed flat: Mosaic pads a scalar-prefetched [B, Hq, blocks] table's last dim to 128 words in
SMEM (at 64 rows and 16 heads each table took 512 KiB, and libtpu refused the call: 1.5 MiB
of the core's 1 MiB), and the rows run in calls whose tables fit tpu_smem's budget.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.common import ALIGN, NT, attention_cost, tpu_interpret
from pallas_kernels.moba import tpu_smem


def fits(length: int, size: int) -> bool:
    """Whether every block start is a multiple of ALIGN (own windows a short cache moves back
    start at length - size): otherwise the step decodes through XLA."""
    return length % ALIGN == 0 and size % ALIGN == 0


def _kernel(starts_ref, lo_ref, hi_ref, q_ref, k_ref, v_ref, o_ref, m_sc, l_sc, acc_sc, *, scale):
    b, h, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    at = (b * pl.num_programs(1) + h) * pl.num_programs(2) + j  # the flat tables' entry
    lo, hi = lo_ref[at], hi_ref[at]

    @pl.when(j == 0)
    def _():
        m_sc[...] = jnp.full(m_sc.shape, -jnp.inf, jnp.float32)
        l_sc[...] = jnp.zeros(l_sc.shape, jnp.float32)
        acc_sc[...] = jnp.zeros(acc_sc.shape, jnp.float32)

    @pl.when(lo <= hi)
    def _():
        s = jax.lax.dot_general(q_ref[...], k_ref[...], NT, preferred_element_type=jnp.float32)  # [1, size]
        slot = starts_ref[at] * ALIGN + jax.lax.broadcasted_iota(jnp.int32, s.shape, 1)
        s = jnp.where((slot >= lo) & (slot <= hi), s * scale, -jnp.inf)
        m_prev = m_sc[...]
        m_new = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))  # finite: the own block is first
        p = jnp.exp(s - m_new)
        alpha = jnp.exp(m_prev - m_new)
        l_sc[...] = alpha * l_sc[...] + jnp.sum(p, axis=1, keepdims=True)
        v = v_ref[...]
        acc_sc[...] = alpha * acc_sc[...] + jnp.dot(p.astype(v.dtype), v, preferred_element_type=jnp.float32)
        m_sc[...] = m_new

    @pl.when(j == pl.num_programs(2) - 1)
    def _():
        o_ref[...] = (acc_sc[...] / l_sc[...]).astype(o_ref.dtype)


def moba_decode_tpu(q, k_cache, v_cache, starts, lo, hi, size: int, scale: float, interpret=False):
    """q [B, Hq, D] (one new token per row), head-major caches [B, Hkv, L, D|Dv], tables
    [B, Hq, blocks] -> [B, Hq, Dv] in q's dtype (q is rounded to the cache's dtype for the MXU).
    Needs `fits(L, size)`. `interpret`: True, or "tpu" for the TPU interpreter."""
    b, hq, _ = q.shape
    length, dtype, blocks = v_cache.shape[2], q.dtype, starts.shape[-1]
    if not fits(length, size):
        raise ValueError(f"TPU MoBA decode needs cache length {length} and block {size} multiples of {ALIGN}")
    lo, hi = lo.astype(jnp.int32), hi.astype(jnp.int32)
    # an unused pick (after the used ones) keeps the previous start: its fetch is skipped
    kept = [starts[..., 0]]
    for j in range(1, blocks):
        kept.append(jnp.where(lo[..., j] <= hi[..., j], starts[..., j], kept[-1]))
    starts = jax.lax.div(jnp.stack(kept, axis=-1).astype(jnp.int32), ALIGN)
    q = q[:, :, None].astype(k_cache.dtype)
    rows = tpu_smem.rows_per_call("moba_decode_tpu", b, hq * blocks)
    outs = []
    for first in range(0, b, rows):  # the caches stay whole: each call's index maps add its first row
        cut = slice(first, min(first + rows, b))
        flat = [x[cut].reshape(-1) for x in (starts, lo, hi)]
        outs.append(
            _call(q[cut], k_cache, v_cache, *flat, first, size=size, scale=scale, interpret=interpret)
        )
    return jnp.concatenate(outs)[:, :, 0].astype(dtype)


def _call(q, k_cache, v_cache, starts, lo, hi, first_row: int, *, size, scale, interpret):
    """One call over q's rows [b, Hq, 1, D], rows first_row.. of the caches; flat tables
    [b * Hq * blocks] -> [b, Hq, 1, Dv] float32."""
    b, hq, _, d = q.shape
    hkv, _, dv = v_cache.shape[1:]
    blocks, group = starts.shape[0] // (b * hq), hq // hkv

    def block(i, h, j, starts, lo, hi):
        return first_row + i, jax.lax.div(h, group), starts[(i * hq + h) * blocks + j] * ALIGN, 0

    row = lambda width: pl.BlockSpec((None, None, 1, width), lambda i, h, j, *_: (i, h, 0, 0))
    cache = lambda width: pl.BlockSpec((None, None, pl.Element(size), pl.Element(width)), block)
    return pl.pallas_call(
        functools.partial(_kernel, scale=scale),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=3,
            grid=(b, hq, blocks),
            in_specs=[row(d), cache(d), cache(dv)],
            out_specs=row(dv),
            scratch_shapes=[
                pltpu.VMEM((1, 1), jnp.float32),
                pltpu.VMEM((1, 1), jnp.float32),
                pltpu.VMEM((1, dv), jnp.float32),
            ],
        ),
        out_shape=jax.ShapeDtypeStruct((b, hq, 1, dv), jnp.float32),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary")),
        interpret=tpu_interpret(interpret),
        name="moba_decode_tpu",
        cost_estimate=attention_cost(
            b * hq * blocks * size, d, dv, b * hq * blocks * size * (d + dv) * k_cache.dtype.itemsize
        ),
    )(starts, lo, hi, q, k_cache, v_cache)
