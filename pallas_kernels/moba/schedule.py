"""The MoBA schedule that the XLA path and the kernels (TPU, GPU) share: tile sizes and the
schedule of the selected earlier blocks (docs/moba.md).

Past tiles (KV-block-centric, megablox style): the (query, head, selected earlier block)
pairs sorted by (batch, KV head, block); each group's rows, from any query head of the KV
head (GQA), are cut into tiles of consecutive pairs, so work is proportional to the pairs,
whatever the routing, and a group's tiles are consecutive (the kernels keep its K/V and its
dK/dV accumulator across them). A row sees the whole block: [start, start + block_size - 1].
Earlier blocks are full and disjoint, so a row holds at most S // block_size of them and the
number of past tiles has a static bound. Nothing here is dense in S x S.

The own block (each query sees [own_start, t]) needs no schedule: its kernels walk
contiguous rows (tpu_own.own_tables, gpu_own.own_tables).
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from pallas_kernels import gpu_memory
from pallas_kernels.common import TRITON_STAGES, TRITON_WARPS

BACKENDS = ("tpu", "gpu")
SCHEDULE_NAME = "moba_schedule"  # jax.checkpoint_name of the routing tables and schedule (ints)


TPU_TILES = {"q_tile": 128, "kv_block": 128, "past_q_tile": 256, "key_tile": 512}  # also the XLA path's
# GPU tile sets (q_tile, kv_block, past_q_tile), best first: the first is the fastest of 7 sets measured on an
# H200 at 128K (head dim 128, bf16; BENCHMARKS.md); `auto` takes the first whose estimated shared
# memory fits the device (pallas_kernels/gpu_memory.py), so larger heads, float32 and smaller GPUs
# step down the list.
GPU_TILES = ((64, 64, 64), (64, 32, 64), (32, 32, 32), (16, 16, 16))
TILE_KEYS = ("q_tile", "kv_block", "past_q_tile")


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Kernel tile sizes, independent of the MoBA block size (e.g. MoBA block 512 with
    64-row query tiles and 64-key sub-blocks); None is `auto`, chosen by `resolve` for the
    backend, head dim, dtype and device.

    past_q_tile: query rows per step of the whole-block kernels (the selected earlier blocks,
    both backends; also the XLA path's selected-block tiles). The GPU's own-block kernel also
    uses q_tile (query rows per program) and kv_block (keys per step, also the GPU whole-block
    kernels' step); the TPU's own-block kernel works in chunks of the MoBA block, each walked
    in square tiles of at most key_tile rows and keys (tpu_own.own_tile). num_warps and
    num_stages: Triton's, for the GPU kernels. Construction checks what every path needs;
    `check_backend` adds what one backend's compiler needs on real hardware (interpret mode
    needs none of it, except the GPU's whole kv_block steps)."""

    q_tile: int | None = None
    kv_block: int | None = None
    past_q_tile: int | None = None
    key_tile: int | None = None
    num_warps: int | None = None
    num_stages: int | None = None

    def __post_init__(self):
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value <= 0):
                key = f"BlockSizes.{field.name} (moba.{field.name})"
                raise ValueError(f"{key} must be a positive int or auto, got {value!r}")
        if self.kv_block is not None and self.kv_block % 8:
            raise ValueError(
                f"BlockSizes.kv_block (moba.kv_block) must be a multiple of 8, got {self.kv_block}"
            )

    @property
    def resolved(self) -> bool:
        return all(getattr(self, f.name) is not None for f in dataclasses.fields(self))

    def resolve(
        self,
        backend: str,
        *,
        head_dim: int | None = None,
        v_head_dim: int | None = None,
        itemsize: int = 2,
        block_size: int | None = None,
        smem_limit: int | None = None,
    ) -> BlockSizes:
        """Every `auto` field filled in for `backend` ("tpu", "gpu", or "xla" for the XLA path),
        the fields set explicitly kept. TPU and XLA: TPU_TILES. GPU: the first of GPU_TILES whose
        kernels' shared memory fits `smem_limit` (default: an H100/H200's) at this head dim and
        dtype (`itemsize`), with kv_block no larger than a divisor of `block_size`; Triton's
        num_warps 4 and num_stages 2."""
        fixed = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        fixed = {k: v for k, v in fixed.items() if v is not None}
        auto = dict(TPU_TILES, num_warps=TRITON_WARPS, num_stages=TRITON_STAGES)
        if backend != "gpu":
            return dataclasses.replace(self, **(auto | fixed))
        candidates = []
        for q_tile, kv_block, past_q_tile in GPU_TILES:
            kv_block = kv_block if block_size is None else math.gcd(kv_block, block_size)
            tiles = dict(zip(TILE_KEYS, (q_tile, kv_block, past_q_tile), strict=True))
            candidates.append(dataclasses.replace(self, **(auto | tiles | fixed)))
        if head_dim is None:
            return candidates[0]
        limit = smem_limit or gpu_memory.smem_limit()
        fit = (c for c in candidates if c.gpu_smem(head_dim, v_head_dim or head_dim, itemsize)[1] <= limit)
        return next(fit, candidates[-1])  # none fits: check_backend says so

    def warps(self, rows: int, width: int) -> int:
        """Triton warps of a GPU kernel that holds a [rows, width] float32 accumulator across its loop
        (width: the value head dim (forward), the head dim (dq), both (dK/dV)): `num_warps` up to 64 x
        128, scaled with the accumulator beyond (at most 16), so a thread's share of the registers
        stays the same. At 4 warps, dK/dV at head dim 128, a 128-row tile or a head dim of 256 spill
        on sm_90a and sm_80 (`make gpu-compile`, BENCHMARKS.md)."""
        return min(16, max(self.num_warps, self.num_warps * rows * width // (64 * 128)))

    def gpu_smem(self, head_dim: int, v_head_dim: int, itemsize: int) -> tuple[str, int]:
        """(kernel, bytes): the GPU kernel asking for the most shared memory per block, estimated
        (pallas_kernels/gpu_memory.py), for resolved sizes."""
        sizes = gpu_memory.moba_smem(
            self.q_tile, self.past_q_tile, self.kv_block, self.num_stages, head_dim, v_head_dim, itemsize
        )
        return max(sizes.items(), key=lambda item: item[1])

    def tiles_text(self) -> str:
        return " ".join(f"moba.{k}={getattr(self, k)}" for k in TILE_KEYS)

    def check_backend(
        self,
        backend: str,
        block_size: int | None = None,
        *,
        compiler: bool = True,
        head_dim: int | None = None,
        v_head_dim: int | None = None,
        itemsize: int = 2,
        smem_limit: int | None = None,
        device: str = "this GPU",
    ) -> None:
        """Raises ValueError naming the field when `backend`'s compiler would reject it or, with
        compiler=False (interpret mode), only where the kernels' results would be wrong.

        tpu (Mosaic): the own-block kernel's lse rows are blocks of `block_size` lanes, so the
        MoBA block must be a multiple of 128 (an AOT compile with libtpu rejects others); the
        whole-block kernels' row blocks span their array's whole dims, so any past_q_tile
        compiles. gpu (Triton): every array must have power-of-two dims (the Pallas lowering
        rejects 24), and tl.dot needs dims >= 16 (Triton's own check, at compile time on the
        GPU); the whole-block kernel walks a block in kv_block steps, so a block that is not
        a multiple of kv_block gives wrong results (NaN at block 4 with kv_block 8), interpreted
        too. With `head_dim` and `smem_limit` (bytes per block of `device`), a set whose
        estimated shared memory is over the limit is refused in one line naming the keys and a
        set that fits (Triton would fail only when the kernel first runs)."""
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        if not self.resolved:
            shape = dict(head_dim=head_dim, v_head_dim=v_head_dim, itemsize=itemsize)
            resolved = self.resolve(backend, block_size=block_size, smem_limit=smem_limit, **shape)
            return resolved.check_backend(
                backend, block_size, compiler=compiler, smem_limit=smem_limit, device=device, **shape
            )
        if backend == "gpu" and block_size is not None and block_size % self.kv_block:
            raise ValueError(
                f"moba.block_size {block_size} must be a multiple of moba.kv_block {self.kv_block} on GPU"
            )
        if not compiler:
            return
        if backend == "tpu" and block_size is not None and block_size % 128:
            raise ValueError(
                f"moba.block_size must be a multiple of 128 for the TPU kernels, got {block_size}"
            )
        if backend != "gpu":
            return
        for name in TILE_KEYS:
            value = getattr(self, name)
            if value < 16 or value & (value - 1):
                raise ValueError(
                    f"BlockSizes.{name} (moba.{name}) must be a power of two >= 16 on GPU, got {value}"
                )
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"moba.num_warps must be 1, 2, 4, 8 or 16 on GPU (Triton), got {self.num_warps}")
        if head_dim is None or smem_limit is None:
            return
        v_head_dim = v_head_dim or head_dim
        kernel, need = self.gpu_smem(head_dim, v_head_dim, itemsize)
        if need <= smem_limit:
            return
        fits = BlockSizes(num_warps=self.num_warps, num_stages=self.num_stages).resolve(
            "gpu",
            head_dim=head_dim,
            v_head_dim=v_head_dim,
            itemsize=itemsize,
            block_size=block_size,
            smem_limit=smem_limit,
        )
        raise ValueError(
            f"{self.tiles_text()} (num_stages {self.num_stages}) need about {need:,} bytes of shared "
            f"memory per block in {kernel} (head dim {head_dim}, {itemsize}-byte elements), over the "
            f"{smem_limit:,} of {device}; a set that fits: {fits.tiles_text()} (or leave them auto)"
        )


def prefix_scan(x: jax.Array, op, identity, width: int = 128) -> jax.Array:
    """Inclusive prefix of a 1-D array under `op` (jnp.add, jnp.maximum) with its `identity`.

    Rows of `width` are scanned by log-step shifts, then the row totals the same way. Why not
    jnp.cumsum / lax.cummax: libtpu compiles those (a reduce_window) over a long array for
    minutes at a paper config's pair count, most of a MoBA dry run (BENCHMARKS.md)."""

    def shifts(y):  # Hillis-Steele along the last axis
        step, n = 1, y.shape[-1]
        while step < n:
            pad = [(0, 0)] * (y.ndim - 1) + [(step, 0)]
            y = op(y, jnp.pad(y, pad, constant_values=identity)[..., :n])
            step *= 2
        return y

    n = x.shape[0]
    rows = -(-n // width)
    y = shifts(jnp.pad(x, (0, rows * width - n), constant_values=identity).reshape(rows, width))
    before = jnp.pad(shifts(y[:, -1]), (1, 0), constant_values=identity)[:-1]  # total of earlier rows
    return op(y, before[:, None]).reshape(-1)[:n]


class Tiles(NamedTuple):
    """rows [T, Qt]: flat query index (b * S + t) * Hq + h of each tile row, -1 = padding.
    kv_row [T]: b * Hkv + kv head; key_start [T]: first key position the tile may see;
    lo, hi [T, Qt]: visible key interval of each row (empty for padding: lo > hi)."""

    rows: jax.Array
    kv_row: jax.Array
    key_start: jax.Array
    lo: jax.Array
    hi: jax.Array


class PastTiles(NamedTuple):
    tiles: Tiles
    pair_row: jax.Array  # [K', B*S*Hq] tile row (tile * Qt + slot) of each selection (clipped; see valid)
    valid: jax.Array  # [K', B*S*Hq] the selection slot is used
    tile_group: jax.Array  # [T] (batch, KV head, block) group of each tile; G = padding
    group_first: jax.Array  # [T] 1 where a tile is the first of its group (accumulators start)
    group_tiles: jax.Array  # [G] tiles of each group (0: an unused group slot)
    group_kv_row: jax.Array  # [G] b * Hkv + KV head of each group
    group_start: jax.Array  # [G] first key of each group's block


class _Pairs(NamedTuple):
    """The (i, b, t, h) selections, flat in that (slot-major) order, with their coordinates."""

    block_start: jax.Array  # [P] first key of the selected block, -1 = unused slot
    batch: jax.Array  # [P]
    query: jax.Array  # [P] position t
    head: jax.Array  # [P] query head


class _SortedPairs(NamedTuple):
    order: jax.Array  # [P] pair index at each sorted position
    key: jax.Array  # [P] (b * Hkv + KV head) * S + block start at each sorted position
    group: jax.Array  # [P] index of the (b, h, block) group at each sorted position
    rank: jax.Array  # [P] position inside its group
    real: jax.Array  # [P] the sorted position holds a real selection


def _flat_pairs(past_start: jax.Array) -> _Pairs:
    """Slot-major, so per-slot tables come out as [K', B*S*Hq] without a transpose (an
    [N, K'] int array pads K' to 128 lanes on TPU). Pair p is query row p % (B*S*Hq)."""
    b, s, hq, kp = past_start.shape
    n = b * s * hq
    idx = jnp.arange(kp * n, dtype=jnp.int32) % n
    return _Pairs(jnp.moveaxis(past_start, -1, 0).reshape(-1), idx // (s * hq), (idx // hq) % s, idx % hq)


def _sort_pairs_by_block(pairs: _Pairs, *, seq_len: int, num_q_heads: int, num_kv_heads: int) -> _SortedPairs:
    """Sorts the pairs by (batch, KV head, block), unused slots last, and numbers the groups
    of equal block and each pair's rank inside its group. Grouping by KV head puts the query
    heads that share a KV head (GQA) into the same tiles: one K/V fetch serves them all."""
    unused = jnp.iinfo(jnp.int32).max
    kv_head = pairs.head // (num_q_heads // num_kv_heads)
    key = (pairs.batch * num_kv_heads + kv_head) * seq_len + pairs.block_start
    key = jnp.where(pairs.block_start >= 0, key, unused)
    pos = jnp.arange(key.shape[0], dtype=jnp.int32)
    key, order = jax.lax.sort((key, pos), num_keys=1, is_stable=True)
    real = key != unused
    starts_group = real & jnp.concatenate([jnp.ones((1,), bool), key[1:] != key[:-1]])
    group = prefix_scan(starts_group.astype(jnp.int32), jnp.add, 0) - 1
    rank = pos - prefix_scan(jnp.where(starts_group, pos, 0), jnp.maximum, 0)
    return _SortedPairs(order, key, group, rank, real)


def num_past_tiles(num_pairs: int, *, groups: int, q_tile: int) -> int:
    """T, the schedule's static count of tiles: the pairs' tiles plus one per (batch, KV head,
    full block) group (each group's last tile may be partly empty)."""
    return -(-num_pairs // q_tile) + max(groups, 1)


def past_tiles(
    past_start: jax.Array, *, num_kv_heads: int, block_size: int, q_tile: int, key_len: int | None = None
) -> PastTiles:
    """Schedule for the selected earlier blocks. past_start [B, S, Hq, K'] (-1 = unused);
    `key_len`: the keys' length where it is not the queries' S (context parallelism: a shard's
    queries against the whole sequence's keys).

    Every group gets ceil(size / q_tile) consecutive tiles, its pairs in sorted order. The
    tables come from the one sort by scatters and by scans over the groups and tiles (no
    pair-to-tile table, inverse permutation or searchsorted): libtpu takes seconds to
    compile each pair-long gather or scatter."""
    b, s, hq, kp = past_start.shape
    keys = key_len or s
    pairs = _flat_pairs(past_start)
    num_pairs = pairs.block_start.shape[0]
    max_groups = max(b * num_kv_heads * (keys // block_size), 1)  # (batch, KV head, full block) groups
    num_tiles = num_past_tiles(num_pairs, groups=max_groups, q_tile=q_tile)
    sp = _sort_pairs_by_block(pairs, seq_len=keys, num_q_heads=hq, num_kv_heads=num_kv_heads)

    # Groups: sizes, tiles, first tile, and (KV row, block start) from the group's first pair.
    group_size = jax.ops.segment_sum(
        sp.real.astype(jnp.int32), jnp.where(sp.real, sp.group, max_groups), max_groups + 1
    )[:-1]
    group_tiles = -(-group_size // q_tile)
    used = group_tiles > 0
    first_tile = prefix_scan(group_tiles, jnp.add, 0) - group_tiles
    first_key = sp.key[jnp.minimum(prefix_scan(group_size, jnp.add, 0) - group_size, num_pairs - 1)]
    group_kv_row = jnp.where(used, first_key // keys, 0)
    group_start = jnp.where(used, first_key % keys, 0)

    # Each sorted pair's tile row; unused pairs go one past the last row (dropped, or clipped).
    dest = first_tile[jnp.clip(sp.group, 0, max_groups - 1)] * q_tile + sp.rank
    dest = jnp.where(sp.real, dest, num_tiles * q_tile)
    rows = jnp.full((num_tiles * q_tile,), -1, jnp.int32).at[dest].set(sp.order % (b * s * hq), mode="drop")
    rows = rows.reshape(num_tiles, q_tile)
    pair_row = jnp.zeros((num_pairs,), jnp.int32).at[sp.order].set(jnp.minimum(dest, num_tiles * q_tile - 1))

    # Tiles: their group (G on padding tiles), by marking each used group's first tile and
    # carrying it forward; padding tiles repeat the last real tile's block and KV row, so a
    # kernel's block index does not change on them (no copy).
    tile = jnp.arange(num_tiles, dtype=jnp.int32)
    marks = (
        jnp.zeros((num_tiles,), jnp.int32)
        .at[jnp.where(used, first_tile, num_tiles)]
        .set(jnp.arange(max_groups, dtype=jnp.int32), mode="drop")
    )
    total_tiles = jnp.sum(group_tiles)
    tile_group = prefix_scan(marks, jnp.maximum, 0)
    last_group = tile_group[jnp.maximum(total_tiles - 1, 0)]
    group_of_tile = jnp.where(tile < total_tiles, tile_group, last_group)
    tile_group = jnp.where(tile < total_tiles, tile_group, max_groups)
    start = group_start[group_of_tile]
    kv_row = group_kv_row[group_of_tile]
    real_slot = rows >= 0
    lo = jnp.where(real_slot, start[:, None], 1)
    hi = jnp.where(real_slot, start[:, None] + block_size - 1, 0)
    group_first = jnp.concatenate(
        [jnp.ones((1,), jnp.int32), (tile_group[1:] != tile_group[:-1]).astype(jnp.int32)]
    )
    return PastTiles(
        Tiles(rows, kv_row, start, lo, hi),
        pair_row.reshape(kp, -1),
        (pairs.block_start >= 0).reshape(kp, -1),
        tile_group,
        group_first,
        group_tiles,
        group_kv_row,
        group_start,
    )
