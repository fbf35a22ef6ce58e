"""MoBA (Mixture of Block Attention): the op, its shared routing and the dense oracle.

Semantics follow PAPERS.md §1 exactly. Blocks of `block_size` tokens are cut
per document (segment), starting at the document's first token. Query t
attends causally to its own block and to the top (top_k - 1) *earlier* blocks
of its document, scored by <q_t, mean(K[block])> with the unscaled post-RoPE
query in float32; ties go to the earlier block. Every query head routes on
its own (GQA without copying K/V). `moba_routing` is the single routing
function used by every implementation, so they cannot drift apart.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from effattn_jax.layers import segment_positions
from effattn_jax.ops.dense import masked_attention
from effattn_jax.sharding import shard_over_batch_heads

IMPLS = ("auto", "reference", "xla", "pallas", "pallas_tpu", "pallas_gpu")


class Routing(NamedTuple):
    """Where each query looks. Shapes: own_start [B, S]; past_start [B, S, Hq, k'] with
    k' = min(top_k - 1, blocks - 1), -1 marking an unused slot (fewer earlier blocks than k')."""

    own_start: jax.Array  # first position of the query's own block
    past_start: jax.Array  # first positions of its selected earlier (full) blocks


def check_args(q, k, v, block_size, top_k, segment_ids, impl):
    if not (isinstance(block_size, int) and block_size > 0):
        raise ValueError(f"block_size must be a positive int, got {block_size!r}")
    if not (isinstance(top_k, int) and top_k >= 1):
        raise ValueError(f"top_k must be an int >= 1, got {top_k!r}")
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise ValueError(f"q, k, v must be [batch, seq, heads, dim]; got q{q.shape} k{k.shape} v{v.shape}")
    if k.shape != v.shape[:3] + (k.shape[3],) or q.shape[:2] != k.shape[:2] or q.shape[3] != k.shape[3]:
        raise ValueError(
            f"shapes do not match: q{q.shape} k{k.shape} v{v.shape} "
            "(q/k share batch, seq, head_dim; k/v share batch, seq, heads)"
        )
    if q.shape[2] % k.shape[2]:
        raise ValueError(f"kv heads ({k.shape[2]}) must divide q heads ({q.shape[2]})")
    if segment_ids is not None and segment_ids.shape != q.shape[:2]:
        raise ValueError(f"segment_ids must be [batch, seq] = {q.shape[:2]}, got {segment_ids.shape}")


def _positions(segment_ids, b, s):
    if segment_ids is None:
        return jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
    return segment_positions(segment_ids)


def block_starts(segment_ids, b: int, s: int, block_size: int) -> jax.Array:
    """[B, S] int32: the first position of the block each token belongs to."""
    pos = _positions(segment_ids, b, s)
    return jnp.arange(s, dtype=jnp.int32)[None] - pos % block_size


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
        pos = _positions(segment_ids, b, s)
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


def moba_reference_mask(
    routing: Routing, *, block_size: int, segment_ids=None, query_positions=None, num_keys: int | None = None
) -> jax.Array:
    """[B, Hq, T, S] bool: which keys each query attends to under this routing (dense: for the
    oracle and for decoding over a cache, where `query_positions` [B, T] and `num_keys` are given)."""
    b, t, hq, _ = routing.past_start.shape
    s = t if num_keys is None else num_keys
    bs = block_starts(segment_ids, b, s, block_size)  # [B, S] block start of each key
    qpos = jnp.arange(t)[None] if query_positions is None else query_positions  # [B or 1, T]
    own = (bs[:, None, :] == routing.own_start[:, :, None]) & (
        jnp.arange(s)[None, None, :] <= qpos[:, :, None]
    )
    past = (bs[:, None, None, :, None] == jnp.moveaxis(routing.past_start, 2, 1)[:, :, :, None, :]).any(-1)
    return own[:, None] | past


def moba_reference(q, k, v, routing: Routing, *, block_size: int, segment_ids=None, scale=None):
    """Dense-mask O(S^2) MoBA, written for clarity: the oracle for every other implementation."""
    mask = moba_reference_mask(routing, block_size=block_size, segment_ids=segment_ids)
    return masked_attention(q, k, v, mask, scale)


def resolve_impl(impl: str, backend: str | None = None) -> tuple[str, str | None, bool]:
    """(path, kernel backend, interpret) for an impl name on a JAX backend.

    auto: the Pallas kernels on TPU and GPU, xla elsewhere. pallas: the kernel
    for this backend, interpreted on CPU (TPU kernel). pallas_tpu/pallas_gpu:
    that kernel, interpreted unless running on its own hardware."""
    backend = backend or jax.default_backend()
    on = {"tpu": "tpu", "gpu": "gpu", "cuda": "gpu", "rocm": "gpu"}.get(backend)
    if impl == "auto":
        impl = "pallas" if on else "xla"
    if impl in ("reference", "xla"):
        return impl, None, False
    kernel = impl.removeprefix("pallas_") if impl != "pallas" else (on or "tpu")
    return "pallas", kernel, kernel != on


def moba_attention(
    q,
    k,
    v,
    *,
    block_size: int,
    top_k: int,
    segment_ids=None,
    scale=None,
    impl: str = "auto",
    block_sizes=None,
):
    """MoBA attention. q [B, S, Hq, D], k [B, S, Hkv, D], v [B, S, Hkv, Dv] -> [B, S, Hq, Dv] in q's dtype.

    `scale` defaults to 1/sqrt(D). impl: "reference" (dense mask), "xla"
    (sub-quadratic), "pallas" / "pallas_tpu" / "pallas_gpu" (kernels; see
    `resolve_impl`), "auto". `block_sizes`: kernel tile sizes
    (pallas_kernels.moba.tpu.BlockSizes), Pallas paths only.
    """
    check_args(q, k, v, block_size, top_k, segment_ids, impl)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    path, kernel, interpret = resolve_impl(impl)
    if path == "pallas":
        from pallas_kernels.moba.attention import moba_pallas
        from pallas_kernels.moba.tpu import BlockSizes

        def run(q, k, v, seg):  # per shard: routing is per batch row and head, so it shards too
            r = moba_routing(q, k, block_size=block_size, top_k=top_k, segment_ids=seg)
            return moba_pallas(
                q,
                k,
                v,
                r.own_start,
                r.past_start,
                block_size,
                float(scale),
                kernel,
                interpret,
                block_sizes or BlockSizes(),
            )

        return shard_over_batch_heads(run, q, k, v, segment_ids)
    routing = moba_routing(q, k, block_size=block_size, top_k=top_k, segment_ids=segment_ids)
    if path == "reference":
        return moba_reference(q, k, v, routing, block_size=block_size, segment_ids=segment_ids, scale=scale)
    from effattn_jax.ops.moba_xla import moba_xla

    return moba_xla(q, k, v, routing, block_size=block_size, segment_ids=segment_ids, scale=scale)
