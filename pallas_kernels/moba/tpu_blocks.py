"""MoBA's selected earlier blocks on TPU (Pallas -> Mosaic): one grid step per tile, the
whole block in that step.

A tile holds up to `past_q_tile` query rows of one (batch, KV head, block) group, from any of
the KV head's query heads (GQA: one K/V fetch serves them all). Each step fetches the block's
keys as one window of `block_size + A` keys starting at the block start rounded down to A,
the dtype's sublane tile (an element-offset BlockSpec, `pl.Element`, whose copies then start
on whole tiles: A = 16 keys in bf16), so consecutive tiles of a group keep the
same window index and Pallas skips the copy. Every row sees the whole block, so the forward
is a plain softmax (no online rescaling) and the backward finishes dq within the step; dK/dV
accumulate in float32 VMEM across the group's consecutive tiles (megablox's pattern: zero on
the group's first tile) and, at its last tile, are added into the own part's dK/dV over the
window, in place (input/output aliased, the window read, added and written back by DMAs the
step awaits: neighbouring blocks' windows overlap), so no per-group array or final pass exists.
Padding tiles (after the real ones, group G) keep the last real tile's K/V window and input
rows, so nothing is copied in, and skip their work (`pl.when`); their output blocks are their
own (never read: on a megacore grid split, a shared one would be written back from both).
Scores are computed transposed, [keys, rows], so lse and delta are lane-dense rows, not
[rows, 1] columns.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.common import NT, TN, sublane_tile, tpu_interpret, tpu_vmem_limit


def window(block_size: int, dtype) -> int:
    """Keys fetched per step: the block plus the alignment slack before it, one sublane tile."""
    return block_size + sublane_tile(dtype)


def window_starts(block_start: jax.Array, block_size: int, seq_len: int, dtype) -> jax.Array:
    """Each block's window start: the block start rounded down to the dtype's sublane tile A,
    and no later than the last A-aligned window inside the seq_len keys (which still holds the
    block: a block ends by seq_len, and seq_len is a multiple of A or at least A past the last
    block; pallas_kernels.common.ALIGN is a multiple of every A)."""
    align = sublane_tile(dtype)
    last = (seq_len - window(block_size, dtype)) // align * align
    return jnp.minimum(block_start // align * align, last).astype(jnp.int32)


def _scores_t(q, k, offset, *, scale, block_size):
    """Scores [W, Qt] (keys x rows) and the mask of the keys inside the tile's block, which
    starts `offset` keys into the window."""
    s = jax.lax.dot_general(k, q, NT, preferred_element_type=jnp.float32) * scale
    kpos = jax.lax.broadcasted_iota(jnp.int32, s.shape, 0)
    return s, (kpos >= offset) & (kpos < offset + block_size)


def _offset(win_ref, start_ref, t, align):
    return start_ref[t] - win_ref[t] * align  # win: the window start in units of the sublane tile


def _fwd_kernel(
    kv_ref,
    win_ref,
    start_ref,
    group_ref,
    row_tile_ref,
    q_ref,
    k_ref,
    v_ref,
    *refs,
    scale,
    block_size,
    num_groups,
    align,
):
    o_ref, lse_ref = refs[-2:]  # before them: o_into, lse_into (aliased to them), if given
    t = pl.program_id(0)
    offset = _offset(win_ref, start_ref, t, align)

    @pl.when(group_ref[t] < num_groups)  # padding tiles: no work (their output is never read)
    def _tile():
        s, inside = _scores_t(q_ref[...], k_ref[...], offset, scale=scale, block_size=block_size)
        s = jnp.where(inside, s, -jnp.inf)
        m = jnp.max(s, axis=0, keepdims=True)  # [1, Qt]: every row sees the whole (non-empty) block
        p = jnp.exp(s - m)
        l = jnp.sum(p, axis=0, keepdims=True)
        v = v_ref[...]
        o_ref[...] = jax.lax.dot_general((p / l).astype(v.dtype), v, TN, preferred_element_type=jnp.float32)
        lse_ref[...] = m + jnp.log(l)


def _bwd_kernel(
    kv_ref,
    win_ref,
    start_ref,
    group_ref,
    first_ref,
    row_tile_ref,
    q_ref,
    k_ref,
    v_ref,
    do_ref,
    lse_ref,
    delta_ref,
    *refs,
    scale,
    block_size,
    num_groups,
    kv_heads,
    align,
):
    # before them: dk_own, dv_own (and dq_into), aliased to dk_ref, dv_ref (and dq_ref)
    dq_ref, dk_ref, dv_ref, dk_acc, dv_acc, dk_win, dv_win, sems = refs[-8:]
    t = pl.program_id(0)
    offset = _offset(win_ref, start_ref, t, align)

    @pl.when(first_ref[t] == 1)
    def _zero():
        dk_acc[...] = jnp.zeros(dk_acc.shape, jnp.float32)
        dv_acc[...] = jnp.zeros(dv_acc.shape, jnp.float32)

    @pl.when(group_ref[t] < num_groups)  # padding tiles: no work (their dq is dropped)
    def _tile():
        q, k, v, do = q_ref[...], k_ref[...], v_ref[...], do_ref[...]
        s, inside = _scores_t(q, k, offset, scale=scale, block_size=block_size)
        p = jnp.where(inside, jnp.exp(s - lse_ref[...]), 0.0)  # [W, Qt]; padding rows: lse = +inf
        dp = jax.lax.dot_general(v, do, NT, preferred_element_type=jnp.float32)  # [W, Qt]
        ds = p * (dp - delta_ref[...])
        dq = jax.lax.dot_general(ds.astype(k.dtype), k, TN, preferred_element_type=jnp.float32)
        dq_ref[...] = (dq * scale).astype(dq_ref.dtype)
        dk_acc[...] += jnp.dot(ds.astype(q.dtype), q, preferred_element_type=jnp.float32) * scale
        dv_acc[...] += jnp.dot(p.astype(do.dtype), do, preferred_element_type=jnp.float32)

    last = pl.num_programs(0) - 1
    group_ends = (t == last) | (group_ref[jnp.minimum(t + 1, last)] != group_ref[t])

    @pl.when(group_ends & (group_ref[t] < num_groups))
    def _add_to_own():
        # read, add, write back, each copy awaited within the step: windows of neighbouring
        # blocks overlap (the alignment slack), so no copy may be in flight across steps
        copies = [
            (_window(ref, kv_ref[t], win_ref[t], kv_heads, buf.shape, align), buf, sems.at[i])
            for i, (ref, buf) in enumerate(((dk_ref, dk_win), (dv_ref, dv_win)))
        ]
        _awaited([pltpu.make_async_copy(hbm, buf, sem) for hbm, buf, sem in copies])
        dk_win[...] = (dk_win[...].astype(jnp.float32) + dk_acc[...]).astype(dk_win.dtype)
        dv_win[...] = (dv_win[...].astype(jnp.float32) + dv_acc[...]).astype(dv_win.dtype)
        _awaited([pltpu.make_async_copy(buf, hbm, sem) for hbm, buf, sem in copies])


def _awaited(copies):
    for c in copies:
        c.start()
    for c in copies:
        c.wait()


def _window(ref, kv_row, win, kv_heads, shape, align):
    """The group's window [W, D] of a key gradient in HBM: [B*Hkv, S_pad, D], or the natural
    [B, S, Hkv*D] (kv_heads = Hkv; the head's D lanes)."""
    w, width = shape
    keys = pl.ds(pl.multiple_of(win * align, align), w)
    if kv_heads is None:
        return ref.at[kv_row, keys, :]
    lanes = pl.ds(pl.multiple_of(jax.lax.rem(kv_row, kv_heads) * width, width), width)
    return ref.at[jax.lax.div(kv_row, kv_heads), keys, lanes]


def _kv_spec(w: int, width: int, kv_heads, align: int):
    """A window of w keys of one KV head: from k/v [B*Hkv, S_pad, D] (kv_heads None), or from
    the natural [B, S, Hkv*D] (its D lanes; D a multiple of 128 on a TPU)."""
    if kv_heads is None:
        return pl.BlockSpec(
            (None, pl.Element(w), pl.Element(width)), lambda t, kv, win, *_: (kv[t], win[t] * align, 0)
        )
    return pl.BlockSpec(  # Mosaic takes element offsets on every dim or none: the head's lanes too
        (None, pl.Element(w), pl.Element(width)),
        lambda t, kv, win, *_: (
            jax.lax.div(kv[t], kv_heads),
            win[t] * align,
            jax.lax.rem(kv[t], kv_heads) * width,
        ),
    )


def _row_tiles(tile_group, num_groups: int):
    """The tile whose rows each step reads: its own, and on padding tiles (group `num_groups`,
    after the real ones) the last real tile's, so the pipeline copies no rows for them."""
    tile = jnp.arange(tile_group.shape[0], dtype=jnp.int32)
    return jnp.minimum(tile, jnp.maximum(jnp.sum(tile_group < num_groups) - 1, 0)).astype(jnp.int32)


def _vmem_limit(q_rows, kv_dtype, w: int, d: int, dv: int, backward: bool = False) -> int:
    """A step's scoped VMEM: the K/V window and the tile's rows (with dO, lse, delta and dq in
    the backward), the backward's dK/dV accumulators and window buffers, and four [W, Qt]
    float32 temporaries (scores, probabilities, dP, dS). libtpu needed 19.6 MiB for the
    backward at a MoBA block of 4,096, over Mosaic's 16 MiB default."""
    _, qt, _ = q_rows.shape
    item, kv_item = q_rows.dtype.itemsize, jnp.dtype(kv_dtype).itemsize
    rows = qt * (d * item + (dv + 1) * 4)
    if not backward:
        return tpu_vmem_limit(w * (d + dv) * kv_item + rows, 0, 4 * w * qt * 4)
    rows += qt * ((dv + d) * item + 8)
    return tpu_vmem_limit(w * (d + dv) * kv_item + rows, w * (d + dv) * (4 + kv_item), 4 * w * qt * 4)


def cost_estimate(part: str, q_rows, dv: int, block_size: int, groups: int = 0):
    """`pl.CostEstimate` as issued: every step multiplies its rows by the whole window."""
    ntiles, qt, d = q_rows.shape
    item, w = q_rows.dtype.itemsize, window(block_size, q_rows.dtype)
    pairs = ntiles * qt * w
    rows = ntiles * qt * (d * item + 4)  # q and lse
    if part == "fwd":
        return pl.CostEstimate(
            flops=int(pairs * (2 * d + 2 * dv)),
            transcendentals=int(pairs),
            bytes_accessed=int(ntiles * w * (d + dv) * item + rows + ntiles * qt * dv * 4),
        )
    return pl.CostEstimate(
        flops=int(pairs * (6 * d + 4 * dv)),
        transcendentals=int(pairs),
        bytes_accessed=int(
            ntiles * w * (d + dv) * item
            + rows
            + ntiles * qt * (dv * item + 4 + d * item)
            + 2 * groups * w * (d + dv) * item  # each group's window of dK/dV: read, added, written
        ),
    )


def block_attention_fwd(
    q_rows,
    k,
    v,
    kv_row,
    block_start,
    tile_group,
    *,
    scale,
    block_size,
    block_sizes,
    num_groups,
    kv_heads=None,
    into=None,
    first_tile=0,
    num_tiles=None,
    interpret=False,
):
    """q_rows [T, Qt, D]; k/v [B*Hkv, S_pad, D|Dv] with S_pad >= S + ALIGN, or with kv_heads
    = Hkv the natural [B, S, Hkv*D|Dv] with S a multiple of ALIGN (`window_starts`); kv_row,
    block_start, tile_group [T] (tiles of group `num_groups` are padding, skipped). Returns
    o [T, Qt, Dv] float32 (normalised) and lse [T, Qt].

    A schedule may run in slices, one call each (tiles first_tile.. of num_tiles, so that its
    scalar-prefetched tables fit SMEM: tpu_smem.py): o and lse then come whole, [num_tiles, ...],
    this call's tiles written into `into` (the previous call's (o, lse), aliased; None on the
    first, whose other tiles are left unwritten)."""
    ntiles, qt, d = q_rows.shape
    num_tiles = ntiles if num_tiles is None else num_tiles
    if not 0 <= first_tile <= num_tiles - ntiles:
        raise ValueError(f"tiles {first_tile}..{first_tile + ntiles} are not inside the {num_tiles} tiles")
    into = [] if into is None else [into[0], into[1].reshape(num_tiles, 1, qt)]
    dv, w, align = v.shape[-1] // (kv_heads or 1), window(block_size, k.dtype), sublane_tile(k.dtype)
    kv_spec = lambda width: _kv_spec(w, width, kv_heads, align)
    o, lse = pl.pallas_call(
        functools.partial(
            _fwd_kernel, scale=scale, block_size=block_size, num_groups=num_groups, align=align
        ),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=5,
            grid=(ntiles,),
            in_specs=[
                pl.BlockSpec((None, qt, d), lambda t, *refs: (refs[-1][t], 0, 0)),
                kv_spec(d),
                kv_spec(dv),
            ]
            + [pl.BlockSpec(memory_space=pl.ANY)] * len(into),
            out_specs=[
                pl.BlockSpec((None, qt, dv), lambda t, *_: (t + first_tile, 0, 0)),
                pl.BlockSpec((None, 1, qt), lambda t, *_: (t + first_tile, 0, 0)),
            ],
        ),
        out_shape=[
            jax.ShapeDtypeStruct((num_tiles, qt, dv), jnp.float32),
            jax.ShapeDtypeStruct((num_tiles, 1, qt), jnp.float32),
        ],
        input_output_aliases={8: 0, 9: 1} if into else {},  # o, lse into (after 5 tables, q, k, v)
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel",), vmem_limit_bytes=_vmem_limit(q_rows, k.dtype, w, d, dv)
        ),
        interpret=tpu_interpret(interpret),
        name="moba_block_fwd",
        cost_estimate=cost_estimate("fwd", q_rows, dv, block_size),
    )(
        kv_row,
        window_starts(block_start, block_size, k.shape[1], k.dtype) // align,
        block_start,
        tile_group,
        _row_tiles(tile_group, num_groups),
        q_rows,
        k,
        v,
        *into,
    )
    return o, lse.reshape(num_tiles, qt)


