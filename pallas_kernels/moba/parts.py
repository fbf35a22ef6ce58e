"""The pieces both MoBA kernel paths are built from, the one surface they share: the whole
sequence (attention.py) and a context shard's queries against the whole sequence's keys
(context.py) each assemble their custom_vjp from these, and import nothing else of each other.

- `KernelCall`: one call's configuration (backend, interpret mode, tiles, MoBA block, scale, the
  kernel modules from kernels.py), frozen, the same for every kernel the call runs.
- `layout`: how the kernels see q, K, V (head-major copies, or on TPU the arrays in place).
- `past_schedule`: the selected blocks' tiles (schedule.past_tiles).
- `own_forward` / `own_backward`: the own block by the backend's own-block kernels.
- `past_forward` / `past_backward`: the selected earlier blocks by its whole-block kernels.
- `merge`: the parts of each query merged by log-sum-exp; `combine_dq`: dq's parts added.
Both merge and combine_dq run over positions a chunk at a time on long sequences (MERGE_ROWS).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from pallas_kernels import gpu_dispatch, gpu_memory, registry
from pallas_kernels.common import ALIGN
from pallas_kernels.gpu_dispatch import GPU_BACKENDS
from pallas_kernels.moba import tpu_smem
from pallas_kernels.moba.kernels import Kernels
from pallas_kernels.moba.schedule import BACKENDS, BlockSizes, past_tiles


@dataclasses.dataclass(frozen=True)
class KernelCall:
    """What every kernel of one MoBA call shares: backend ("tpu" | "gpu"), the Pallas GPU backend
    its GPU kernels are written for ("mosaic" | "triton"; "" on TPU), interpret mode (a bool,
    "tpu" or TPU InterpretParams), the resolved tiles, the MoBA block size, the softmax scale and
    the kernel modules it runs (kernels.Kernels; left out: the registry's for `gpu_kernels`, else
    for the backend, Triton's on a GPU). Frozen and hashable: it is a custom_vjp's static argument."""

    backend: str
    interpret: Any
    block_sizes: BlockSizes
    block_size: int
    scale: float
    gpu_kernels: str = ""
    kernels: Kernels | None = None

    def __post_init__(self):
        if self.kernels is None:
            object.__setattr__(
                self,
                "kernels",
                registry.kernel("moba", "attention", self.gpu_kernels or _KERNEL_BACKEND[self.backend]),
            )

    @classmethod
    def fitted(
        cls, block_sizes: BlockSizes | None, q, v, *, block_size, scale, backend, interpret, kernels=None
    ):
        """A call whose tiles are `block_sizes` with `auto` fields chosen for the backend, head dim,
        dtype and (on a GPU) shared memory, then checked against what the backend's compiler
        accepts. Compiled for a GPU, the limit is this GPU's, or an H100/H200's when none is at
        hand (an AOT export). `backend`: "tpu", "gpu" (the GPU kernels `gpu_kernels_for` picks),
        or "mosaic" / "triton" (those GPU kernels, or a ValueError saying why they cannot run).
        `kernels` (kernels.Kernels): other modules to run than the backend's, tiles as for it."""
        if backend not in BACKENDS + GPU_BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS + GPU_BACKENDS}, got {backend!r}")
        hardware = "gpu" if backend in GPU_BACKENDS else backend
        limit, device = gpu_memory.device_limit() if hardware == "gpu" and not interpret else (None, "")
        shape = dict(head_dim=q.shape[-1], v_head_dim=v.shape[-1], itemsize=q.dtype.itemsize)
        sizes = (block_sizes or BlockSizes()).resolve(
            hardware, block_size=block_size, smem_limit=limit, **shape
        )
        gpu = ""
        if hardware == "gpu":
            gpu = gpu_kernels_for(backend, sizes, q, v, block_size=block_size)
        if gpu != "mosaic":  # the Triton and TPU compilers' limits (Mosaic's: its `supports`)
            sizes.check_backend(
                hardware, block_size, compiler=not interpret, smem_limit=limit, device=device, **shape
            )
        return cls(hardware, interpret, sizes, block_size, float(scale), gpu, kernels)

    @property
    def kernel_args(self) -> dict:
        """The keyword arguments every kernel entry takes."""
        return dict(
            scale=self.scale,
            block_size=self.block_size,
            block_sizes=self.block_sizes,
            interpret=self.interpret,
        )


_KERNEL_BACKEND = {"tpu": "tpu", "gpu": "triton"}  # the kernels of a call that names no GPU kernels


