"""DeepSeek Sparse Attention (DSA, DeepSeek-V3.2) at the op level; semantics in docs/dsa.md.

A lightning indexer scores every visible key for each query, I[t, s] = c * sum_h w[t, h] *
ReLU(q_idx[t, h] . k_idx[s]); each query keeps its top-k keys (one set for all heads) and attends
to them only. Here: the scores, the selection (`dsa_select`, the one every path uses), the
dense-mask oracle (`dsa_reference`), the XLA path that reads only the selected rows
(`sparse_attention`: memory O(S * k), never [S, S]), the dispatch (`dsa_attention`) and the
indexer's KL loss (`indexer_kl_loss`), which is how the indexer learns: the attention output gives
it no gradient.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from effattn_jax.config import DSA_IMPLS
from effattn_jax.ops.dense import causal_segment_mask, masked_attention
from effattn_jax.sharding import shard_over_batch, shard_over_batch_heads

CHUNK_BYTES = 1 << 28  # the largest intermediate of one query chunk, when no chunk size is given
MAX_CHUNK = 512  # queries per chunk at most, when no chunk size is given


def lightning_index_scores(q_idx, k_idx, weights, *, scale=None):
    """The indexer's scores, float32: q_idx [B, T, Hi, Di], weights [B, T, Hi] and k_idx [B, S, Di]
    (every query against the same keys) -> [B, T, S], or k_idx [B, T, K, Di] (each query's own
    gathered keys) -> [B, T, K]. I = scale * sum_h w[h] * ReLU(q[h] . k), scale (Hi * Di)^-1/2 by
    default: DeepSeek's n_heads^-1/2 on the weights times the softmax scale Di^-1/2 (a positive
    factor passes through the ReLU). Products in the inputs' dtype, sums in float32."""
    hi, di = q_idx.shape[-2:]
    scale = 1.0 / math.sqrt(hi * di) if scale is None else scale
    keys = "btkd" if k_idx.ndim == 4 else "bkd"
    dots = jnp.einsum(f"bthd,{keys}->bthk", q_idx, k_idx, preferred_element_type=jnp.float32)
    w = weights.astype(jnp.float32) * scale
    return jnp.einsum("bthk,bth->btk", jax.nn.relu(dots), w)


def check_args(q, k, v, q_idx, k_idx, weights, top_k, segment_ids, impl):
    if not (isinstance(top_k, int) and top_k >= 1):
        raise ValueError(f"top_k must be an int >= 1, got {top_k!r}")
    if impl not in DSA_IMPLS:
        raise ValueError(f"impl must be one of {DSA_IMPLS}, got {impl!r}")
    if q.ndim != 4 or k.shape[:3] != v.shape[:3] or q.shape[:2] != k.shape[:2] or q.shape[3] != k.shape[3]:
        raise ValueError(
            f"q, k, v must be [batch, seq, heads, dim] sharing batch and seq (q, k: dim; k, v: heads); "
            f"got q{q.shape} k{k.shape} v{v.shape}"
        )
    if q.shape[2] % k.shape[2]:
        raise ValueError(f"kv heads ({k.shape[2]}) must divide q heads ({q.shape[2]})")
    b, s = q.shape[:2]
    if q_idx.shape[:2] != (b, s) or weights.shape != q_idx.shape[:3] or k_idx.shape != (b, s, q_idx.shape[3]):
        raise ValueError(
            f"indexer shapes must be q_idx [B, S, Hi, Di], k_idx [B, S, Di], weights [B, S, Hi] with "
            f"[B, S] = {(b, s)}; got q_idx{q_idx.shape} k_idx{k_idx.shape} weights{weights.shape}"
        )
    if segment_ids is not None and segment_ids.shape != (b, s):
        raise ValueError(f"segment_ids must be [batch, seq] = {(b, s)}, got {segment_ids.shape}")