def block_attention_bwd(
    q_rows,
    k,
    v,
    kv_row,
    block_start,
    tile_group,
    group_first,
    do_rows,
    lse,
    delta,
    dk_own,
    dv_own,
    *,
    scale,
    block_size,
    block_sizes,
    num_groups,
    kv_heads=None,
    dq_into=None,
    first_tile=0,
    num_tiles=None,
    interpret=False,
):
    """do_rows [T, Qt, Dv]; lse, delta [T, Qt] (+inf / 0 on padding rows); tile_group,
    group_first [T]; dk_own, dv_own: the own part's dK/dV, laid out like k and v. Returns dq
    [T, Qt, D] in the rows' dtype (each row's part is complete: one rounding, like a flash
    backward's dq), and dK, dV: dk_own, dv_own with each group's float32 sum added over its
    window (`window_starts`) and rounded once, in place (the buffers are aliased).

    A schedule may run in slices, one call each (tiles first_tile.. of num_tiles): dq then
    comes as the whole [num_tiles, Qt, D], this call's tiles written into dq_into (the previous
    call's, aliased; None on the first, whose other tiles are left unwritten). The first tile
    of a slice must be marked in group_first (its group's accumulators start there)."""
    if dk_own.shape != k.shape or dv_own.shape != v.shape:
        raise ValueError(f"dk_own, dv_own must be laid out like k, v: {dk_own.shape}, {dv_own.shape}")
    ntiles, qt, d = q_rows.shape
    num_tiles = ntiles if num_tiles is None else num_tiles
    if not 0 <= first_tile <= num_tiles - ntiles:
        raise ValueError(f"tiles {first_tile}..{first_tile + ntiles} are not inside the {num_tiles} tiles")
    dq_in = [] if dq_into is None else [dq_into]
    dv, w, align = v.shape[-1] // (kv_heads or 1), window(block_size, k.dtype), sublane_tile(k.dtype)
    row_in = lambda width: pl.BlockSpec((None, qt, width), lambda t, *refs: (refs[-1][t], 0, 0))
    lane_row = pl.BlockSpec((None, 1, qt), lambda t, *refs: (refs[-1][t], 0, 0))
    kv_spec = lambda width: _kv_spec(w, width, kv_heads, align)
    in_hbm = pl.BlockSpec(memory_space=pl.ANY)
    return pl.pallas_call(
        functools.partial(
            _bwd_kernel,
            scale=scale,
            block_size=block_size,
            num_groups=num_groups,
            kv_heads=kv_heads,
            align=align,
        ),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=6,
            grid=(ntiles,),
            in_specs=[row_in(d), kv_spec(d), kv_spec(dv), row_in(dv), lane_row, lane_row]
            + [in_hbm] * (2 + len(dq_in)),
            out_specs=[pl.BlockSpec((None, qt, d), lambda t, *_: (t + first_tile, 0, 0)), in_hbm, in_hbm],
            scratch_shapes=[
                pltpu.VMEM((w, d), jnp.float32),
                pltpu.VMEM((w, dv), jnp.float32),
                pltpu.VMEM((w, d), dk_own.dtype),
                pltpu.VMEM((w, dv), dv_own.dtype),
                pltpu.SemaphoreType.DMA((2,)),
            ],
        ),
        out_shape=[
            jax.ShapeDtypeStruct((num_tiles, qt, d), q_rows.dtype),
            jax.ShapeDtypeStruct(dk_own.shape, dk_own.dtype),
            jax.ShapeDtypeStruct(dv_own.shape, dv_own.dtype),
        ],
        # dk_own, dv_own, dq_into (after the 6 scalar tables)
        input_output_aliases={12: 1, 13: 2, **({14: 0} if dq_in else {})},
        # dK/dV accumulate across consecutive steps and windows are updated in place: in order
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("arbitrary",),
            vmem_limit_bytes=_vmem_limit(q_rows, k.dtype, w, d, dv, backward=True),
        ),
        interpret=tpu_interpret(interpret),
        name="moba_block_bwd",
        # a slice's share of the groups' window updates
        cost_estimate=cost_estimate("bwd", q_rows, dv, block_size, -(-num_groups * ntiles // num_tiles)),
    )(
        kv_row,
        window_starts(block_start, block_size, k.shape[1], k.dtype) // align,
        block_start,
        tile_group,
        group_first,
        _row_tiles(tile_group, num_groups),
        q_rows,
        k,
        v,
        do_rows,
        lse.reshape(ntiles, 1, qt),
        delta.reshape(ntiles, 1, qt),
        dk_own,
        dv_own,
        *dq_in,
    )
