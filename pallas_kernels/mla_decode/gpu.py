"""Absorbed MLA decode step on GPU (Pallas -> Triton): the same one pass over each row's
cached latent for a group of heads as `tpu.py`, one program per (batch row, head group).

The group's heads are the rows of each [G, tile] score matrix (G a power of two, at least 16,
the least a Triton dot takes); the program loops over the row's latent tiles up to its length
only, loading the last partial tile under a mask, with an online softmax and a [G, d]
accumulator in registers. The group and the tile are chosen so the program's shared memory
fits the GPU (`head_group`): 128 heads of latent 512 + 64 in bf16 ask 294,912 bytes in one group
with 64-slot tiles, over an H200's 232,448, and fit (221,184) with 32-slot tiles.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels import gpu_memory
from pallas_kernels.common import NT, TRITON_STAGES, attention_cost, triton_params

TILE = 64  # latent slots per loop step, at most
MIN_ROWS = 16  # Triton's dot needs 16 rows: the heads are padded to this


def smem_bytes(rows: int, tile: int, d: int, dr: int, itemsize: int, stages: int = TRITON_STAGES) -> int:
    """Shared memory per program, estimated (pallas_kernels/gpu_memory.py): the group's query rows
    held, a latent and RoPE-key tile streamed."""
    t = lambda r, c: gpu_memory.tile(r, c, itemsize)
    return gpu_memory.triton_smem(
        invariant=[t(rows, d), t(rows, dr)], streamed=[t(tile, d), t(tile, dr)], mma_rows=rows, stages=stages
    )


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


def mla_decode_gpu(
    q_lat, q_rope, lat, kr, lengths, scale: float, *, tile: int | None = None, group=None, interpret=False
):
    """As `tpu.mla_decode_tpu`: q_lat [B, H, d], q_rope [B, H, d_R], latent [B, L, d], k^R
    [B, L, d_R], lengths [B] (>= 1) -> [B, H, d] float32. d, d_R, `tile` and `group` (heads per
    program) powers of two; `head_group` chooses what is not given, for this GPU's shared memory
    when compiled on one."""
    b, h, d = q_lat.shape
    dr = kr.shape[-1]
    limit = None if interpret else gpu_memory.device_limit()[0]
    auto_group, auto_tile = head_group(h, d, dr, lat.dtype.itemsize, limit)
    group, tile = group or auto_group, tile or auto_tile
    rows = -(-h // group) * group
    pad = lambda x: jnp.pad(x, ((0, 0), (0, rows - h), (0, 0)))
    heads = lambda width: pl.BlockSpec((None, group, width), lambda i, g: (i, g, 0))
    whole = pl.no_block_spec
    out = pl.pallas_call(
        functools.partial(_kernel, scale=scale, tile=tile),
        grid=(b, rows // group),
        in_specs=[whole, heads(d), heads(dr), whole, whole],
        out_specs=heads(d),
        out_shape=jax.ShapeDtypeStruct((b, rows, d), jnp.float32),
        compiler_params=triton_params(),
        interpret=bool(interpret),
        name="mla_decode_gpu",
        cost_estimate=attention_cost(
            b * rows * lat.shape[1],
            d + dr,
            d,
            b * rows // group * lat.shape[1] * (d + dr) * lat.dtype.itemsize,
        ),
    )(lengths.astype(jnp.int32), pad(q_lat), pad(q_rope), lat, kr)
    return out[:, :h]
