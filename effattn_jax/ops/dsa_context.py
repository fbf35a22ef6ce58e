"""DSA over a `context` mesh axis (docs/context_parallel.md, "DSA"): each shard's queries
select among, and attend to, the whole sequence's keys.

As for the other cores (ops/context_parallel.py) the sequence is in the causally balanced layout
and the keys are all-gathered inside a shard_map: here the indexer keys k_idx [B, S, Di] too (the
backward reduce-scatters their gradient), put back in sequence order beside K and V. The
selection then runs per shard at the queries' true positions (`dsa_select(q_index=...)`),
attention over the selected rows (`sparse_attention`) and the indexer's KL loss per local query.
Heads stay whole on a shard: the selection serves every head, and the KL's target is the mean of
all heads' probabilities.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from effattn_jax.ops.context_parallel import AXIS, query_positions, to_sequence_order
from effattn_jax.ops.dense import local_attention
from effattn_jax.ops.dsa import dsa_select, indexer_kl_loss, sparse_attention
from effattn_jax.sharding import Rules, context_mesh, logical_to_spec


def dsa_context_attention(
    q, k, v, q_idx, k_idx, weights, *, top_k, stage, segment_ids, scale, rules: Rules | None,
    kv_whole=False, query_chunk=None, sparse=None, impl="xla",
):  # fmt: skip
    """(out [B, S, H, Dv], the indexer's KL per query [B, S]) of DSA over the context axis; every
    input in the balanced layout (k and v whole on every shard with `kv_whole`, as MLA expands
    them). `stage` warmup: dense attention, the KL over every visible key; sparse: both over the
    top_k selection. `sparse(q, k, v, indices, *, scale)`: the attention over the selection
    (default `sparse_attention`, the XLA path); `impl`: the selection's (`dsa_select`: its kernel
    where its backend has one)."""
    if sparse is None:
        sparse = functools.partial(sparse_attention, query_chunk=query_chunk)
    mesh = context_mesh()
    n = dict(mesh.shape)[AXIS]
    batch = logical_to_spec(("batch",), q.shape[:1], mesh.shape, rules)[0] if rules is not None else None
    rows = lambda ndim: PartitionSpec(batch, AXIS, *[None] * (ndim - 2))
    keys = lambda ndim: PartitionSpec(batch, None if kv_whole else AXIS, *[None] * (ndim - 2))
    has_segments = segment_ids is not None
    if not has_segments:
        segment_ids = jnp.ones(q.shape[:2], jnp.int32)

    def body(q, k, v, q_idx, k_idx, weights, q_seg, k_seg):
        if not kv_whole:
            k, v = (jax.lax.all_gather(x, AXIS, axis=1, tiled=True) for x in (k, v))
        k_idx = jax.lax.all_gather(k_idx, AXIS, axis=1, tiled=True)
        k, v, k_idx, k_seg = (to_sequence_order(x, n) for x in (k, v, k_idx, k_seg))
        chunk = k.shape[1] // (2 * n)
        i = jax.lax.axis_index(AXIS)
        firsts = (i * chunk, (2 * n - 1 - i) * chunk)
        q_index = query_positions(firsts, chunk, q.shape[0])
        seg = k_seg if has_segments else None
        kl = functools.partial(
            indexer_kl_loss, q, k, q_idx, k_idx, weights, segment_ids=seg, scale=scale,
            q_index=q_index, query_chunk=query_chunk,
        )  # fmt: skip
        if stage == "warmup":
            out = local_attention(q, k, v, q_seg if has_segments else None, seg, firsts, scale=scale)
            return out, kl()
        indices = dsa_select(
            q_idx, k_idx, weights, top_k=top_k, segment_ids=seg, q_index=q_index, query_chunk=query_chunk,
            impl=impl,
        )  # fmt: skip
        return sparse(q, k, v, indices, scale=scale), kl(indices=indices)

    return jax.shard_map(
        body,
        mesh=mesh,
        in_specs=(rows(4), keys(4), keys(4), rows(4), rows(3), rows(3), rows(2), PartitionSpec(batch, None)),
        out_specs=(rows(4), rows(2)),
        check_vma=False,
    )(q, k, v, q_idx, k_idx, weights, segment_ids, segment_ids)
