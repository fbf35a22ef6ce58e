"""The MoBA TPU kernels' scalar-prefetched tables against a TPU core's scalar memory (SMEM).

A Pallas TPU kernel's scalar-prefetch operands are copied into the core's SMEM for the whole
call: int32 tables of one entry per grid row of the schedule. The selected blocks' kernels
(tpu_blocks.py) take 5 tables of [T] (forward) or 6 (backward), T the schedule's tiles; the own
block's (tpu_own.py) take 2 of [B * n], n the chunks. T grows with the queries per chip: at 1M
tokens on 8 context shards (131,072 queries per chip, 14 heads, top_k 12, block 4,096) one
forward call over all 82,432 tiles needed 1.57 MiB, over the 1 MiB of a v5p core (libtpu: "Ran
out of memory in memory space smem"). So the selected blocks' calls run in slices of the
schedule (`tiles_per_call`, parts.tpu_past_slices) and the decode step's in slices of its rows
(`rows_per_call`, tpu_decode.py), each under SMEM_BUDGET_BYTES, whatever the length.
"""

from __future__ import annotations

# SMEM per TPU core by libtpu's device_kind (bytes): v5e, v5p, v6e, as libtpu (0.0.50.1) reports
# its capacity when a kernel's tables overflow it ("would exceed memory (size=1048576)"), compiling
# ahead of time for each.
SMEM_BYTES = {"TPU v5 lite": 1 << 20, "TPU v5": 1 << 20, "TPU v6 lite": 1 << 20}
# what one kernel call's tables may take: half the smallest core's, the rest left to Mosaic's own
# scalars and to the other operands a kernel keeps there
SMEM_BUDGET_BYTES = min(SMEM_BYTES.values()) // 2
TABLE_ITEMSIZE = 4  # int32

# scalar-prefetched tables per kernel, one entry per schedule tile, per (batch, chunk) or, in the
# decode step, per (row, query head, selected block); all flat: Mosaic pads an SMEM table's last
# dim to 128 words (a [64, 16, 3] int32 table took 512 KiB)
TABLES = {
    "moba_block_fwd": 5,
    "moba_block_bwd": 6,
    "moba_own_fwd": 2,
    "moba_own_bwd": 2,
    "moba_decode_tpu": 3,
}
KNOBS = "mesh.context (fewer queries per chip), moba.block_size"


def table_bytes(kernel: str, entries: int) -> int:
    """Bytes of SMEM a call of `kernel` (a TABLES name) holds for tables of `entries` each."""
    if kernel not in TABLES:
        raise ValueError(f"kernel must be one of {sorted(TABLES)}, got {kernel!r}")
    return TABLES[kernel] * entries * TABLE_ITEMSIZE


def tiles_per_call(kernel: str, ntiles: int, budget: int | None = None) -> int:
    """The most schedule tiles one call of `kernel` may take with its tables under `budget`
    (default SMEM_BUDGET_BYTES), at most `ntiles`."""
    budget = SMEM_BUDGET_BYTES if budget is None else budget
    most = budget // table_bytes(kernel, 1)
    if most < 1:
        raise ValueError(f"an SMEM budget of {budget} bytes holds no tile of {kernel}'s tables")
    return min(ntiles, most)


def rows_per_call(kernel: str, rows: int, entries_per_row: int, budget: int | None = None) -> int:
    """The most rows (of `entries_per_row` table entries each) one call of `kernel` may take with
    its flat tables under `budget` (default SMEM_BUDGET_BYTES), at most `rows`."""
    return max(1, tiles_per_call(kernel, rows * entries_per_row, budget) // entries_per_row)


def tile_slices(ntiles: int, most: int) -> list[slice]:
    """[0, ntiles) in as few calls as `most` tiles a call allows, the calls of equal size (the
    last one up to calls - 1 tiles shorter)."""
    calls = max(1, -(-ntiles // max(most, 1)))
    size = -(-ntiles // calls)
    return [slice(lo, min(lo + size, ntiles)) for lo in range(0, ntiles, size)]


def check_own(kernel: str, entries: int, budget: int | None = None) -> None:
    """The own block's tables (one entry per (batch, chunk), a few hundred bytes at 1M tokens)
    are not sliced: a call over the budget is refused in one line naming the knobs."""
    budget = SMEM_BUDGET_BYTES if budget is None else budget
    need = table_bytes(kernel, entries)
    if need > budget:
        raise ValueError(
            f"{kernel}: its scalar-prefetched tables need {need:,} bytes of SMEM ({entries:,} (batch, chunk) "
            f"rows per chip), over the {budget:,}-byte budget of a TPU core; raise {KNOBS}"
        )
