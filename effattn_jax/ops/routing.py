"""The one MoBA gate (docs/moba.md, items 1-5), shared by every implementation so
they cannot drift apart: the XLA path, the Pallas kernels and decoding.

Blocks of `block_size` tokens are cut per document (segment), starting at the
document's first token. Query t attends causally to its own block and to the
top (top_k - 1) *earlier* blocks of its document, scored by <q_t, mean(K[block])>
with the unscaled post-RoPE query in float32; ties go to the earlier block.
Every query head routes on its own (GQA without copying K/V).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from effattn_jax.ops.segments import document_positions


class Routing(NamedTuple):
    """Where each query looks. Shapes: own_start [B, S]; past_start [B, S, Hq, k'] with
    k' = min(top_k - 1, blocks - 1), -1 marking an unused slot (fewer earlier blocks than k')."""

    own_start: jax.Array  # first position of the query's own block
    past_start: jax.Array  # first positions of its selected earlier (full) blocks


def moba_routing(
    q, k, *, block_size: int, top_k: int, segment_ids=None, query_positions=None, query_chunk: int = 512
) -> Routing:
    """The one MoBA gate. q [B, T, Hq, D], k [B, S, Hkv, D]; no gradient flows through it.

    Training: T = S and blocks follow `segment_ids`. Decoding: `query_positions`
    [B, T] gives the absolute position of each query in a single document whose
    keys (the cache) are k; blocks past a query are never candidates.
    Cost: T * blocks * D per head (the gate), computed in query chunks so memory
    stays at chunk * blocks * D; no [T, S] array.
    """
    q, k = jax.lax.stop_gradient(q), jax.lax.stop_gradient(k)
    b, t, hq, d = q.shape
    s, hkv = k.shape[1], k.shape[2]
    c = block_size
    n = -(-s // c)
    kk = min(top_k - 1, n - 1)
    if query_positions is None:
        pos = document_positions(segment_ids, b, s)
        doc_start = jnp.arange(s, dtype=jnp.int32)[None] - pos  # [B, S]
    else:
        pos = query_positions.astype(jnp.int32)
        doc_start = jnp.zeros_like(pos)
    own_block = pos // c  # index of the own block inside the document
    own_start = doc_start + own_block * c
    if kk <= 0:
        return Routing(own_start, jnp.zeros((b, t, hq, 0), jnp.int32))

    # Mean key of the full block starting at every position p: (K[p:p+c]).mean, in k's dtype.
    csum = jnp.cumsum(
        jnp.pad(k.astype(jnp.float32), ((0, 0), (1, 0), (0, 0), (0, 0))), axis=1
    )  # [B, S+1, Hkv, D]
    ends = jnp.minimum(jnp.arange(s) + c, s)
    kbar_at = ((csum[:, ends] - csum[:, :s]) / c).astype(k.dtype).astype(jnp.float32)  # [B, S, Hkv, D]

    qg = q.astype(jnp.float32).reshape(b, t, hkv, hq // hkv, d)
    j = jnp.arange(n, dtype=jnp.int32)
    pad = -t % query_chunk if t > query_chunk else 0
    chunk = min(query_chunk, t)

    def chunk_scores(args):
        qc, dsc = args  # [B, T', Hkv, G, D], [B, T']
        starts = jnp.clip(dsc[..., None] + j * c, 0, s - 1)  # [B, T', n]
        kb = jnp.take_along_axis(kbar_at[:, None], starts[..., None, None], axis=2)  # [B, T', n, Hkv, D]
        return jnp.einsum("btkgd,btnkd->btkgn", qc, kb)  # [B, T', Hkv, G, n]

    qp = jnp.pad(qg, ((0, 0), (0, pad), (0, 0), (0, 0), (0, 0))).reshape(b, -1, chunk, hkv, hq // hkv, d)
    dp = jnp.pad(doc_start, ((0, 0), (0, pad))).reshape(b, -1, chunk)
    scores = jax.lax.map(
        chunk_scores, (jnp.moveaxis(qp, 1, 0), jnp.moveaxis(dp, 1, 0))
    )  # [C#, B, T', Hkv, G, n]
    scores = jnp.moveaxis(scores, 0, 1).reshape(b, -1, hq, n)[:, :t]  # [B, T, Hq, n]

    candidate = (
        j[None, None, None, :] < own_block[:, :, None, None]
    )  # strictly earlier blocks of the document
    scores = jnp.where(candidate, scores, -jnp.inf)
    _, sel = jax.lax.top_k(scores, kk)  # ties -> lower (earlier) block first
    valid = sel < own_block[:, :, None, None]
    past_start = jnp.where(valid, doc_start[:, :, None, None] + sel * c, -1)
    return Routing(own_start, past_start.astype(jnp.int32))
