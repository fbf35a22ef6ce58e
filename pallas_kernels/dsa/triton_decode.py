"""DSA's decode step on GPU (Pallas -> Triton) in MLA's absorbed form: each new token's heads attend
to its selected cache slots, reading only those rows of the latent cache (docs/dsa.md; the XLA
step it equals is `effattn_jax.ops.dsa.dsa_decode_attention` over MLA's latent view).

The keys are [c ; k^R] and the values c, one row per token shared by every head (MQA in latent
space), so one program per (batch row, new token, group of HEADS heads) holds those heads as its
rows and gathers the selected rows of the latent cache c [B, L, d_c] and of the RoPE keys k^R
[B, L, d_R] `CHUNK` at a time by pointer: each row is read once per group of heads (V3.2's sparse
decode reads it once for all; 16 heads of 512 latent columns are what fits Triton's registers: 128
spill 16 KB on an H100). The score is q_lat . c + q_rope . k^R (two dots, so d_c + d_R need not be a power of
two); an online softmax over the picks, -1 picks masked.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.common import NT, triton_params, used_chunks
from pallas_kernels.dsa.triton import CHUNK, USED_SPEC
from pallas_kernels.moba.common import online_softmax_init, online_softmax_step

HEADS = 16  # heads a program holds (the tensor cores' smallest M)


def supports(latent: int, rope: int) -> bool:
    """Triton's block shapes: both widths powers of two, at least 16 (V3.2: 512 and 64)."""
    return all(w >= 16 and w & (w - 1) == 0 for w in (latent, rope))


def _kernel(idx_ref, used_ref, q_lat_ref, q_rope_ref, lat_ref, kr_ref, o_ref, *, scale):
    b = pl.program_id(0)
    q_lat, q_rope = q_lat_ref[...], q_rope_ref[...]  # [H', d_c], [H', d_R]

    def body(j, carry):
        idx = idx_ref[pl.ds(j * CHUNK, CHUNK)]
        valid, safe = idx >= 0, jnp.maximum(idx, 0)
        c, kr = lat_ref[b, safe, :], kr_ref[b, safe, :]  # the picks' rows [C, d_c], [C, d_R]
        s = jax.lax.dot_general(q_lat, c, NT, preferred_element_type=jnp.float32)
        s += jax.lax.dot_general(q_rope, kr, NT, preferred_element_type=jnp.float32)
        return online_softmax_step(carry, jnp.where(valid[None, :], s * scale, -jnp.inf), c)

    init = online_softmax_init(q_lat.shape[0], o_ref.shape[-1])
    m, l, acc = jax.lax.fori_loop(0, used_ref[0], body, init)
    o_ref[...] = (acc / jnp.where(l > 0, l, 1.0)).astype(o_ref.dtype)


def sparse_latent_decode_gpu(q_lat, q_rope, lat, kr, indices, *, scale, interpret=False):
    """q_lat [B, T, H, d_c] (W_UK folded in), q_rope [B, T, H, d_R], the caches lat [B, L, d_c] and
    kr [B, L, d_R], indices [B, T, K] (-1: none) -> [B, T, H, d_c] in q_lat's dtype: attention over
    the latent rows of each token's selection (apply W_UV after)."""
    b, t, h, dc = q_lat.shape
    dr, kk = q_rope.shape[-1], indices.shape[-1]
    if not supports(dc, dr):
        raise ValueError(
            f"the DSA latent decode kernel takes widths that are powers of two >= 16, not {dc}, {dr}"
        )
    hp, kp = -(-h // HEADS) * HEADS, -(-kk // CHUNK) * CHUNK
    pad_heads = lambda x: jnp.pad(x, ((0, 0), (0, 0), (0, hp - h), (0, 0)))
    idx = jnp.pad(indices.astype(jnp.int32), ((0, 0), (0, 0), (0, kp - kk)), constant_values=-1)
    heads = lambda width: pl.BlockSpec((None, None, HEADS, width), lambda i, j, g: (i, j, g, 0))
    out = pl.pallas_call(
        functools.partial(_kernel, scale=float(scale)),
        grid=(b, t, hp // HEADS),
        in_specs=[
            pl.BlockSpec((None, None, kp), lambda i, j, g: (i, j, 0)),
            USED_SPEC,
            heads(dc),
            heads(dr),
            pl.no_block_spec,
            pl.no_block_spec,
        ],
        out_specs=heads(dc),
        out_shape=jax.ShapeDtypeStruct((b, t, hp, dc), q_lat.dtype),
        compiler_params=triton_params(),
        interpret=bool(interpret),
        name="dsa_latent_decode",
    )(
        idx,
        used_chunks(idx, CHUNK),
        pad_heads(q_lat),
        pad_heads(q_rope.astype(q_lat.dtype)),
        lat.astype(q_lat.dtype),
        kr.astype(q_lat.dtype),
    )
    return out[:, :, :h]
