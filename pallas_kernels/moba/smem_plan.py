"""The MoBA TPU kernels' calls and scalar-prefetched tables for one layer on one chip, from the
schedule's static shapes alone (nothing traced or compiled): what the dry run prints without a
TPU slice and what the tests check at the 1M config's per-chip shapes (tpu_smem.py)."""

from __future__ import annotations

from typing import NamedTuple

from pallas_kernels.moba import parts, tpu_smem
from pallas_kernels.moba.schedule import num_past_tiles


class CallTables(NamedTuple):
    """One MoBA TPU kernel's calls in a layer's step on one chip: how many, and the largest
    call's scalar-prefetched bytes."""

    kernel: str
    calls: int
    table_bytes: int


def moba_call_tables(
    *,
    batch: int,
    queries: int,
    key_len: int,
    q_heads: int,
    kv_heads: int,
    block_size: int,
    top_k: int,
    past_q_tile: int,
    runs: int = 1,
) -> list[CallTables]:
    """Every MoBA TPU kernel call of one attention layer on one chip, forward and backward, from
    the schedule's static shapes (nothing traced or compiled): [batch, queries] queries per chip
    with q_heads and kv_heads heads, in `runs` runs of the sequence (a context shard holds 2,
    each its own-block window of one block more), against key_len keys."""
    blocks = -(-key_len // block_size)
    selections = min(top_k - 1, blocks - 1)  # routing's k'
    run = queries // runs
    window = run + block_size if runs > 1 else run  # a context run's window: one block of dummies first
    own_entries = batch * -(-window // block_size)
    out = [
        CallTables(kernel, runs, tpu_smem.table_bytes(kernel, own_entries))
        for kernel in ("moba_own_fwd", "moba_own_bwd")
    ]
    if selections < 1:
        return out
    pairs = batch * queries * q_heads * selections
    groups = batch * kv_heads * (key_len // block_size)
    ntiles = num_past_tiles(pairs, groups=groups, q_tile=past_q_tile)
    for kernel in ("moba_block_fwd", "moba_block_bwd"):
        cuts = parts.tpu_past_slices(kernel, ntiles, past_q_tile)
        out.append(
            CallTables(kernel, len(cuts), tpu_smem.table_bytes(kernel, max(c.stop - c.start for c in cuts)))
        )
    return out
