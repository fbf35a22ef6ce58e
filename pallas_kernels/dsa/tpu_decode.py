"""DSA's decode step on TPU (Pallas -> Mosaic) in MLA's absorbed form: each new token's heads attend
to its selected cache slots, reading only those rows of the latent cache (docs/dsa.md; the XLA step
it equals is `effattn_jax.ops.dsa.dsa_decode_attention` over MLA's latent view, and the GPU kernel
is triton_decode.py).

The keys are [c ; k^R] and the values c, one row per token shared by every head, so the heads are
the rows of one [H, CHUNK] score matrix per chunk of picks (MLA's TPU decode, mla_decode/tpu.py,
with gathered rows in place of contiguous tiles). The grid is (batch row, new token, chunk of
picks). The latent cache c [B, L, d_c] and the RoPE keys k^R [B, L, d_R] stay in HBM; each step
copies its chunk's rows by DMA into one of two VMEM slots, one copy per pick, while the next
chunk's copies run into the other slot (paged attention's pattern with pages of one row). The
picks come in as the token's row of the index table in SMEM; the chunks past its last pick copy
and compute nothing (a short context's token reads only its own picks' chunks). Mosaic slices
the rows of a packed dtype only at multiples of its packing, so a bf16 pick copies the row pair
that holds it and the other row is masked. An unused pick (-1) before the last copies row 0 and is
masked. Online softmax in float32 across chunks.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.common import NT, attention_cost, tpu_interpret, used_chunks
from pallas_kernels.dsa.tpu_chunks import over_chunks, softmax_finish, softmax_init, softmax_step

CHUNK = 128  # picks a grid step attends to (the MXU's width; 2 slots of V3.2's 576-wide rows: 288 KiB bf16)


def _row_copies(idx_ref, lat_hbm, kr_hbm, lat_buf, kr_buf, sem, b, chunk, slot, *, pack):
    """The DMAs of chunk `chunk`'s picks into VMEM slot `slot`, as (start, wait) callables: each pick
    brings the `pack` rows that share its 32-bit sublane words, into rows pick * pack of the slot."""

    def each(fn):
        def body(r, carry):
            row = jnp.maximum(idx_ref[chunk * CHUNK + r], 0)
            start = pl.multiple_of(jax.lax.div(row, pack) * pack, pack)
            at = pl.multiple_of(r * pack, pack)
            for src, dst in ((lat_hbm, lat_buf), (kr_hbm, kr_buf)):
                copy = pltpu.make_async_copy(
                    src.at[b, pl.ds(start, pack)], dst.at[slot, pl.ds(at, pack)], sem.at[slot]
                )
                fn(copy)
            return carry

        jax.lax.fori_loop(0, CHUNK, body, 0)

    return lambda: each(lambda copy: copy.start()), lambda: each(lambda copy: copy.wait())


def _kernel(
    used_ref, idx_ref, wanted_ref, ql_ref, qr_ref, lat_hbm, kr_hbm, o_ref,
    lat_buf, kr_buf, sem, m_sc, l_sc, acc_sc, *, scale, pack,
):  # fmt: skip
    copies = functools.partial(
        _row_copies, idx_ref, lat_hbm, kr_hbm, lat_buf, kr_buf, sem, pl.program_id(0), pack=pack
    )

    def step(j, slot, arrived):
        arrived()
        lat, kr = lat_buf[slot], kr_buf[slot]  # [CHUNK * pack, d_c], [CHUNK * pack, d_R]
        s = jax.lax.dot_general(ql_ref[...], lat, NT, preferred_element_type=jnp.float32)
        s += jax.lax.dot_general(qr_ref[...], kr, NT, preferred_element_type=jnp.float32)
        s = jnp.where(wanted_ref[...] > 0, s * scale, -jnp.inf)  # [H, CHUNK * pack]: the picks' own rows
        softmax_step(s, lat, m_sc, l_sc, acc_sc)

    over_chunks(
        used_ref, copies, init=lambda: softmax_init(m_sc, l_sc, acc_sc), step=step,
        finish=lambda: softmax_finish(o_ref, None, m_sc, l_sc, acc_sc),
    )  # fmt: skip


def sparse_latent_decode_tpu(q_lat, q_rope, lat, kr, indices, *, scale, interpret=False):
    """q_lat [B, T, H, d_c] (W_UK folded in), q_rope [B, T, H, d_R], the caches lat [B, L, d_c] and
    kr [B, L, d_R], indices [B, T, K] (-1: none) -> [B, T, H, d_c] in q_lat's dtype: attention over
    the latent rows of each token's selection (apply W_UV after). `interpret`: True, or "tpu" for
    the TPU interpreter (its DMAs and semaphores)."""
    b, t, h, dc = q_lat.shape
    dr, kk, length = q_rope.shape[-1], indices.shape[-1], lat.shape[1]
    dtype = q_lat.dtype
    pack = max(1, 4 // jnp.dtype(dtype).itemsize)  # rows per 32-bit sublane word
    lat, kr = lat.astype(dtype), kr.astype(dtype)
    if length % pack:  # a cache of odd length in bf16 (rare: a copy of it) gets the last pair whole
        lat, kr = (jnp.pad(x, ((0, 0), (0, -length % pack), (0, 0))) for x in (lat, kr))
    kp = -(-kk // CHUNK) * CHUNK
    idx = jnp.pad(indices.astype(jnp.int32), ((0, 0), (0, 0), (0, kp - kk)), constant_values=-1)
    # [B, T, 1, K' * pack]: 1 at each pick's own row among the `pack` rows its copy brings
    wanted = (idx[..., None] >= 0) & (jnp.maximum(idx, 0)[..., None] % pack == jnp.arange(pack))
    wanted = wanted.reshape(b, t, 1, kp * pack).astype(jnp.int32)
    # [B * T]: the chunks up to each token's last pick (at least 1), so a short context's token
    # reads and scores only its own picks' chunks
    used = used_chunks(idx, CHUNK).reshape(b * t)
    heads = lambda width: pl.BlockSpec((None, None, h, width), lambda i, n, j, u: (i, n, 0, 0))
    at_used = lambda i, n, j, u: (i, n, 0, jnp.minimum(j, u[i * t + n] - 1))  # no copy past them
    hbm = pl.BlockSpec(memory_space=pl.ANY)
    rows = CHUNK * pack
    return pl.pallas_call(
        functools.partial(_kernel, scale=float(scale), pack=pack),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1,
            grid=(b, t, kp // CHUNK),
            in_specs=[
                pl.BlockSpec((None, None, kp), lambda i, n, j, u: (i, n, 0), memory_space=pltpu.SMEM),
                pl.BlockSpec((None, None, 1, rows), at_used),
                heads(dc),
                heads(dr),
                hbm,
                hbm,
            ],
            out_specs=heads(dc),
            scratch_shapes=[
                pltpu.VMEM((2, rows, dc), dtype),
                pltpu.VMEM((2, rows, dr), dtype),
                pltpu.SemaphoreType.DMA((2,)),
                pltpu.VMEM((h, 1), jnp.float32),
                pltpu.VMEM((h, 1), jnp.float32),
                pltpu.VMEM((h, dc), jnp.float32),
            ],
        ),
        out_shape=jax.ShapeDtypeStruct((b, t, h, dc), dtype),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary")),
        interpret=tpu_interpret(interpret),
        name="dsa_latent_decode_tpu",
        cost_estimate=attention_cost(
            b * t * h * kp * pack, dc + dr, dc, b * t * kp * pack * (dc + dr) * jnp.dtype(dtype).itemsize
        ),
    )(used, idx, wanted, q_lat, q_rope.astype(dtype), lat, kr)