def gpu_kernels_for(backend: str, sizes: BlockSizes, q, v, *, block_size: int) -> str:
    """ "mosaic" or "triton": which GPU kernels run, as gpu_dispatch.choose answers for `backend` "gpu"
    (pallas_gpu, auto: the verified kernels) or "mosaic" / "triton" (those, or a ValueError saying
    why they cannot run)."""
    shape = dict(head_dim=q.shape[-1], v_head_dim=v.shape[-1], dtype=q.dtype)

    def mosaic():
        kernels = registry.kernel("moba", "attention", "mosaic")
        for module in (kernels.own, kernels.blocks):
            if reason := module.supports(block_sizes=sizes, block_size=block_size, **shape):
                return reason
        return None

    supports = {"mosaic": mosaic, "triton": lambda: None}  # Triton's limits: check_backend, below
    return gpu_dispatch.choose("moba_attention", f"pallas_{backend}", supports).kernel


def _heads(x, seq_pad):
    """[B, S, H, D] -> [B*H, S_pad, D], zero-padded: one row of positions per (batch, head)."""
    pad = seq_pad - x.shape[1]
    return jnp.pad(jnp.moveaxis(x, 2, 1), ((0, 0), (0, 0), (0, pad), (0, 0))).reshape(
        -1, seq_pad, x.shape[-1]
    )


def _unheads(x, b, s):
    """[B*H, >=S, ...] -> [B, S, H, ...]."""
    return jnp.moveaxis(x.reshape(b, -1, *x.shape[1:])[:, :, :s], 1, 2)


