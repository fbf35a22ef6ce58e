"""The GPU suite's correctness section: the compiled kernels against the plain references at the
shapes users run, where interpret mode on a CPU cannot reach (it forgives what hardware rejects).

- MoBA, forward and gradients against the dense-mask reference: packed documents with GQA, top-k 1,
  and top-k covering every block; each case gives the largest relative difference of the loss, dq,
  dK and dV (each relative to its largest entry).
- The decode kernels against their XLA steps at 16 and 128 heads: the absorbed MLA step over the
  latent, and MoBA's sparse step (GQA, 4 query heads per KV head).
- DSA's sparse attention kernel against the XLA path (`sparse_attention`), forward and gradients,
  over a causal selection that `dsa_select` makes from random indexer outputs; and its latent
  decode kernel against the selected rows' attention in plain jnp, at 16 and 128 heads.
- DSA's fused selection kernel against `dsa_select` in XLA on V3.2's indexer (64 heads of 128,
  bf16): each query's picks, scored by XLA and sorted, must score as XLA's own picks do (float32
  sums in another order can part near-ties, so a differing pick must be a near-tie).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from effattn_jax.ops.cache import kv_view
from effattn_jax.ops.dsa import dsa_select, dsa_sparse_attention, latent_decode_kernel, lightning_index_scores
from effattn_jax.ops.mla_decode import absorbed_attention
from effattn_jax.ops.moba import moba_attention
from effattn_jax.ops.moba_decode import empty_block_means, moba_decode_attention, prefill_block_means


def relative_difference(a, b) -> float:
    a, b = jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32)
    return float(jnp.abs(a - b).max() / jnp.maximum(jnp.abs(b).max(), 1e-30))


def latent_step_inputs(keys, batch, heads, context, latent, rope, dtype):
    """Random inputs of one absorbed decode step from keys[:4]: q_lat [B, 1, H, d_c], q_rope [B, 1,
    H, d_R] and a full cache, latent [B, L, d_c] and RoPE keys [B, L, d_R]."""
    q_lat = jax.random.normal(keys[0], (batch, 1, heads, latent), dtype)
    q_rope = jax.random.normal(keys[1], (batch, 1, heads, rope), dtype)
    lat = jax.random.normal(keys[2], (batch, context, latent), dtype)
    return q_lat, q_rope, lat, jax.random.normal(keys[3], (batch, context, rope), dtype)


def packed_segments(batch: int, seq: int, docs: int):
    """[B, S] segment ids of `docs` documents of unequal lengths per row (the first the longest)."""
    cuts = [seq * (docs - i) * (docs - i + 1) // (docs * (docs + 1)) for i in range(docs)]
    starts = jnp.array(sorted(seq - c for c in cuts))
    return jnp.broadcast_to(jnp.searchsorted(starts, jnp.arange(seq), side="right"), (batch, seq))


def moba_case(*, seq, heads, kv_heads, head_dim, block, top_k, docs, dtype, impl, tiles, batch=1) -> dict:
    """The kernels (`impl`) against the reference: loss and gradients of sum(out * w), w random."""
    keys = jax.random.split(jax.random.key(seq + heads + top_k), 4)
    q = jax.random.normal(keys[0], (batch, seq, heads, head_dim), dtype)
    k, v = (jax.random.normal(key, (batch, seq, kv_heads, head_dim), dtype) for key in keys[1:3])
    w = jax.random.normal(keys[3], (batch, seq, heads, head_dim), jnp.float32)
    segments = packed_segments(batch, seq, docs) if docs > 1 else None

    def grads(impl):
        def loss(q, k, v):
            out = moba_attention(
                q, k, v, block_size=block, top_k=top_k, segment_ids=segments, impl=impl, block_sizes=tiles
            )
            return jnp.sum(out.astype(jnp.float32) * w)

        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))(q, k, v)

    got, want = jax.tree.leaves(grads(impl)), jax.tree.leaves(grads("reference"))
    diffs = [relative_difference(a, b) for a, b in zip(got, want, strict=True)]
    return {
        "check": "moba",
        "impl": impl,
        "seq": seq,
        "heads": heads,
        "kv_heads": kv_heads,
        "head_dim": head_dim,
        "block": block,
        "top_k": top_k,
        "documents": docs,
        "dtype": jnp.dtype(dtype).name,
        "max_rel_diff": max(diffs),
        "loss_dq_dk_dv_rel_diff": diffs,
    }


def dsa_case(*, seq, heads, kv_heads, head_dim, v_head_dim, top_k, dtype, impl, index_heads=4) -> dict:
    """The kernel (`impl`) against the XLA path: loss and gradients of sum(out * w), w random."""
    keys = jax.random.split(jax.random.key(seq + heads + top_k), 7)
    q = jax.random.normal(keys[0], (1, seq, heads, head_dim), dtype)
    k = jax.random.normal(keys[1], (1, seq, kv_heads, head_dim), dtype)
    v = jax.random.normal(keys[2], (1, seq, kv_heads, v_head_dim), dtype)
    w = jax.random.normal(keys[3], (1, seq, heads, v_head_dim), jnp.float32)
    q_idx = jax.random.normal(keys[4], (1, seq, index_heads, 32), jnp.float32)
    k_idx = jax.random.normal(keys[5], (1, seq, 32), jnp.float32)
    weights = jax.random.normal(keys[6], (1, seq, index_heads), jnp.float32)
    indices = jax.jit(lambda *x: dsa_select(*x, top_k=top_k))(q_idx, k_idx, weights)

    def grads(impl):
        attend = dsa_sparse_attention(impl)
        loss = lambda q, k, v: jnp.sum(attend(q, k, v, indices, scale=head_dim**-0.5).astype(jnp.float32) * w)
        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))(q, k, v)

    got, want = jax.tree.leaves(grads(impl)), jax.tree.leaves(grads("xla"))
    diffs = [relative_difference(a, b) for a, b in zip(got, want, strict=True)]
    return {"check": "dsa", "impl": impl, "seq": seq, "heads": heads, "kv_heads": kv_heads,
            "head_dim": head_dim, "v_head_dim": v_head_dim, "top_k": top_k, "dtype": jnp.dtype(dtype).name,
            "max_rel_diff": max(diffs), "loss_dq_dk_dv_rel_diff": diffs}  # fmt: skip


def dsa_select_case(*, seq, top_k, impl, index_heads, index_dim, dtype) -> dict:
    """The selection kernel (`impl`) against the XLA selection on random indexer outputs: the XLA
    scores of each query's picks, best first, compared slot by slot (a pick set that differs only
    at near-ties scores the same); and the fraction of index slots that differ."""
    keys = jax.random.split(jax.random.key(seq + top_k), 3)
    q_idx = jax.random.normal(keys[0], (1, seq, index_heads, index_dim), dtype)
    k_idx = jax.random.normal(keys[1], (1, seq, index_dim), dtype)
    weights = jax.random.normal(keys[2], (1, seq, index_heads), jnp.float32)
    select = lambda impl: jax.jit(lambda *x: dsa_select(*x, top_k=top_k, impl=impl))(q_idx, k_idx, weights)
    got, want = select(impl), select("xla")
    chunk = math.gcd(seq, 256)  # queries scored at a time: [chunk, Hi, S] float32 products

    @jax.jit
    def scored(idx):  # the picks' XLA scores, best first; 0 in the unused slots
        def one(args):
            q, w, i = args  # [chunk, Hi, Di], [chunk, Hi], [chunk, K]
            s = jnp.take_along_axis(lightning_index_scores(q[None], k_idx, w[None])[0], jnp.maximum(i, 0), -1)
            return -jnp.sort(-jnp.where(i >= 0, s, 0.0), axis=-1)

        split = lambda x: x[0].reshape(seq // chunk, chunk, *x.shape[2:])
        return jax.lax.map(one, (split(q_idx), split(weights), split(idx)))

    same_counts = bool(jnp.all(jnp.sum(got >= 0, axis=-1) == jnp.sum(want >= 0, axis=-1)))
    diff = relative_difference(scored(got), scored(want)) if same_counts else float("inf")
    return {"check": "dsa_select", "impl": impl, "seq": seq, "top_k": top_k, "index_heads": index_heads,
            "index_dim": index_dim, "dtype": jnp.dtype(dtype).name, "max_rel_diff": diff,
            "picks_differing_fraction": float(jnp.mean((got != want).astype(jnp.float32)))}  # fmt: skip


def dsa_decode_case(*, heads, context, batch, latent, rope, top_k, dtype, impl, index_heads=4) -> dict:
    """One absorbed decode step over each row's top_k latent rows (rows at different lengths, the
    selection `dsa_select`'s from random indexer outputs) by the kernel against plain jnp."""
    keys = jax.random.split(jax.random.key(heads + top_k), 7)
    q_lat, q_rope, lat, kr = latent_step_inputs(keys, batch, heads, context, latent, rope, dtype)
    q_idx = jax.random.normal(keys[4], (batch, 1, index_heads, 32), jnp.float32)
    k_idx = jax.random.normal(keys[5], (batch, context, 32), jnp.float32)
    weights = jax.random.normal(keys[6], (batch, 1, index_heads), jnp.float32)
    positions = (jnp.arange(batch)[:, None] * 37 + context - 1 - 37 * (batch - 1)).astype(jnp.int32)
    idx = jax.jit(lambda *x: dsa_select(*x, top_k=top_k, q_index=positions))(q_idx, k_idx, weights)
    scale = (latent + rope) ** -0.5

    def gathered(q_lat, q_rope, lat, kr, idx):  # [B, 1, K, .] rows, float32
        rows = lambda x: jnp.take_along_axis(x[:, None], jnp.maximum(idx, 0)[..., None], 2).astype(
            jnp.float32
        )
        s = jnp.einsum("bthw,btkw->bthk", q_lat.astype(jnp.float32), rows(lat))
        s = (s + jnp.einsum("bthw,btkw->bthk", q_rope.astype(jnp.float32), rows(kr))) * scale
        p = jax.nn.softmax(jnp.where((idx >= 0)[:, :, None, :], s, -jnp.inf), axis=-1)
        return jnp.einsum("bthk,btkd->bthd", p, rows(lat))

    got = jax.jit(lambda *x: latent_decode_kernel(impl)(*x, scale=scale))(q_lat, q_rope, lat, kr, idx)
    want = jax.jit(gathered)(q_lat, q_rope, lat, kr, idx)
    return {"check": "dsa_decode", "impl": impl, "heads": heads, "context": context, "batch": batch,
            "top_k": top_k, "dtype": jnp.dtype(dtype).name,
            "max_rel_diff": relative_difference(got, want)}  # fmt: skip


