"""Context parallelism: one sequence split over the `context` mesh axis (docs/context_parallel.md).

The sequence is laid out in the causally balanced order of `balanced_order`: with N shards it is
cut into 2N chunks and shard i holds chunks i and 2N-1-i, so every shard has the same share of
the causal attention work. `balanced_batch` lays a batch out once, where it enters the step;
positions and segment ids travel with the tokens, so nothing needs undoing. Everything
position-wise then runs on its shard unchanged; attention runs through `context_attention`: in
a `shard_map` over the axis the keys and values are all-gathered (the backward reduce-scatters
dK/dV), put back in sequence order, and the local queries attend to them at their true
positions.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

from effattn_jax.config import context_split_error
from effattn_jax.ops.segments import segment_positions
from effattn_jax.sharding import Rules, batch_head_specs, context_mesh, logical_to_spec

AXIS = "context"


def balanced_order(seq_len: int, shards: int) -> np.ndarray:
    """[seq_len] the original positions in the order the sequence is laid out, shard by shard:
    shard i holds chunks i and 2N-1-i of 2N. `x[:, order]` lays a batch out; `order` itself is
    the tokens' positions."""
    if why := context_split_error(seq_len, shards):
        raise ValueError(f"seq_len={seq_len} over {shards} context shards: {why}")
    chunks = np.arange(seq_len).reshape(2 * shards, -1)
    return np.concatenate([np.concatenate([chunks[i], chunks[2 * shards - 1 - i]]) for i in range(shards)])


def context_shards() -> int:
    """The context axis's size under jax's current mesh (1 outside one or without the axis)."""
    mesh = context_mesh()
    return 1 if mesh is None else dict(mesh.shape).get(AXIS, 1)


def balanced_batch(batch: dict) -> dict:
    """A batch of [B, S] arrays in sequence order -> the same in the balanced order, with the
    tokens' in-document `positions` (RoPE) added, computed before the layout (a shard alone
    cannot). Identity (positions added) with one context shard."""
    out = dict(batch, positions=segment_positions(batch["segment_ids"]))
    n = context_shards()
    if n == 1:
        return out
    order = jnp.asarray(balanced_order(batch["segment_ids"].shape[1], n))
    return {name: jnp.take(x, order, axis=1) for name, x in out.items()}


def sequence_order(x: jax.Array) -> jax.Array:
    """[B, S, ...] in the balanced order (of the current context axis) -> in sequence order."""
    n = context_shards()
    return x if n == 1 else to_sequence_order(x, n)


def to_sequence_order(x, n: int):
    """The balanced layout's inverse as a reshape: shard i's two chunks are i and 2N-1-i."""
    b, s = x.shape[:2]
    x = x.reshape(b, n, 2, s // (2 * n), *x.shape[2:])
    return jnp.concatenate([x[:, :, 0], x[:, ::-1, 1]], axis=1).reshape(b, s, *x.shape[4:])


def shard_rows(a: jax.Array, rules: Rules | None) -> tuple[jax.Array, tuple[str, ...] | None]:
    """([B·N, S/N, ...], the rows' mesh axes) of [B, S, ...] split over a context axis of N
    shards: each shard's tokens a row of their own (a local reshape). A loop over sequence
    chunks of the result, pinned to those axes, reads only local tokens; over the unfolded array
    each chunk would be gathered from every shard. (a, None) with one shard or no mesh."""
    n = context_shards()
    if n == 1 or rules is None:
        return a, None
    batch = logical_to_spec(("batch",), a.shape[:1], context_mesh().shape, rules)[0]
    rows = (*(() if batch is None else (batch if isinstance(batch, tuple) else (batch,))), AXIS)
    out = a.reshape(a.shape[0] * n, a.shape[1] // n, *a.shape[2:])
    return jax.lax.with_sharding_constraint(out, PartitionSpec(rows, *[None] * (out.ndim - 1))), rows


LocalAttention = Callable  # (q, k, v, q_segments, k_segments, firsts) -> out


def context_attention(local: LocalAttention, q, k, v, segment_ids, rules: Rules | None, kv_whole=False):
    """Attention over the context axis. q [B, S, Hq, D], k [B, S, Hkv, D], v [B, S, Hkv, Dv] and
    segment_ids [B, S] (or None) in the balanced order -> [B, S, Hq, Dv].

    K and V are all-gathered inside the map, so the backward reduce-scatters dK/dV; `kv_whole`:
    they are already whole on every shard (MLA expands them from its gathered latent) and enter
    as they are (their gradient is then summed over the shards by an all-reduce).

    Per shard, `local(q, k, v, q_segments, k_segments, firsts)` gets its queries [B, 2C, Hq', D]
    (C = S / 2N: two runs of C positions starting at `firsts`, traced), every key and value in
    sequence order [B, S, Hkv', ...] and the segment ids of both (None without). Batch and
    heads split as the rules say (heads only where q and kv heads split alike)."""
    mesh = context_mesh()
    n = dict(mesh.shape)[AXIS]
    q_spec, kv_spec = batch_head_specs(q, k, rules, mesh)
    rows = PartitionSpec(q_spec[0], AXIS, q_spec[2], None)
    has_segments = segment_ids is not None
    if not has_segments:
        segment_ids = jnp.ones(q.shape[:2], jnp.int32)

    def body(q, k, v, q_seg, k_seg):
        if not kv_whole:  # the all-gather whose transpose is a reduce-scatter
            k, v = (jax.lax.all_gather(x, AXIS, axis=1, tiled=True) for x in (k, v))
        chunk = k.shape[1] // (2 * n)
        i = jax.lax.axis_index(AXIS)
        firsts = (i * chunk, (2 * n - 1 - i) * chunk)
        k, v, k_seg = (to_sequence_order(x, n) for x in (k, v, k_seg))
        if not has_segments:
            q_seg = k_seg = None
        return local(q, k, v, q_seg, k_seg, firsts)

    if not kv_whole:
        kv_spec = PartitionSpec(kv_spec[0], AXIS, *kv_spec[2:])
    return jax.shard_map(
        body,
        mesh=mesh,
        in_specs=(rows, kv_spec, kv_spec, PartitionSpec(q_spec[0], AXIS), PartitionSpec(q_spec[0], None)),
        out_specs=rows,
        check_vma=False,
    )(q, k, v, segment_ids, segment_ids)


def query_positions(firsts, run: int, batch: int) -> jax.Array:
    """[B, len(firsts) * run] the sequence positions of a shard's queries."""
    idx = jnp.concatenate([first + jnp.arange(run, dtype=jnp.int32) for first in firsts])
    return jnp.broadcast_to(idx, (batch, idx.shape[0]))
