"""MoBA's own block on GPU (Pallas -> Triton), gather-free: the queries and keys stay in their
[batch x head, position, D] layout and every program works on contiguous rows.

A query t sees the keys [own_start[t], t] (its own block up to itself; own_start is
non-decreasing in t, and own_start[t] > t - block_size). Flash attention 2's schedule,
restricted to that band:
* forward and dq: one program per (batch x query head, tile of `q_tile` queries), looping over
  `kv_block` keys at a time from the tile's first own-block start to its last query (a
  table gives the first key sub-block per tile, so nothing before the band is visited);
* dK/dV: one program per (batch x KV head, sub-block of `kv_block` keys), looping over the
  query heads of the KV head (GQA) and, for each, the query tiles whose rows can see these
  keys (a table gives where they end), accumulating in registers and writing its rows once.
No gathers of query rows, no per-(tile, sub-block) partials, no scatter-add: dq, dK and dV
come out complete, in the layout XLA already holds.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.common import NT, triton_params
from pallas_kernels.moba.common import dkv_step, online_softmax_init, online_softmax_step


def own_tables(own_start: jax.Array, *, seq_pad: int, q_tile: int, kv_block: int):
    """lo [B, S_pad, 1]: each query's own-block start (a padding row's is itself);
    first [B * nq]: the first key sub-block a query tile reaches; q_end [B * nk]: one past
    the last query tile that reaches a key sub-block (own starts are non-decreasing)."""
    b, s = own_start.shape
    pos = jnp.arange(seq_pad, dtype=jnp.int32)[None]
    lo = jnp.where(pos < s, jnp.pad(own_start, ((0, 0), (0, seq_pad - s))), pos).astype(jnp.int32)
    tile_lo = lo.reshape(b, seq_pad // q_tile, q_tile).min(-1)  # [B, nq], non-decreasing
    last_key = jnp.arange(seq_pad // kv_block, dtype=jnp.int32) * kv_block + kv_block - 1
    q_end = jax.vmap(lambda t: jnp.searchsorted(t, last_key, side="right"))(tile_lo)  # [B, nk]
    first = tile_lo // kv_block
    return lo[..., None], first.astype(jnp.int32).reshape(-1), q_end.astype(jnp.int32).reshape(-1)


def kv_row(r, hq: int, hkv: int):
    """The K/V row (batch x KV head) of query row r (batch x query head)."""
    return (r // hq) * hkv + (r % hq) // (hq // hkv)


def _scores(q, k, lo, q0, k0, *, scale):
    """Scaled scores [Qt, Ck] of queries q0.. against keys k0.., and the own-block mask."""
    s = jax.lax.dot_general(q, k, NT, preferred_element_type=jnp.float32) * scale
    qpos = q0 + jax.lax.broadcasted_iota(jnp.int32, s.shape, 0)
    kpos = k0 + jax.lax.broadcasted_iota(jnp.int32, s.shape, 1)
    return s, (kpos >= lo) & (kpos <= qpos)


def _fwd_kernel(first_ref, q_ref, lo_ref, k_ref, v_ref, o_ref, lse_ref, *, scale, ck, hq, hkv, nq):
    r, i = pl.program_id(0), pl.program_id(1)
    kv, q, lo = kv_row(r, hq, hkv), q_ref[...], lo_ref[...]  # [Qt, D], [Qt, 1]
    qt, dv = q.shape[0], o_ref.shape[-1]

    def body(j, carry):
        keys = pl.ds(j * ck, ck)
        s, mask = _scores(q, k_ref[kv, keys, :], lo, i * qt, j * ck, scale=scale)
        return online_softmax_step(carry, jnp.where(mask, s, -jnp.inf), v_ref[kv, keys, :])

    first = first_ref[(r // hq) * nq + i]
    last = (i * qt + qt - 1) // ck
    m, l, acc = jax.lax.fori_loop(first, last + 1, body, online_softmax_init(qt, dv))
    o_ref[...] = acc / l  # every row sees itself: l > 0
    lse_ref[...] = m + jnp.log(l)


def _grads(q, k, v, lo, do, lse, delta, q0, k0, *, scale):
    """Probabilities p and score gradients ds [Qt, Ck] against the global log-sum-exp."""
    s, mask = _scores(q, k, lo, q0, k0, scale=scale)
    p = jnp.where(mask, jnp.exp(s - lse), 0.0)
    dp = jax.lax.dot_general(do, v, NT, preferred_element_type=jnp.float32)
    return p, p * (dp - delta)


def _dq_kernel(
    first_ref, q_ref, lo_ref, do_ref, lse_ref, delta_ref, k_ref, v_ref, dq_ref, *, scale, ck, hq, hkv, nq
):
    r, i = pl.program_id(0), pl.program_id(1)
    kv, q, lo, do, lse, delta = (
        kv_row(r, hq, hkv),
        q_ref[...],
        lo_ref[...],
        do_ref[...],
        lse_ref[...],
        delta_ref[...],
    )
    qt = q.shape[0]

    def body(j, dq):
        keys = pl.ds(j * ck, ck)
        k = k_ref[kv, keys, :]
        _, ds = _grads(q, k, v_ref[kv, keys, :], lo, do, lse, delta, i * qt, j * ck, scale=scale)
        return dq + jnp.dot(ds.astype(k.dtype), k, preferred_element_type=jnp.float32) * scale

    first = first_ref[(r // hq) * nq + i]
    dq = jax.lax.fori_loop(first, (i * qt + qt - 1) // ck + 1, body, jnp.zeros(dq_ref.shape, jnp.float32))
    dq_ref[...] = dq.astype(dq_ref.dtype)


def _dkv_kernel(
    q_end_ref,
    k_ref,
    v_ref,
    q_ref,
    lo_ref,
    do_ref,
    lse_ref,
    delta_ref,
    dk_ref,
    dv_ref,
    *,
    scale,
    qt,
    hq,
    hkv,
    nk,
):
    rk, j = pl.program_id(0), pl.program_id(1)
    b, group = rk // hkv, hq // hkv
    k, v = k_ref[...], v_ref[...]  # [Ck, D], [Ck, Dv]
    ck = k.shape[0]
    i0 = (j * ck) // qt
    tiles = q_end_ref[b * nk + j] - i0  # query tiles that reach these keys, per query head

    def body(n, carry):
        r, i = b * hq + (rk % hkv) * group + n // tiles, i0 + n % tiles
        rows = pl.ds(i * qt, qt)
        q, do = q_ref[r, rows, :], do_ref[r, rows, :]
        p, ds = _grads(
            q,
            k,
            v,
            lo_ref[b, rows, :],
            do,
            lse_ref[r, rows, :],
            delta_ref[r, rows, :],
            i * qt,
            j * ck,
            scale=scale,
        )
        return dkv_step(carry, q, do, p, ds, scale)

    init = (jnp.zeros(dk_ref.shape, jnp.float32), jnp.zeros(dv_ref.shape, jnp.float32))
    dk, dv = jax.lax.fori_loop(0, group * tiles, body, init)
    dk_ref[...], dv_ref[...] = dk.astype(dk_ref.dtype), dv.astype(dv_ref.dtype)


def _cost(part: str, q, k, v, block_size: int, ck: int):
    """Issued work, estimated: each query row visits about half a block plus one sub-block of keys."""
    rows, seq_pad, d = q.shape[0] * q.shape[1], q.shape[1], q.shape[-1]
    dv, item = v.shape[-1], q.dtype.itemsize
    pairs = rows * min(block_size // 2 + ck, seq_pad)
    flops = {"fwd": 2 * d + 2 * dv, "dq": 4 * d + 2 * dv, "dkv": 4 * d + 4 * dv}[part] * pairs
    kv_reads = pairs // ck * (d + dv) * item  # one sub-block per (tile row, step), shared by the rows
    own_rows = rows * ((d if part == "fwd" else d + dv) * item + 12)
    out = {"fwd": rows * (dv + 1) * 4, "dq": rows * d * item, "dkv": k.shape[0] * seq_pad * (d + dv) * item}[
        part
    ]
    return pl.CostEstimate(
        flops=int(flops), transcendentals=int(pairs), bytes_accessed=int(kv_reads + own_rows + out)
    )


def own_attention_fwd(q, k, v, lo, first, *, scale, block_size, block_sizes, interpret=False):
    """q [B*Hq, S_pad, D], k/v [B*Hkv, S_pad, D|Dv], tables from own_tables ->
    (o [B*Hq, S_pad, Dv] float32, lse [B*Hq, S_pad, 1])."""
    rows, seq_pad, d = q.shape
    qt, ck, dv = block_sizes.q_tile, block_sizes.kv_block, v.shape[-1]
    b = lo.shape[0]
    hq, hkv, nq = rows // b, k.shape[0] // b, seq_pad // qt
    tile = lambda w: pl.BlockSpec((None, qt, w), lambda r, i: (r, i, 0))
    whole = pl.no_block_spec
    return pl.pallas_call(
        functools.partial(_fwd_kernel, scale=scale, ck=ck, hq=hq, hkv=hkv, nq=nq),
        grid=(rows, nq),
        in_specs=[whole, tile(d), pl.BlockSpec((None, qt, 1), lambda r, i: (r // hq, i, 0)), whole, whole],
        out_specs=[tile(dv), tile(1)],
        out_shape=[
            jax.ShapeDtypeStruct((rows, seq_pad, dv), jnp.float32),
            jax.ShapeDtypeStruct((rows, seq_pad, 1), jnp.float32),
        ],
        compiler_params=triton_params(block_sizes.warps(qt, dv), block_sizes.num_stages),
        interpret=bool(interpret),
        name="moba_own_fwd_gpu",
        cost_estimate=_cost("fwd", q, k, v, block_size, ck),
    )(first, q, lo, k, v)


def own_attention_bwd(
    q, k, v, lo, first, q_end, do, lse, delta, *, scale, block_size, block_sizes, interpret=False
):
    """q/do [B*Hq, S_pad, D|Dv], lse/delta [B*Hq, S_pad, 1] (padding rows: lse +inf, delta 0)
    -> (dq [B*Hq, S_pad, D], dk, dv [B*Hkv, S_pad, D|Dv]) in the inputs' dtypes (each written
    once from a float32 accumulator)."""
    rows, seq_pad, d = q.shape
    qt, ck, dv = block_sizes.q_tile, block_sizes.kv_block, v.shape[-1]
    b = lo.shape[0]
    hq, hkv, nq, nk = rows // b, k.shape[0] // b, seq_pad // qt, seq_pad // ck
    tile = lambda w: pl.BlockSpec((None, qt, w), lambda r, i: (r, i, 0))
    whole = pl.no_block_spec
    dq = pl.pallas_call(
        functools.partial(_dq_kernel, scale=scale, ck=ck, hq=hq, hkv=hkv, nq=nq),
        grid=(rows, nq),
        in_specs=[
            whole,
            tile(d),
            pl.BlockSpec((None, qt, 1), lambda r, i: (r // hq, i, 0)),
            tile(dv),
            tile(1),
            tile(1),
            whole,
            whole,
        ],
        out_specs=tile(d),
        out_shape=jax.ShapeDtypeStruct((rows, seq_pad, d), q.dtype),
        compiler_params=triton_params(block_sizes.warps(qt, d), block_sizes.num_stages),
        interpret=bool(interpret),
        name="moba_own_dq_gpu",
        cost_estimate=_cost("dq", q, k, v, block_size, ck),
    )(first, q, lo, do, lse, delta, k, v)
    keys = lambda w: pl.BlockSpec((None, ck, w), lambda r, j: (r, j, 0))
    dk, dvv = pl.pallas_call(
        functools.partial(_dkv_kernel, scale=scale, qt=qt, hq=hq, hkv=hkv, nk=nk),
        grid=(k.shape[0], nk),
        in_specs=[whole, keys(d), keys(dv)] + [whole] * 5,
        out_specs=[keys(d), keys(dv)],
        out_shape=[
            jax.ShapeDtypeStruct((k.shape[0], seq_pad, d), k.dtype),
            jax.ShapeDtypeStruct((k.shape[0], seq_pad, dv), v.dtype),
        ],
        compiler_params=triton_params(block_sizes.warps(ck, d + dv), block_sizes.num_stages),
        interpret=bool(interpret),
        name="moba_own_dkv_gpu",
        cost_estimate=_cost("dkv", q, k, v, block_size, ck),
    )(q_end, k, v, q, lo, do, lse, delta)
    return dq, dk, dvv