def mla_decode_case(*, heads, context, batch, latent, rope, dtype, impl) -> dict:
    """One absorbed decode step (rows at different lengths) by the kernel against XLA."""
    keys = jax.random.split(jax.random.key(heads), 4)
    q_lat, q_rope, lat, kr = latent_step_inputs(keys, batch, heads, context, latent, rope, dtype)
    positions = (jnp.arange(batch)[:, None] * 37 + context - 1 - 37 * (batch - 1)).astype(jnp.int32)
    step = jax.jit(
        lambda impl, *x: absorbed_attention(*x, positions, (latent + rope) ** -0.5, impl), static_argnums=0
    )
    got, want = (step(i, q_lat, q_rope, lat, kr) for i in (impl, "xla"))
    return {"check": "mla_decode", "impl": impl, "heads": heads, "context": context, "batch": batch,
            "dtype": jnp.dtype(dtype).name, "max_rel_diff": relative_difference(got, want)}  # fmt: skip


def moba_decode_case(*, heads, context, block, head_dim, dtype, impl, group=4, top_k=3) -> dict:
    """One sparse decode step (GQA, rows at different positions) by the kernel against XLA."""
    keys = jax.random.split(jax.random.key(heads), 3)
    kv_heads = max(1, heads // group)
    k, v = (jax.random.normal(key, (2, kv_heads, context, head_dim), dtype) for key in keys[:2])
    q = jax.random.normal(keys[2], (2, 1, heads, head_dim), dtype)
    means = prefill_block_means(
        empty_block_means(2, context, kv_heads, head_dim, block),
        jnp.swapaxes(k, 1, 2),
        context,
        block_size=block,
        dtype=dtype,
    )
    positions = jnp.array([[context - 10], [block + 5]])
    step = jax.jit(
        lambda impl: moba_decode_attention(
            kv_view(q, k, v), means, positions, block_size=block, top_k=top_k, scale=head_dim**-0.5, impl=impl
        ),
        static_argnums=0,
    )
    diff = relative_difference(step(impl), step("xla"))
    return {"check": "moba_decode", "impl": impl, "heads": heads, "kv_heads": kv_heads, "context": context,
            "block": block, "dtype": jnp.dtype(dtype).name, "max_rel_diff": diff}  # fmt: skip
