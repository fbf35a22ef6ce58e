"""Absorbed MLA decode step on TPU (Pallas / Mosaic), FlashMLA-style: one pass over each row's
cached latent reads every latent and RoPE-key tile **once for all heads**.

With W_UK absorbed, head i's score against slot s is q_lat,i . c_s + q_rope,i . k^R_s and its
output is sum_s p_is c_s (W_UV applied afterwards, docs/mla.md). So the heads are the rows of
one [H, tile] score matrix per latent tile. The grid is (batch row, latent tile): the heads'
queries and the [H, d] accumulator stay in VMEM across a row's tiles (online softmax). Tiles
past the row's length (scalar-prefetched) keep the last needed tile's index, so they copy
nothing, and they skip their compute. EG-MLA passes its gated latent c~ as the latent.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.common import NT, attention_cost, tpu_interpret

TILE = 512  # latent slots per grid step


def _kernel(lens_ref, ql_ref, qr_ref, lat_ref, kr_ref, o_ref, m_sc, l_sc, acc_sc, *, scale, tile):
    b, j = pl.program_id(0), pl.program_id(1)
    n = lens_ref[b]

    @pl.when(j == 0)
    def _():
        m_sc[...] = jnp.full(m_sc.shape, -jnp.inf, jnp.float32)
        l_sc[...] = jnp.zeros(l_sc.shape, jnp.float32)
        acc_sc[...] = jnp.zeros(acc_sc.shape, jnp.float32)

    @pl.when(j * tile < n)
    def _():
        rows = j * tile + jax.lax.broadcasted_iota(jnp.int32, (lat_ref.shape[0], 1), 0)
        lat = jnp.where(rows < n, lat_ref[...], 0)  # [tile, d]; a partial last tile reads past L
        s = jax.lax.dot_general(ql_ref[...], lat, NT, preferred_element_type=jnp.float32)
        s += jax.lax.dot_general(qr_ref[...], kr_ref[...], NT, preferred_element_type=jnp.float32)
        slot = j * tile + jax.lax.broadcasted_iota(jnp.int32, s.shape, 1)
        s = jnp.where(slot < n, s * scale, -jnp.inf)  # [H, tile]
        m_prev = m_sc[...]
        m_new = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))  # finite: slot 0 is real
        p = jnp.exp(s - m_new)
        alpha = jnp.exp(m_prev - m_new)
        l_sc[...] = alpha * l_sc[...] + jnp.sum(p, axis=1, keepdims=True)
        acc_sc[...] = alpha * acc_sc[...] + jnp.dot(
            p.astype(lat.dtype), lat, preferred_element_type=jnp.float32
        )
        m_sc[...] = m_new

    @pl.when(j == pl.num_programs(1) - 1)
    def _():
        o_ref[...] = (acc_sc[...] / l_sc[...]).astype(o_ref.dtype)


def mla_decode_tpu(q_lat, q_rope, lat, kr, lengths, scale: float, *, tile: int = TILE, interpret=False):
    """One new token per row: q_lat [B, H, d], q_rope [B, H, d_R], latent [B, L, d], k^R
    [B, L, d_R], lengths [B] (slots 0..length-1 count, >= 1) -> [B, H, d] float32 (the
    latent-space output; W_UV applies after). `interpret`: True, or "tpu" for the TPU
    interpreter."""
    b, h, d = q_lat.shape
    length, dr = lat.shape[1], kr.shape[-1]
    tile = min(tile, length)
    # lax.div: lengths are positive (a floor division lowers through sign(), which Mosaic
    # resolves only on a real TPU)
    last = lambda row, j, lens: (row, jnp.minimum(j, jax.lax.div(lens[row] - 1, tile)), 0)
    heads = lambda width: pl.BlockSpec((None, h, width), lambda row, j, lens: (row, 0, 0))
    return pl.pallas_call(
        functools.partial(_kernel, scale=scale, tile=tile),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1,
            grid=(b, pl.cdiv(length, tile)),
            in_specs=[
                heads(d),
                heads(dr),
                pl.BlockSpec((None, tile, d), last),
                pl.BlockSpec((None, tile, dr), last),
            ],
            out_specs=heads(d),
            scratch_shapes=[
                pltpu.VMEM((h, 1), jnp.float32),
                pltpu.VMEM((h, 1), jnp.float32),
                pltpu.VMEM((h, d), jnp.float32),
            ],
        ),
        out_shape=jax.ShapeDtypeStruct((b, h, d), jnp.float32),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
        interpret=tpu_interpret(interpret),
        name="mla_decode",
        cost_estimate=attention_cost(b * h * length, d + dr, d, b * length * (d + dr) * lat.dtype.itemsize),
    )(lengths.astype(jnp.int32), q_lat, q_rope, lat, kr)
