"""Absorbed MLA decode step on GPU (Pallas -> Triton): the same one pass over each row's
cached latent for all heads as `tpu.py`, one program per batch row.

The heads are the rows of each [H, tile] score matrix (padded to 16, the least a Triton dot
takes); the program loops over the row's latent tiles up to its length only, loading the
last partial tile under a mask, with an online softmax and an [H, d] accumulator in
registers.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.common import NT, attention_cost, triton_params

TILE = 64  # latent slots per loop step
MIN_ROWS = 16  # Triton's dot needs 16 rows: the heads are padded to this


def _kernel(len_ref, ql_ref, qr_ref, lat_ref, kr_ref, o_ref, *, scale, tile):
    b = pl.program_id(0)
    n = len_ref[b]
    q_lat, q_rope = ql_ref[...], qr_ref[...]  # [H, d], [H, d_R]
    rows = q_lat.shape[0]

    def body(j, carry):
        m, l, acc = carry
        slot = j * tile + jax.lax.broadcasted_iota(jnp.int32, (tile,), 0)
        ok = slot < n
        window = (b, pl.ds(j * tile, tile), slice(None))
        lat = pltriton.load(lat_ref.at[window], mask=ok[:, None], other=0.0)  # [tile, d]
        kr = pltriton.load(kr_ref.at[window], mask=ok[:, None], other=0.0)
        s = jax.lax.dot_general(q_lat, lat, NT, preferred_element_type=jnp.float32)
        s += jax.lax.dot_general(q_rope, kr, NT, preferred_element_type=jnp.float32)
        s = jnp.where(ok[None, :], s * scale, -jnp.inf)  # [H, tile]
        m_new = jnp.maximum(m, jnp.max(s, axis=1, keepdims=True))  # finite: slot 0 is real
        p = jnp.exp(s - m_new)
        alpha = jnp.exp(m - m_new)
        acc = alpha * acc + jnp.dot(p.astype(lat.dtype), lat, preferred_element_type=jnp.float32)
        return m_new, alpha * l + jnp.sum(p, axis=1, keepdims=True), acc

    init = (
        jnp.full((rows, 1), -jnp.inf, jnp.float32),
        jnp.zeros((rows, 1), jnp.float32),
        jnp.zeros(o_ref.shape, jnp.float32),
    )
    _, l, acc = jax.lax.fori_loop(0, pl.cdiv(n, tile), body, init)
    o_ref[...] = acc / l


def mla_decode_gpu(q_lat, q_rope, lat, kr, lengths, scale: float, *, tile: int = TILE, interpret=False):
    """As `tpu.mla_decode_tpu`: q_lat [B, H, d], q_rope [B, H, d_R], latent [B, L, d], k^R
    [B, L, d_R], lengths [B] (>= 1) -> [B, H, d] float32. d, d_R and `tile` powers of two."""
    b, h, d = q_lat.shape
    dr = kr.shape[-1]
    rows = max(MIN_ROWS, 1 << (h - 1).bit_length())
    pad = lambda x: jnp.pad(x, ((0, 0), (0, rows - h), (0, 0)))
    heads = lambda width: pl.BlockSpec((None, rows, width), lambda i: (i, 0, 0))
    whole = pl.no_block_spec
    out = pl.pallas_call(
        functools.partial(_kernel, scale=scale, tile=tile),
        grid=(b,),
        in_specs=[whole, heads(d), heads(dr), whole, whole],
        out_specs=heads(d),
        out_shape=jax.ShapeDtypeStruct((b, rows, d), jnp.float32),
        compiler_params=triton_params(),
        interpret=bool(interpret),
        name="mla_decode_gpu",
        cost_estimate=attention_cost(
            b * rows * lat.shape[1], d + dr, d, b * lat.shape[1] * (d + dr) * lat.dtype.itemsize
        ),
    )(lengths.astype(jnp.int32), pad(q_lat), pad(q_rope), lat, kr)
    return out[:, :h]