def _query_chunk(t: int, per_query_bytes: int, chunk: int | None) -> int:
    """Queries per chunk: `chunk` if given, else the most (up to MAX_CHUNK) whose largest
    intermediate, `per_query_bytes` a query, stays within CHUNK_BYTES."""
    if chunk is None:
        chunk = max(1, min(MAX_CHUNK, CHUNK_BYTES // max(per_query_bytes, 1)))
    return max(1, min(chunk, t))


def _map_chunks(body, chunk: int, *xs):
    """body over query chunks: xs [B, T, ...] padded with zeros to a multiple of `chunk`, mapped
    one chunk at a time (lax.map: a chunk's intermediates exist one chunk at a time) and put back
    -> [B, T, ...]. The body is rematerialised in the backward pass, so what a chunk gathers is
    not kept for it."""
    b, t = xs[0].shape[:2]
    pad = -t % chunk
    split = lambda x: jnp.moveaxis(
        jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2)).reshape(b, -1, chunk, *x.shape[2:]), 1, 0
    )  # [B, T, ...] -> [T / chunk, B, chunk, ...]
    out = jax.lax.map(jax.checkpoint(lambda a: body(*a)), tuple(split(x) for x in xs))
    return jnp.moveaxis(out, 0, 1).reshape(b, t + pad, *out.shape[3:])[:, :t]


def _visible(q_index, segment_ids, s: int):
    """[B, C, S] bool: key s is at or before the query's position q_index [B, C] in its document."""
    vis = jnp.arange(s)[None, None, :] <= q_index[:, :, None]
    if segment_ids is None:
        return vis
    q_seg = jnp.take_along_axis(segment_ids, q_index, axis=1)
    return vis & (segment_ids[:, None, :] == q_seg[:, :, None])


def _q_index(q_index, b: int, t: int):
    """The queries' positions in the keys' sequence, [B, T] int32 (default: 0 .. T - 1)."""
    return jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t)) if q_index is None else q_index


XLA_IMPLS = ("auto", "xla", "reference")  # the impls that run no DSA kernel


def _kernel(impl: str, part: str):
    """The registered DSA kernel for `part` of impl's backend, its `interpret` bound (interpreted
    off its hardware), or None where that backend has none (TPU training: the XLA path). Called
    where the op traces, so an AOT target's backend is the one used."""
    from effattn_jax.ops.platform import resolve_impl
    from pallas_kernels.registry import REGISTRY, kernel

    _, backend, interpret = resolve_impl(impl)
    if ("dsa", part, backend) not in REGISTRY:
        return None
    return functools.partial(kernel("dsa", part, backend), interpret=interpret)


def dsa_select(
    q_idx,
    k_idx,
    weights,
    *,
    top_k: int,
    segment_ids=None,
    scale=None,
    q_index=None,
    query_chunk=None,
    impl: str = "xla",
    rules=None,
):
    """The one DSA selection: q_idx [B, T, Hi, Di], k_idx [B, S, Di], weights [B, T, Hi] ->
    indices [B, T, K'] int32, K' = min(top_k, S), best first, ties to the earlier token; -1 in
    the slots past the query's visible keys (fewer than K' at or before it in its document).

    `q_index` [B, T]: the queries' positions among the keys (default: T = S, in order).
    `query_chunk`: queries scored at once ([B, chunk, Hi, S] float32 products; default: as many
    as fit CHUNK_BYTES, at most 512). No gradient flows through it. `impl`: where its backend has
    a selection kernel (pallas_kernels/dsa/tpu_select.py, triton_select.py), the selection runs in
    it, the scores never in HBM, per batch shard under a mesh (`rules`); the rest here."""
    run = None if impl in XLA_IMPLS else _kernel(impl, "select")
    if run is not None:
        b, t, s = *q_idx.shape[:2], k_idx.shape[1]
        seg = jnp.ones((b, s), jnp.int32) if segment_ids is None else segment_ids
        select = lambda q, k, w, seg, pos: run(
            q, k, w, top_k=top_k, segment_ids=seg, q_index=pos, scale=scale
        )
        return shard_over_batch(select, q_idx, k_idx, weights, seg, _q_index(q_index, b, t), rules=rules)
    q_idx, k_idx, weights = (jax.lax.stop_gradient(x) for x in (q_idx, k_idx, weights))
    b, t, hi, _ = q_idx.shape
    s = k_idx.shape[1]
    kk = min(top_k, s)
    chunk = _query_chunk(t, 4 * b * (hi + 2) * s, query_chunk)

    def select(qc, wc, pos):  # [B, C, Hi, Di], [B, C, Hi], [B, C]
        scores = lightning_index_scores(qc, k_idx, wc, scale=scale)
        scores = jnp.where(_visible(pos, segment_ids, s), scores, -jnp.inf)
        vals, idx = jax.lax.top_k(scores, kk)  # ties: the lower index first
        return jnp.where(vals > -jnp.inf, idx, -1).astype(jnp.int32)

    return _map_chunks(select, chunk, q_idx, weights, _q_index(q_index, b, t))


