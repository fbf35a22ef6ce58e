"""Context parallelism for dense causal attention: one sequence split over the `context` mesh
axis (docs/context_parallel.md).

The sequence is laid out in the causally balanced order of `balanced_order`: with N shards it is
cut into 2N chunks and shard i holds chunks i and 2N-1-i, so every shard has the same share of
the causal attention work. Positions and segment ids travel with the tokens, so the mask is
built from them and nothing needs undoing. Inside a `shard_map` over the axis, K/V (with their
positions and segment ids) are all-gathered and the local queries attend to every key with the
mask of their true positions; the backward of the all-gather is a reduce-scatter of dK/dV.
"""

from __future__ import annotations

import math

import jax
import numpy as np
from jax.sharding import Mesh, PartitionSpec

from effattn_jax.ops.dense import masked_attention


def context_split_error(seq_len: int, shards: int, block_size: int | None = None) -> str | None:
    """Why `seq_len` cannot be laid out over `shards` context shards (2N equal chunks, each a
    whole number of MoBA blocks when `block_size` is given); None when it can."""
    if seq_len % (2 * shards):
        return f"must split into 2 x {shards} equal chunks (a multiple of {2 * shards})"
    chunk = seq_len // (2 * shards)
    if block_size and chunk % block_size:
        return (
            f"its {2 * shards} chunks of {chunk} tokens "
            f"must each be a multiple of moba.block_size={block_size}"
        )
    return None


def balanced_order(seq_len: int, shards: int) -> np.ndarray:
    """[seq_len] the original positions in the order the sequence is laid out, shard by shard:
    shard i holds chunks i and 2N-1-i of 2N. `x[:, order]` lays a batch out; `order` itself is
    the tokens' positions."""
    if why := context_split_error(seq_len, shards):
        raise ValueError(f"seq_len={seq_len} over {shards} context shards: {why}")
    chunks = np.arange(seq_len).reshape(2 * shards, -1)
    return np.concatenate([np.concatenate([chunks[i], chunks[2 * shards - 1 - i]]) for i in range(shards)])


def context_dense_attention(
    q, k, v, positions, segment_ids, *, mesh: Mesh, axis: str = "context", batch_axis=None, scale=None
):
    """q [B, S, Hq, D], k [B, S, Hkv, D], v [B, S, Hkv, Dv], positions / segment_ids [B, S] int, all
    in the balanced order with S sharded over `axis` (B over `batch_axis`) -> [B, S, Hq, Dv], the
    dense causal attention of every query over the earlier keys of its document."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale

    def local(q, k, v, pos, seg):  # this shard's queries; every shard's keys
        gather = lambda x: jax.lax.all_gather(x, axis, axis=1, tiled=True)
        k_all, v_all, pos_all, seg_all = gather(k), gather(v), gather(pos), gather(seg)
        causal = pos_all[:, None, None, :] <= pos[:, None, :, None]
        same = seg_all[:, None, None, :] == seg[:, None, :, None]
        return masked_attention(q, k_all, v_all, causal & same, scale)

    rows, tokens = PartitionSpec(batch_axis, axis, None, None), PartitionSpec(batch_axis, axis)
    return jax.shard_map(
        local, mesh=mesh, in_specs=(rows, rows, rows, tokens, tokens), out_specs=rows, check_vma=False
    )(q, k, v, positions, segment_ids)
