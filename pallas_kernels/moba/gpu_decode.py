"""MoBA decode step on GPU (Pallas -> Triton), split over the selected blocks (flash-decoding):
one program per (batch row, query head, piece of a selected block) reads its piece of the
head-major K/V cache [B, Hkv, L, D] in place, and `common.combine_partials` (XLA) merges the
pieces of each (row, head). A batch of one with 12 heads would otherwise run 12 programs, each
walking its blocks one after the other, on a GPU of 132 multiprocessors.

The tables come from `effattn_jax.ops.moba_decode.select_blocks` (the gate runs in XLA: one
dot product per block): for each (row, head) its own block first, then its picks, as `size`
slots from `starts`, of which slots lo..hi count. Each block is cut into `pieces` of size /
pieces slots (`pieces`: enough programs to cover the multiprocessors once, no piece under
MIN_PIECE slots). A single query per program, so scores are an elementwise product and a sum
rather than a matmul (Triton's dot needs 16 rows). A piece with no slot that counts (an unused
pick, the part of the own block after the query) gives m = -inf and l = 0, and weighs nothing.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import gpu_memory
from pallas_kernels.common import attention_cost, combine_partials, triton_params

MIN_PIECE = 64  # slots a program reads at least: a smaller piece costs more in partials than it saves


def pieces(programs: int, size: int, multiprocessors: int) -> int:
    """Pieces per block (a power of two dividing `size`): the fewest with which `programs`
    (rows x heads x blocks) times pieces cover the multiprocessors, none under MIN_PIECE slots."""
    count = 1
    while programs * count < multiprocessors and size // (2 * count) >= MIN_PIECE:
        count *= 2
    return count


def _decode_kernel(
    start_ref, lo_ref, hi_ref, q_ref, k_ref, v_ref, o_ref, m_ref, l_ref, *, scale, piece, parts, group
):
    b, h, p = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    j = p // parts  # the selected block this piece belongs to
    kv = h // group
    q = q_ref[...].astype(jnp.float32)  # [D]
    start = start_ref[b, h, j] + (p % parts) * piece
    slots = pl.ds(start, piece)
    s = jnp.sum(k_ref[b, kv, slots, :].astype(jnp.float32) * q[None, :], axis=1) * scale  # [piece]
    slot = start + jax.lax.broadcasted_iota(jnp.int32, (piece,), 0)
    s = jnp.where((slot >= lo_ref[b, h, j]) & (slot <= hi_ref[b, h, j]), s, -jnp.inf)
    m = jnp.max(s)
    e = jnp.exp(s - jnp.where(m == -jnp.inf, 0.0, m))  # no slot counts: all zeros
    l = jnp.sum(e)
    v = v_ref[b, kv, slots, :].astype(jnp.float32)
    o_ref[...] = jnp.sum(e[:, None] * v, axis=0) / jnp.where(l > 0, l, 1.0)
    m_ref[b, h, p] = m
    l_ref[b, h, p] = l


def moba_decode_gpu(
    q, k_cache, v_cache, starts, lo, hi, size: int, scale: float, interpret: bool = False, num_pieces=None
):
    """q [B, Hq, D] (one new token per row), head-major caches [B, Hkv, L, D|Dv], tables [B, Hq, blocks]
    -> [B, Hq, Dv] in q's dtype. `size` must be a power of two (a Triton block), `num_pieces` (pieces
    per block; default `pieces`) one dividing it."""
    b, hq, d = q.shape
    dv, blocks = v_cache.shape[-1], starts.shape[-1]
    parts = num_pieces or pieces(b * hq * blocks, size, gpu_memory.multiprocessors())
    whole = pl.no_block_spec
    row = pl.BlockSpec((None, None, d), lambda i, h, p: (i, h, 0))
    part = pl.BlockSpec((None, None, None, dv), lambda i, h, p: (i, h, p, 0))
    shape = (b, hq, blocks * parts)
    out, m, l = pl.pallas_call(
        functools.partial(
            _decode_kernel, scale=scale, piece=size // parts, parts=parts, group=hq // k_cache.shape[1]
        ),
        grid=shape,
        in_specs=[whole, whole, whole, row, whole, whole],
        out_specs=[part, whole, whole],
        out_shape=[
            jax.ShapeDtypeStruct((*shape, dv), jnp.float32),
            jax.ShapeDtypeStruct(shape, jnp.float32),
            jax.ShapeDtypeStruct(shape, jnp.float32),
        ],
        compiler_params=triton_params(),
        interpret=bool(interpret),
        name="moba_decode_gpu",
        cost_estimate=attention_cost(
            b * hq * blocks * size, d, dv, b * hq * blocks * size * (d + dv) * k_cache.dtype.itemsize
        ),
    )(starts.astype(jnp.int32), lo.astype(jnp.int32), hi.astype(jnp.int32), q, k_cache, v_cache)
    return combine_partials(out, m, l, axis=2).astype(q.dtype)