def _gather_rows(x, rows):
    """x [B, S, ...] at rows [B, C, K] (clamped to >= 0) -> [B, C, K, ...]."""
    b, c, kk = rows.shape
    flat = jnp.maximum(rows, 0).reshape(b, c * kk, *([1] * (x.ndim - 2)))
    return jnp.take_along_axis(x, flat, axis=1).reshape(b, c, kk, *x.shape[2:])


def _selected_logits(qc, kg, scale):
    """Per-head logits of queries qc [B, C, H, D] against their gathered keys kg [B, C, K, Hkv, D]
    -> [B, C, Hkv, G, K] float32 (G = H / Hkv query heads share a key head: GQA without copies)."""
    b, c, h, d = qc.shape
    hkv = kg.shape[3]
    qg = qc.reshape(b, c, hkv, h // hkv, d)
    return jnp.einsum("bckgd,bcnkd->bckgn", qg, kg, preferred_element_type=jnp.float32) * scale


def sparse_attention(q, k, v, indices, *, scale=None, query_chunk=None):
    """Attention over each query's selected keys only. q [B, T, H, D], k [B, S, Hkv, D],
    v [B, S, Hkv, Dv], indices [B, T, K] (-1: none) -> [B, T, H, Dv] in q's dtype.

    Per chunk of queries the selected rows of k and v are gathered ([B, chunk, K, Hkv, D]) and
    attended with a float32 softmax over the valid slots; memory O(T * K), no [T, S] array. The
    gradients reach q, k, v through the gather (a scatter-add into dk, dv); the indices are
    integers, so nothing reaches the indexer. `query_chunk`: default as many as fit CHUNK_BYTES."""
    b, t, h, d = q.shape
    hkv, dv = k.shape[2], v.shape[3]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    kk = indices.shape[-1]
    chunk = _query_chunk(t, 4 * b * kk * (hkv * (d + dv) + 2 * h), query_chunk)

    def attend(qc, idx):  # [B, C, H, D], [B, C, K]
        valid = (idx >= 0)[:, :, None, None, :]
        logits = jnp.where(valid, _selected_logits(qc, _gather_rows(k, idx), scale), -jnp.inf)
        m = jax.lax.stop_gradient(logits.max(-1, keepdims=True))
        p = jnp.exp(logits - jnp.where(jnp.isfinite(m), m, 0.0))  # padded queries select nothing
        l = p.sum(-1)[..., None]
        o = jnp.einsum("bckgn,bcnkv->bckgv", p, _gather_rows(v, idx).astype(jnp.float32))
        return (o / jnp.where(l > 0, l, 1.0)).reshape(qc.shape[:3] + (dv,)).astype(q.dtype)

    return _map_chunks(attend, chunk, q, indices)


def dsa_sparse_attention(impl: str, query_chunk=None, rules=None):
    """The attention over a selection that `impl` runs, (q, k, v, indices, *, scale) -> out: the XLA
    path (`sparse_attention`) for auto, xla and reference, else the kernel of that backend
    (pallas_triton, pallas_tpu: interpreted off their hardware), per shard of the batch and head
    axes under a mesh when `rules` are given (neither Mosaic nor Triton partitions a kernel; inside
    a shard_map already, as over a context axis, leave them out)."""
    if impl in XLA_IMPLS:
        return functools.partial(sparse_attention, query_chunk=query_chunk)

    def attend(q, k, v, indices, *, scale=None):
        run = _kernel(impl, "attention")  # where it traces: an AOT target's backend is the one used
        if run is None:
            return sparse_attention(q, k, v, indices, scale=scale, query_chunk=query_chunk)
        body = lambda q, k, v, indices: run(q, k, v, indices, scale=scale)
        return shard_over_batch_heads(body, q, k, v, indices, rules)  # indices shard like segment ids

    return attend


def latent_decode_kernel(impl: str):
    """The kernel of impl's backend for MLA's decode step over selected latent rows, (q_lat, q_rope,
    lat, kr, indices, *, scale) -> [B, T, H, d_c] (pallas_kernels/dsa/*_decode.py)."""
    return _kernel(impl, "decode")


def dsa_decode_attention(view, indices, scale, impl: str = "xla", rules=None):
    """Decoding: each query of a CacheView (q [B, T, H, D]) over its selected cache slots
    indices [B, T, K] (-1: none) -> [B, T, H, Dv]. Only those rows are fetched, once per KV head:
    the selection is shared by every query head, so a latent cache (one KV head) reads each
    selected row once for all heads, as V3.2's absorbed decode does. `impl` pallas_triton or
    pallas_tpu: MLA's latent cache (`view.latent`) through that backend's kernel where its widths
    suit it (Triton: powers of two; Mosaic: any), per batch shard under a mesh (`rules`)."""
    if impl not in XLA_IMPLS and view.latent is not None:
        from pallas_kernels.dsa.triton_decode import supports

        lat, kr = view.latent
        if impl != "pallas_triton" or supports(lat.shape[-1], kr.shape[-1]):
            q_lat, q_rope = view.q[..., : lat.shape[-1]], view.q[..., lat.shape[-1] :]
            step = lambda *x: latent_decode_kernel(impl)(*x, scale=scale)
            return shard_over_batch(step, q_lat, q_rope, lat, kr, indices, rules=rules)
    b, t, h, d = view.q.shape
    hkv, kk = view.kv_heads, indices.shape[-1]
    starts = jnp.broadcast_to(jnp.maximum(indices, 0)[:, :, None, :], (b, t, hkv, kk))
    keys, values = (x[..., 0, :] for x in view.fetch(starts, 1))  # [B, T, Hkv, K, D | Dv]
    q = view.q.reshape(b, t, hkv, h // hkv, d)
    logits = jnp.einsum("btkgd,btknd->btkgn", q, keys.astype(q.dtype), preferred_element_type=jnp.float32)
    logits = jnp.where((indices >= 0)[:, :, None, None, :], logits * scale, -jnp.inf)
    p = jax.nn.softmax(logits, axis=-1)  # a decoding query always has a pick: itself is visible
    out = jnp.einsum("btkgn,btknv->btkgv", p, values.astype(jnp.float32))
    return out.reshape(b, t, h, -1).astype(view.q.dtype)


def dsa_reference_mask(q_idx, k_idx, weights, *, top_k: int, segment_ids=None, scale=None):
    """[B, 1, S, S] bool, written for clarity: the whole score matrix, masked to the causal
    same-document keys, the top min(top_k, S) of each row (lax.top_k: ties to the earlier key),
    and of those the visible ones (a row with fewer visible keys keeps them all)."""
    s = k_idx.shape[1]
    visible = causal_segment_mask(segment_ids, s, s)[:, 0]  # [B or 1, S, S]
    scores = jnp.where(visible, lightning_index_scores(q_idx, k_idx, weights, scale=scale), -jnp.inf)
    _, idx = jax.lax.top_k(scores, min(top_k, s))
    chosen = (idx[..., None] == jnp.arange(s)).any(-2)  # [B, S, S]
    return jax.lax.stop_gradient(chosen & visible)[:, None]


def dsa_reference(
    q, k, v, q_idx, k_idx, weights, *, top_k: int, segment_ids=None, scale=None, index_scale=None
):
    """Dense-mask O(S^2) DSA: the oracle every other path is tested against. Shapes as
    `dsa_attention`."""
    mask = dsa_reference_mask(q_idx, k_idx, weights, top_k=top_k, segment_ids=segment_ids, scale=index_scale)
    return masked_attention(q, k, v, mask, 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale)


def dsa_attention(
    q,
    k,
    v,
    q_idx,
    k_idx,
    weights,
    *,
    top_k: int,
    segment_ids=None,
    scale=None,
    index_scale=None,
    impl: str = "auto",
    query_chunk=None,
):
    """DSA. q [B, S, H, D], k [B, S, Hkv, D], v [B, S, Hkv, Dv] (MLA's per-head q/k/v: Hkv = H;
    GQA/MHA: Hkv divides H), the indexer's q_idx [B, S, Hi, Di], k_idx [B, S, Di] and weights
    [B, S, Hi] -> [B, S, H, Dv] in q's dtype. Each query attends to its top_k keys by index score
    among the causal keys of its document (all of them when it has no more). `scale`: the
    attention's (default 1/sqrt(D)); `index_scale`: the indexer's (default (Hi * Di)^-1/2).
    impl: "reference" (dense mask), "xla" (gathers the selected rows), "auto" (xla)."""
    check_args(q, k, v, q_idx, k_idx, weights, top_k, segment_ids, impl)
    if impl == "reference":
        return dsa_reference(
            q, k, v, q_idx, k_idx, weights, top_k=top_k, segment_ids=segment_ids, scale=scale,
            index_scale=index_scale,
        )  # fmt: skip
    indices = dsa_select(
        q_idx,
        k_idx,
        weights,
        top_k=top_k,
        segment_ids=segment_ids,
        scale=index_scale,
        query_chunk=query_chunk,
    )
    return sparse_attention(q, k, v, indices, scale=scale, query_chunk=query_chunk)


def indexer_kl(target, index_scores, valid):
    """KL(target || softmax(index_scores)) over the `valid` entries of the last axis, float32, one
    value per row (0 for a row with none). target: a distribution over the valid entries (rows sum
    to 1; 0 log 0 = 0), index_scores: the indexer's scores, valid: bool, all broadcast together."""
    valid = jnp.broadcast_to(valid, index_scores.shape)
    scores = jnp.where(valid, index_scores, 0.0)
    m = jax.lax.stop_gradient(jnp.where(valid, scores, -jnp.inf).max(-1, keepdims=True))
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    total = jnp.where(valid, jnp.exp(scores - m), 0.0).sum(-1, keepdims=True)
    log_q = scores - m - jnp.log(jnp.where(total > 0, total, 1.0))
    terms = jax.scipy.special.xlogy(target, target) - target * log_q
    return jnp.where(valid, terms, 0.0).sum(-1)


def _head_mean_probs(logits, valid):
    """The main attention's distribution for the indexer to follow: each head's softmax over the
    valid keys, summed over heads and L1-normalised. logits [B, C, Hkv, G, N], valid broadcastable
    to them -> [B, C, N]."""
    logits = jnp.where(valid, logits, -jnp.inf)
    m = logits.max(-1, keepdims=True)
    p = jnp.exp(logits - jnp.where(jnp.isfinite(m), m, 0.0))
    p = (p / jnp.maximum(p.sum(-1, keepdims=True), 1e-30)).sum((2, 3))
    return p / jnp.maximum(p.sum(-1, keepdims=True), 1e-30)


def indexer_kl_loss(
    q,
    k,
    q_idx,
    k_idx,
    weights,
    *,
    indices=None,
    segment_ids=None,
    scale=None,
    index_scale=None,
    q_index=None,
    query_chunk=None,
):
    """The indexer's training signal (docs/dsa.md, "Training"): per query, KL(p || softmax(I)),
    p the main attention's probabilities summed over heads and L1-normalised (held constant), I
    the index scores -> [B, T] float32. q [B, T, H, D], k [B, S, Hkv, D], the indexer's inputs as
    `dsa_attention`. `indices` None: the dense warm-up, over every visible key (main attention
    dense); `indices` [B, T, K] from `dsa_select`: the sparse stage, over the selected keys only.
    Gradients reach q_idx, k_idx and weights only. Chunked like the attention: no [T, S] array
    beyond a chunk's. `q_index` [B, T]: the queries' positions among the keys (as `dsa_select`)."""
    q, k = jax.lax.stop_gradient(q), jax.lax.stop_gradient(k)
    b, t, h, d = q.shape
    s, hkv = k.shape[1], k.shape[2]
    hi, di = q_idx.shape[2:]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    pos = _q_index(q_index, b, t)
    if indices is None:
        chunk = _query_chunk(t, 4 * b * s * (h + hi + 4), query_chunk)

        def dense(qc, qic, wc, pc):  # every visible key
            valid = _visible(pc, segment_ids, s)  # [B, C, S]
            qg = qc.reshape(*qc.shape[:2], hkv, h // hkv, d)
            logits = jnp.einsum("bckgd,bnkd->bckgn", qg, k, preferred_element_type=jnp.float32) * scale
            p = jax.lax.stop_gradient(_head_mean_probs(logits, valid[:, :, None, None]))
            return indexer_kl(p, lightning_index_scores(qic, k_idx, wc, scale=index_scale), valid)

        return _map_chunks(dense, chunk, q, q_idx, weights, pos)
    kk = indices.shape[-1]
    chunk = _query_chunk(t, 4 * b * kk * (hkv * d + di + h + hi + 4), query_chunk)

    def sparse(qc, qic, wc, idx):  # the selected keys
        valid = idx >= 0  # [B, C, K]
        logits = _selected_logits(qc, _gather_rows(k, idx), scale)
        p = jax.lax.stop_gradient(_head_mean_probs(logits, valid[:, :, None, None]))
        scores = lightning_index_scores(qic, _gather_rows(k_idx, idx), wc, scale=index_scale)
        return indexer_kl(p, scores, valid)

    return _map_chunks(sparse, chunk, q, q_idx, weights, indices)
