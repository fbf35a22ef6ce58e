"""Absorbed MLA decode step on GPU (Pallas -> Triton), split over the cache (flash-decoding, as
FlashMLA): the same pass over each row's cached latent for a group of heads as `tpu.py`, but one
program per (batch row, head group, slice of the cache), so a batch of one still fills the GPU.

The group's heads are the rows of each [G, tile] score matrix (G a power of two, at least 16,
the least a Triton dot takes); a program loops over its slice's latent tiles up to the row's
length only, loading the last partial tile under a mask, with an online softmax and a [G, d]
accumulator in registers, and writes its slice's normalised output with the softmax's max and
sum. `common.combine_partials` (XLA, one small fusion) merges the slices; one slice needs no merge. A
slice past a row's length does no work (rows of different lengths share the grid).

The group and the tile are chosen so a program's shared memory fits the GPU (`head_group`): 128
heads of latent 512 + 64 in bf16 ask 294,912 bytes in one group with 64-slot tiles, over an
H200's 232,448, and fit (221,184) with 32-slot tiles. The slices (`slices`) are chosen so the
grid covers the device's multiprocessors once (`gpu_memory.multiprocessors`), each slice at
least MIN_SLICE slots.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels import gpu_memory
from pallas_kernels.common import NT, TRITON_STAGES, attention_cost, combine_partials, triton_params

TILE = 64  # latent slots per loop step, at most
MIN_ROWS = 16  # Triton's dot needs 16 rows: the heads are padded to this
MIN_SLICE = 256  # cache slots a slice takes at least: shorter ones cost more in partials than they save


def smem_bytes(rows: int, tile: int, d: int, dr: int, itemsize: int, stages: int = TRITON_STAGES) -> int:
    """Shared memory per program, estimated (pallas_kernels/gpu_memory.py): the group's query rows
    held, a latent and RoPE-key tile streamed."""
    t = lambda r, c: gpu_memory.tile(r, c, itemsize)
    return gpu_memory.triton_smem(
        invariant=[t(rows, d), t(rows, dr)], streamed=[t(tile, d), t(tile, dr)], mma_rows=rows, stages=stages
    )


def warps(group: int, d: int) -> int:
    """Triton warps of a program: 8 for a float32 accumulator of more than 16 x 128 and at most 16 x 256
    (16 heads over a latent of 256 spill at 4 warps), else 4: larger groups at 8 warps ask for more
    shared memory than an H100 has (32 heads over 512: 262,144 B; `make gpu-compile`)."""
    return 8 if 16 * 128 < group * d <= 16 * 256 else 4


def head_group(heads: int, d: int, dr: int, itemsize: int, limit: int | None = None) -> tuple[int, int]:
    """(heads per program, latent tile): the largest group (a power of two >= MIN_ROWS, at most the
    heads padded), then the largest tile (TILE down to 16), whose shared memory fits `limit`
    (default: an H100/H200's); the smallest of both when nothing fits."""
    limit = limit or gpu_memory.smem_limit()
    group = max(MIN_ROWS, 1 << (heads - 1).bit_length())
    while True:
        for tile in (TILE, TILE // 2, TILE // 4):
            if smem_bytes(group, tile, d, dr, itemsize) <= limit or group == MIN_ROWS and tile == 16:
                return group, tile
        group //= 2


def slices(batch: int, groups: int, length: int, tile: int, multiprocessors: int) -> tuple[int, int]:
    """(slices per row, slots per slice, a multiple of `tile`): enough slices that batch x groups x
    slices programs cover the multiprocessors once, none shorter than MIN_SLICE slots (one slice
    for a short cache or a batch that already fills the GPU)."""
    want = -(-multiprocessors // (batch * groups))
    return slice_size(length, max(1, min(want, length // MIN_SLICE)), tile)


def slice_size(length: int, count: int, tile: int) -> tuple[int, int]:
    """(slices, slots per slice): `count` slices of `length` slots rounded up to whole tiles (the
    rounding may leave fewer slices)."""
    size = pl.cdiv(pl.cdiv(length, count), tile) * tile
    return pl.cdiv(length, size), size


def _kernel(len_ref, ql_ref, qr_ref, lat_ref, kr_ref, o_ref, m_ref, l_ref, *, scale, tile, size):
    b, first = pl.program_id(0), pl.program_id(2) * size
    end = jnp.minimum(len_ref[b], first + size)  # this slice's slots: first .. end - 1
    q_lat, q_rope = ql_ref[...], qr_ref[...]  # [G, d], [G, d_R]
    rows = q_lat.shape[0]

    def body(j, carry):
        m, l, acc = carry
        start = first + j * tile
        ok = start + jax.lax.broadcasted_iota(jnp.int32, (tile,), 0) < end
        window = (b, pl.ds(start, tile), slice(None))
        lat = pltriton.load(lat_ref.at[window], mask=ok[:, None], other=0.0)  # [tile, d]
        kr = pltriton.load(kr_ref.at[window], mask=ok[:, None], other=0.0)
        s = jax.lax.dot_general(q_lat, lat, NT, preferred_element_type=jnp.float32)
        s += jax.lax.dot_general(q_rope, kr, NT, preferred_element_type=jnp.float32)
        s = jnp.where(ok[None, :], s * scale, -jnp.inf)  # [G, tile]
        m_new = jnp.maximum(m, jnp.max(s, axis=1))  # finite: a tile's first slot is real
        p = jnp.exp(s - m_new[:, None])
        alpha = jnp.exp(m - m_new)
        acc = alpha[:, None] * acc + jnp.dot(p.astype(lat.dtype), lat, preferred_element_type=jnp.float32)
        return m_new, alpha * l + jnp.sum(p, axis=1), acc

    init = (
        jnp.full((rows,), -jnp.inf, jnp.float32),
        jnp.zeros((rows,), jnp.float32),
        jnp.zeros(o_ref.shape, jnp.float32),
    )
    m, l, acc = jax.lax.fori_loop(0, pl.cdiv(jnp.maximum(end - first, 0), tile), body, init)
    o_ref[...] = acc / jnp.where(l > 0, l, 1.0)[:, None]  # a slice past the row's end: zeros, l = 0
    m_ref[...] = m
    l_ref[...] = l


def mla_decode_gpu(
    q_lat,
    q_rope,
    lat,
    kr,
    lengths,
    scale: float,
    *,
    tile: int | None = None,
    group=None,
    num_slices: int | None = None,
    interpret=False,
):
    """As `tpu.mla_decode_tpu`: q_lat [B, H, d], q_rope [B, H, d_R], latent [B, L, d], k^R
    [B, L, d_R], lengths [B] (>= 1) -> [B, H, d] float32. d, d_R, `tile` and `group` (heads per
    program) powers of two; `head_group` chooses what is not given, for this GPU's shared memory
    when compiled on one, and `slices` the number of slices per row (`num_slices`), for this
    GPU's multiprocessors."""
    b, h, d = q_lat.shape
    length, dr = lat.shape[1], kr.shape[-1]
    limit = None if interpret else gpu_memory.device_limit()[0]
    auto_group, auto_tile = head_group(h, d, dr, lat.dtype.itemsize, limit)
    group, tile = group or auto_group, tile or auto_tile
    rows = -(-h // group) * group
    if num_slices is None:
        count, size = slices(b, rows // group, length, tile, gpu_memory.multiprocessors())
    else:
        count, size = slice_size(length, num_slices, tile)
    pad = lambda x: jnp.pad(x, ((0, 0), (0, rows - h), (0, 0)))
    heads = lambda width: pl.BlockSpec((None, group, width), lambda i, g, s: (i, g, 0))
    part = lambda *width: pl.BlockSpec(
        (None, None, group, *width), lambda i, g, s: (i, s, g) + (0,) * len(width)
    )
    whole = pl.no_block_spec
    out, m, l = pl.pallas_call(
        functools.partial(_kernel, scale=scale, tile=tile, size=size),
        grid=(b, rows // group, count),
        in_specs=[whole, heads(d), heads(dr), whole, whole],
        out_specs=[part(d), part(), part()],
        out_shape=[
            jax.ShapeDtypeStruct((b, count, rows, d), jnp.float32),
            jax.ShapeDtypeStruct((b, count, rows), jnp.float32),
            jax.ShapeDtypeStruct((b, count, rows), jnp.float32),
        ],
        compiler_params=triton_params(num_warps=warps(group, d)),
        interpret=bool(interpret),
        name="mla_decode_gpu",
        cost_estimate=attention_cost(
            b * rows * length,
            d + dr,
            d,
            b * rows // group * length * (d + dr) * lat.dtype.itemsize,
        ),
    )(lengths.astype(jnp.int32), pad(q_lat), pad(q_rope), lat, kr)
    out = out[:, 0] if count == 1 else combine_partials(out, m, l, axis=1)
    return out[:, :h]