def padded_length(s: int, block_size: int, block_sizes: BlockSizes) -> int:
    """S_pad: a multiple of the block (the TPU own-block chunks) and of the GPU own-block tiles
    and sub-blocks, and at least S + ALIGN and block + ALIGN (the whole-block kernels' windows,
    the block plus at most ALIGN keys of slack, may run past S; with no earlier block their
    padding steps read one)."""
    m = math.lcm(block_sizes.q_tile, block_sizes.kv_block, block_size)
    return -(-(max(s, block_size) + ALIGN) // m) * m


class Layout(NamedTuple):
    """How the kernels see q, K, V and dO: head-major copies [B*H, S_pad, D], or (TPU, every
    head whole lanes, S a multiple of the block) the arrays where they lie, [B, S, H*D]: a
    reshape, no copy; a head is then a block of D lanes."""

    heads: tuple[int, int] | None  # (Hq, Hkv) when natural
    k: jax.Array  # [B*Hkv, S_pad, D] or [B, S, Hkv*D]
    v: jax.Array

    @property
    def natural(self) -> bool:
        return self.heads is not None

    @property
    def seq(self) -> int:
        return self.k.shape[1]

    @property
    def kv_heads(self) -> dict:
        """The whole-block kernels' argument for natural K/V."""
        return {"kv_heads": self.heads[1]} if self.natural else {}

    def to(self, x):
        """[B, S, H, D] -> the kernels' layout."""
        b, s, h, d = x.shape
        return x.reshape(b, s, h * d) if self.natural else _heads(x, self.seq)

    def back(self, x, b, s, h):
        """The kernels' layout -> [B, S, H, D]."""
        return x.reshape(b, s, h, -1) if self.natural else _unheads(x, b, s)

    def chunk(self, x, start, size, b, h):
        """Positions [start, start + size) of an array in the kernels' layout -> [B, size, H, D]."""
        return self.back(jax.lax.dynamic_slice_in_dim(x, start, size, axis=1), b, size, h)


def reads_in_place(backend: str, seq: int, head_dim: int, v_head_dim: int, block_size: int) -> bool:
    """Whether the kernels take q, K, V, dO as they lie ([B, S, H*D]) rather than head-major
    copies: on TPU, when a head is whole 128-lane tiles and S a multiple of the block and of
    ALIGN, long enough for a selected block's window (tpu_blocks.window_starts)."""
    return (
        backend == "tpu"
        and head_dim % 128 == 0
        and v_head_dim % 128 == 0
        and seq % block_size == 0
        and seq % ALIGN == 0
        and seq >= block_size + ALIGN
    )


def layout(q, k, v, call: KernelCall):
    """Flat query rows [B*S*Hq, D] (the selected blocks' tiles gather them) and the layout."""
    b, s, hq, d = q.shape
    return q.reshape(b * s * hq, d), kv_layout(k, v, call, q_heads=hq)


def kv_layout(k, v, call: KernelCall, *, q_heads: int) -> Layout:
    """The kernels' view of K [B, S, Hkv, D] and V for `q_heads` query heads, S the keys' length
    (a context shard's queries see every shard's keys)."""
    b, s, hkv, d = k.shape
    natural = reads_in_place(call.backend, s, d, v.shape[-1], call.block_size)
    if natural:
        return Layout((q_heads, hkv), k.reshape(b, s, -1), v.reshape(b, s, -1))
    seq_pad = padded_length(s, call.block_size, call.block_sizes)
    return Layout(None, _heads(k, seq_pad), _heads(v, seq_pad))


def past_schedule(past_start, *, hkv: int, call: KernelCall, key_len: int | None = None):
    """The selected blocks' schedule (schedule.past_tiles), or None when top_k = 1; `key_len`:
    the keys' length when it is not the queries' (a context shard)."""
    if not past_start.shape[-1]:
        return None
    return past_tiles(
        past_start,
        num_kv_heads=hkv,
        block_size=call.block_size,
        q_tile=call.block_sizes.past_q_tile,
        key_len=key_len,
    )


def gather_rows(x_flat, rows):
    return x_flat[jnp.maximum(rows, 0)]


def _own_tpu_fwd(tpu_own, q, lay: Layout, own_start, *, block_size, scale, interpret, block_sizes):
    """The own part by the chunk-diagonal TPU kernel (tpu_own.py, the module `tpu_own`): (o
    float32 in the kernels' layout, lse [B, S, Hq])."""
    b, s, _, _ = q.shape
    tables = tpu_own.own_tables(own_start, block_size=block_size, seq_pad=lay.seq)
    o, lse = tpu_own.own_attention_fwd(
        lay.to(q),
        lay.k,
        lay.v,
        *tables,
        scale=scale,
        block_size=block_size,
        key_tile=block_sizes.key_tile,
        heads=lay.heads,
        interpret=interpret,
    )
    return o, _unheads(lse[:, 0], b, s)


def _own_gpu_fwd(gpu_own, q, lay: Layout, own_start, *, block_size, scale, interpret, block_sizes):
    """The own part by the GPU kernel (gpu_own.py or mgpu_own.py, the module `gpu_own`):
    (o float32 [B*Hq, S_pad, Dv], lse [B, S, Hq])."""
    b, s = own_start.shape
    lo, first, _ = gpu_own.own_tables(
        own_start, seq_pad=lay.seq, q_tile=block_sizes.q_tile, kv_block=block_sizes.kv_block
    )
    o, lse = gpu_own.own_attention_fwd(
        lay.to(q),
        lay.k,
        lay.v,
        lo,
        first,
        scale=scale,
        block_size=block_size,
        block_sizes=block_sizes,
        interpret=interpret,
    )
    return o, _unheads(lse[..., 0], b, s)


def _own_tpu_bwd(
    tpu_own, q, lay: Layout, own_start, d_out, lse, delta, *, block_size, scale, interpret, block_sizes
):
    """The own part's gradients by the chunk-diagonal TPU kernel (the module `tpu_own`), in the
    inputs' dtypes and the kernels' layout: dq, and dK/dV over S_pad keys (the selected blocks'
    kernel adds to them in place, one block's window at a time)."""
    b, s, hq, d = q.shape
    seq_pad, c = lay.seq, block_size
    lane_rows = lambda x, fill: jnp.pad(
        jnp.moveaxis(x, 2, 1).reshape(-1, 1, s), ((0, 0), (0, 0), (0, seq_pad - s)), constant_values=fill
    )  # [B, S, Hq] -> [B*Hq, 1, S_pad]
    dq, dk, dv = tpu_own.own_attention_bwd(
        lay.to(q),
        lay.k,
        lay.v,
        *tpu_own.own_tables(own_start, block_size=c, seq_pad=seq_pad),
        lay.to(d_out.astype(lay.v.dtype)),
        lane_rows(lse, jnp.inf),
        lane_rows(delta.reshape(b, s, hq), 0.0),
        scale=scale,
        block_size=c,
        key_tile=block_sizes.key_tile,
        heads=lay.heads,
        interpret=interpret,
    )
    keys = lambda x: jnp.pad(x, ((0, 0), (0, seq_pad - x.shape[1]), (0, 0)))  # n*C -> S_pad: windows fit
    return dq, keys(dk), keys(dv)


def _own_gpu_bwd(
    gpu_own, q, lay: Layout, own_start, d_out, lse, delta, *, block_size, scale, interpret, block_sizes
):
    """The own part's gradients by the GPU kernels (the module `gpu_own`): dq head-major
    [B*Hq, S_pad, D], dK/dV [B, S, Hkv, D]. Padding rows have dO = 0 and delta = 0, so they
    contribute nothing."""
    b, s, hq, _ = q.shape
    seq_pad = lay.seq
    tables = gpu_own.own_tables(
        own_start, seq_pad=seq_pad, q_tile=block_sizes.q_tile, kv_block=block_sizes.kv_block
    )
    dq_h, dk_o, dv_o = gpu_own.own_attention_bwd(
        lay.to(q),
        lay.k,
        lay.v,
        *tables,
        lay.to(d_out.astype(lay.v.dtype)),
        _heads(lse[..., None], seq_pad),
        _heads(delta.reshape(b, s, hq, 1), seq_pad),
        scale=scale,
        block_size=block_size,
        block_sizes=block_sizes,
        interpret=interpret,
    )
    return dq_h, _unheads(dk_o, b, s), _unheads(dv_o, b, s)


MERGE_ROWS = 1 << 17  # (position, query head) rows per step of the parts' merge (_by_positions) ...
MERGE_WHOLE_ROWS = 1 << 19  # ... when it has more rows than this


def _slots(past, start, size, shape):
    """For positions [start, start + size): per selection slot, the tile row of each query's
    selection and whether the slot is used, [B, size, Hq] each (shape: [B, S, Hq])."""
    cut = lambda x: jax.lax.dynamic_slice_in_dim(x.reshape(shape), start, size, axis=1)
    return [(cut(row), cut(valid)) for row, valid in zip(past.pair_row, past.valid, strict=True)]


def _by_positions(step, s: int, rows_per_position: int):
    """step(start, size) -> a tuple of [B, size, ...] arrays, run over positions [0, s) about
    MERGE_ROWS rows at a time. XLA on TPU materialises each slot's gather of the tile rows
    rather than fusing it into the merge (float32, 1 GiB per slot at 128K with 16 heads), so
    the merge gathers a chunk at a time. The last chunk ends at s, overlapping the one before
    it (both write the same values). Up to MERGE_WHOLE_ROWS rows it is one step: v5e compiles
    needed more memory with the loop there (BENCHMARKS.md, "History")."""
    size = min(s, max(1, MERGE_ROWS // rows_per_position))
    if s * rows_per_position <= MERGE_WHOLE_ROWS:
        return step(0, s)
    parts = jax.eval_shape(lambda: step(0, size))

    def body(i, acc):
        start = jnp.minimum(i * size, s - size)
        return tuple(
            jax.lax.dynamic_update_slice_in_dim(a, x, start, axis=1)
            for a, x in zip(acc, step(start, size), strict=True)
        )

    init = tuple(jnp.zeros((x.shape[0], s, *x.shape[2:]), x.dtype) for x in parts)
    return jax.lax.fori_loop(0, -(-s // size), body, init)


def _group_of_keys(past, own_start, num_kv_heads):
    """For each key [B, S, Hkv]: the (batch, KV head, block) group of the block holding it, or
    -1 when no query selected that block. A key's block starts at its own_start."""
    b, s = own_start.shape
    num_groups = past.group_tiles.shape[0]
    used_row = jnp.where(past.group_tiles > 0, past.group_kv_row, b * num_kv_heads)  # unused: dropped
    table = jnp.full((b * num_kv_heads, s), -1, jnp.int32)
    table = table.at[used_row, past.group_start].set(jnp.arange(num_groups, dtype=jnp.int32), mode="drop")
    rows = jnp.arange(b)[:, None, None] * num_kv_heads + jnp.arange(num_kv_heads)[None, None]  # [B, 1, Hkv]
    return table.reshape(-1)[rows * s + own_start[..., None]]  # flat indices: no [N, 2] index array


def _key_grads(own_grad, group_grad, group, window_start):
    """A key's gradient: its own-part gradient own_grad [B, S, Hkv, D] plus, where its block
    was selected, its row of the group's window group_grad [G + 1, W, D]."""
    pos = jnp.arange(own_grad.shape[1], dtype=jnp.int32)[None, :, None]
    g = jnp.maximum(group, 0)
    row = g * group_grad.shape[1] + pos - window_start[g]  # flat: an [N, 2] index pads to 128 lanes on TPU
    past = jnp.where((group >= 0)[..., None], group_grad.reshape(-1, group_grad.shape[-1])[row], 0.0)
    return own_grad.astype(jnp.float32) + past


BWD_SLICE_ROWS = 1 << 21  # tile rows per call of the selected blocks' TPU backward (_tpu_past_bwd)


def tpu_past_slices(kernel: str, ntiles: int, qt: int) -> list[slice]:
    """The schedule's tiles [0, ntiles) in calls of the selected blocks' TPU `kernel`
    ("moba_block_fwd" | "moba_block_bwd"), each call's scalar-prefetched tables under
    tpu_smem.SMEM_BUDGET_BYTES and, for the backward, its rows under BWD_SLICE_ROWS."""
    most = tpu_smem.tiles_per_call(kernel, ntiles)
    if kernel == "moba_block_bwd":
        most = min(most, max(1, BWD_SLICE_ROWS // qt))
    return tpu_smem.tile_slices(ntiles, most)


def _tile_rows(qf, do_f, lse_f, delta, rows):
    """q, dO, lse and delta [B*S*Hq, ...] gathered into tiles of `rows` (padding rows, -1: dO
    and delta 0, lse +inf, so they contribute nothing)."""
    real = rows >= 0
    return (
        gather_rows(qf, rows),
        jnp.where(real[..., None], gather_rows(do_f, rows), 0),
        jnp.where(real, gather_rows(lse_f, rows), jnp.inf),
        jnp.where(real, gather_rows(delta, rows), 0.0),
    )


def _tpu_past_bwd(kern, flat, lay, past, dk, dv, **kw):
    """The selected blocks' TPU backward over the schedule's tiles, at most BWD_SLICE_ROWS rows
    and SMEM_BUDGET_BYTES of tables a call (tpu_past_slices): each call gathers only its tiles'
    rows of `flat` (q, dO, lse, delta; q and dO are 1.25 GiB each for the whole schedule at 128K,
    16 heads), writes its dq tiles into one [T, Qt, D] buffer and adds its dK/dV into the own
    part's, both in place (aliased). A group cut by a slice is added in two parts, so its dK/dV
    is rounded twice. Returns (dq tiles, dK, dV)."""
    t = past.tiles
    ntiles, qt = t.rows.shape
    dq_t = None
    for cut in tpu_past_slices("moba_block_bwd", ntiles, qt):
        lo = cut.start
        q_r, do_r, lse_r, delta_r = _tile_rows(*flat, t.rows[cut])
        dq_t, dk, dv = kern.block_attention_bwd(
            q_r,
            lay.k,
            lay.v,
            t.kv_row[cut],
            t.key_start[cut],
            past.tile_group[cut],
            past.group_first[cut].at[0].set(1),  # a group cut by the slice starts again at zero
            do_r,
            lse_r,
            delta_r,
            dk,
            dv,
            dq_into=dq_t,
            first_tile=lo,
            num_tiles=ntiles,
            **kw,
        )
    return dq_t, dk, dv


def _gpu_past_bwd(kern, flat, lay, past, dk, dv, key_starts, **kw):
    """The selected blocks' GPU backward: dq tiles, and each group's dK/dV window added to the
    own part's dK/dV [B, S, Hkv, D] in one gathering pass (`key_starts` [B, S]: the first
    position of each key's block, which finds the key's group)."""
    t = past.tiles
    q_r, do_r, lse_r, delta_r = _tile_rows(*flat, t.rows)
    dq_t, dk_g, dv_g = kern.block_attention_bwd(
        q_r,
        lay.k,
        lay.v,
        t.kv_row,
        t.key_start,
        past.tile_group,
        past.group_first,
        do_r,
        lse_r,
        delta_r,
        **kw,
    )
    group = _group_of_keys(past, key_starts, dk.shape[2])
    window_start = kern.window_starts(past.group_start, kw["block_size"], lay.seq, lay.k.dtype)
    return dq_t, _key_grads(dk, dk_g, group, window_start), _key_grads(dv, dv_g, group, window_start)


def own_forward(call: KernelCall, q, lay: Layout, own_start):
    """The own block's part: (o float32 in the kernels' layout, lse [B, S, Hq])."""
    own = _own_tpu_fwd if call.backend == "tpu" else _own_gpu_fwd
    return own(call.kernels.own, q, lay, own_start, **call.kernel_args)


def own_backward(call: KernelCall, q, lay: Layout, own_start, d_out, lse, delta):
    """The own block's gradients: dq in the kernels' layout; dK/dV in the kernels' layout on TPU
    (the selected blocks' kernel adds into them in place), [B, S, Hkv, D] on GPU."""
    own = _own_tpu_bwd if call.backend == "tpu" else _own_gpu_bwd
    return own(call.kernels.own, q, lay, own_start, d_out, lse, delta, **call.kernel_args)


def past_forward(call: KernelCall, q_flat, lay: Layout, past):
    """The selected blocks' parts: (o_rows [T*Qt, Dv] float32, lse_rows [T*Qt]), one row per
    schedule tile row (q_flat [N, D]: the query rows the tiles gather)."""
    t = past.tiles
    kw = dict(call.kernel_args, num_groups=past.group_tiles.shape[0], **lay.kv_heads)
    kern = call.kernels.blocks
    if call.backend == "tpu":
        o, lse = _tpu_past_fwd(kern, q_flat, lay, past, **kw)
    else:
        o, lse = kern.block_attention_fwd(
            gather_rows(q_flat, t.rows), lay.k, lay.v, t.kv_row, t.key_start, past.tile_group, **kw
        )
    return o.reshape(-1, o.shape[-1]), lse.reshape(-1)


def _tpu_past_fwd(kern, q_flat, lay, past, **kw):
    """The selected blocks' TPU forward in slices of the schedule whose scalar-prefetched
    tables each fit the SMEM budget (tpu_past_slices; one call up to 26,214 tiles, 6.7M rows at
    the default tiles), every call writing its tiles of o and lse in place (aliased)."""
    t = past.tiles
    ntiles, qt = t.rows.shape
    out = None
    for cut in tpu_past_slices("moba_block_fwd", ntiles, qt):
        out = kern.block_attention_fwd(
            gather_rows(q_flat, t.rows[cut]),
            lay.k,
            lay.v,
            t.kv_row[cut],
            t.key_start[cut],
            past.tile_group[cut],
            into=out,
            first_tile=cut.start,
            num_tiles=ntiles,
            **kw,
        )
    return out


def past_backward(call: KernelCall, flat, lay: Layout, past, dk, dv, key_starts):
    """The selected blocks' gradients: (dq tiles [T, Qt, D], dK, dV with the blocks' added to
    the own part's dk, dv: in the kernels' layout on TPU, [B, S, Hkv, D] on GPU). flat: q, dO,
    lse, delta per query row; key_starts [B, S]: each key's block start (GPU)."""
    kern = call.kernels.blocks
    kw = dict(call.kernel_args, num_groups=past.group_tiles.shape[0], **lay.kv_heads)
    if call.backend == "tpu":
        return _tpu_past_bwd(kern, flat, lay, past, dk, dv, **kw)
    return _gpu_past_bwd(kern, flat, lay, past, dk, dv, key_starts, **kw)


def merge(own, past, o_rows, l_rows, shape: tuple[int, int, int], dtype):
    """Each query's parts merged by log-sum-exp -> (out [B, S, Hq, Dv] in `dtype`, lse [B, S, Hq]).
    own(start, size): the own part of positions [start, start + size), (o [B, size, Hq, Dv], lse
    [B, size, Hq]); o_rows, l_rows: past_forward's rows; shape: (B, S, Hq)."""
    b, s, hq = shape

    def step(start, size):
        o_part, l_part = own(start, size)
        l_parts, o_parts = [l_part], [o_part]
        for row, valid in _slots(past, start, size, shape):
            l_parts.append(jnp.where(valid, l_rows[row], -jnp.inf))
            o_parts.append(jnp.where(valid[..., None], o_rows[row], 0.0))
        lse = jax.nn.logsumexp(jnp.stack(l_parts), axis=0)  # every query sees itself: finite
        out = sum(jnp.exp(l - lse)[..., None] * o for l, o in zip(l_parts, o_parts, strict=True))
        return out.astype(dtype), lse

    return _by_positions(step, s, b * hq)


def combine_dq(own_dq, past, dq_rows, shape: tuple[int, int, int], dtype):
    """dq [B, S, Hq, D] in `dtype`: own_dq(start, size), the own part's dq of positions [start,
    start + size), plus each selection's tile row of dq_rows [T*Qt, D]; shape: (B, S, Hq)."""
    b, s, hq = shape

    def step(start, size):
        dq = own_dq(start, size).astype(jnp.float32)
        for row, valid in _slots(past, start, size, shape):
            dq = dq + jnp.where(valid[..., None], dq_rows[row], 0.0)
        return (dq.astype(dtype),)

    return _by_positions(step, s, b * hq)[0]
