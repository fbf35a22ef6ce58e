"""Attention registry: `attention.kind` picks the projections (a module class),
`attention.core` the pattern (a parameter-free `Core`), independently; any kind
works with any core.

Every kind is constructed as `KINDS[kind](cfg, core=CORES[core](cfg), rngs=rngs)`
and called as `module(x, *, positions, segment_ids, token_ids)` for training and
`module.decode(x, *, positions, token_ids, cache)` -> `(output, cache)` for
generation, with the cache from `module.init_cache`. A core (`Core`) holds the
training attention `attend(q, k, v, *, segment_ids, scale=None, kv_whole=False)`
(q [B, S, Hq, D], k/v [B, S, Hkv, D]; `kv_whole`: k/v are already whole over a context
axis, as MLA's are) and its decoding over a cache (with any cache entries of its own,
such as MoBA's block means). Cores have no parameters, so switching between dense and MoBA
never changes the parameter tree; DSA's core needs the indexer's outputs (`Core.indexed`), so a
DSA layer owns an `Indexer` (attention/indexer.py), and its core takes `index=` and returns each
token's KL loss beside the output.

The config layer validates these names from its own lists (ATTENTION_KINDS,
ATTENTION_CORES in effattn_jax/config.py), which must match the keys here.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax.numpy as jnp

from effattn_jax.attention.eg_mla import EGMLA
from effattn_jax.attention.mha import MHA
from effattn_jax.attention.mla import MLA
from effattn_jax.ops.context_parallel import context_shards
from effattn_jax.ops.dense import dense_attention, masked_attention
from effattn_jax.ops.dsa import (
    dsa_decode_attention,
    dsa_reference,
    dsa_select,
    dsa_sparse_attention,
    indexer_kl_loss,
)
from effattn_jax.ops.dsa_context import dsa_context_attention
from effattn_jax.ops.moba import BlockSizes, moba_attention
from effattn_jax.ops.moba_decode import (
    empty_block_means,
    moba_decode_attention,
    prefill_block_means,
    update_block_means,
)
from effattn_jax.sharding import sharding_rules

KINDS = {"mha": MHA, "mla": MLA, "eg_mla": EGMLA}


@dataclasses.dataclass(frozen=True)
class Core:
    """An attention pattern. `attend(q, k, v, *, segment_ids, scale=None, kv_whole=False)` for training;
    `decode(view, cache, positions, *, scale, prefill)` -> (out, cache entries) for decoding:
    the view's queries (a `CacheView`: what the kind's cache offers, after these tokens were
    written) at absolute `positions` [B, T] of one document per row. `prefill`: the tokens
    are each row's first (positions 0..T-1), so the training attention runs over them.
    `init_state(batch, max_len, heads, dim)`: the cache entries the core keeps itself
    (`decode` returns them updated; heads and dim of the keys its gate reads)."""

    attend: Callable
    decode: Callable
    init_state: Callable = lambda batch, max_len, heads, dim: {}
    causal_only: bool = False  # every query sees its whole past (lets MLA decode with absorbed weights)
    # the layer owns an indexer: attend and decode take index=(q_idx, k_idx, weights), and attend
    # returns (out, the indexer's KL loss per token [B, S])
    indexed: bool = False


def causal_decode(view, cache, positions, *, scale, prefill=False):
    k, v = view.full()
    mask = jnp.arange(view.length)[None, None, None, :] <= positions[:, None, :, None]
    return masked_attention(view.q, k, v, mask, scale, heads_first=True), {}


def _dense_core(cfg) -> Core:
    attend = functools.partial(dense_attention, impl=cfg.attention.dense_impl, rules=sharding_rules(cfg))
    return Core(attend, causal_decode, causal_only=True)


def moba_block_sizes(cfg) -> BlockSizes:
    """The config's MoBA kernel tiles (`auto` fields are None: the op resolves them per call)."""
    names = ("q_tile", "kv_block", "past_q_tile", "key_tile", "num_warps", "num_stages")
    return BlockSizes(**{n: None if getattr(cfg.moba, n) == "auto" else getattr(cfg.moba, n) for n in names})


def _moba_core(cfg) -> Core:
    c, top_k = cfg.moba.block_size, cfg.moba.top_k
    attend = functools.partial(
        moba_attention,
        block_size=c,
        top_k=top_k,
        impl=cfg.moba.impl,
        block_sizes=moba_block_sizes(cfg),
        routing_chunk=cfg.moba.routing_chunk,
        rules=sharding_rules(cfg),
    )

    def init_state(batch, max_len, heads, dim):
        return {"block_means": empty_block_means(batch, max_len, heads, dim, c)}

    def decode(view, cache, positions, *, scale, prefill=False):
        """Sparse: the gate reads the cached block means, attention only the selected blocks."""
        q = view.q
        if prefill:  # the training op (sub-quadratic) over the prompt, then its blocks' means
            t = q.shape[1]
            k, v = view.prompt(t)
            out = attend(q, k.astype(q.dtype), v.astype(q.dtype), segment_ids=None, scale=scale)
            gate_keys = view.gate_keys(jnp.broadcast_to(jnp.arange(t), positions.shape))
            means = prefill_block_means(cache["block_means"], gate_keys, t, block_size=c, dtype=q.dtype)
            return out, {"block_means": means}
        means = update_block_means(
            cache["block_means"], view.gate_keys, positions, block_size=c, dtype=q.dtype
        )
        out = moba_decode_attention(
            view, means, positions, block_size=c, top_k=top_k, scale=scale, impl=cfg.moba.impl
        )
        return out, {"block_means": means}

    return Core(attend, decode, init_state)


def _dsa_core(cfg) -> Core:
    """DSA (docs/dsa.md): the indexer picks each token's top-k keys. Stage `warmup`: dense
    attention, the KL over every visible key; `sparse`: attention and KL over the selection."""
    d, dense, rules = cfg.dsa, _dense_core(cfg), sharding_rules(cfg)
    chunk = d.query_chunk or None
    sparse = dsa_sparse_attention(d.impl, chunk, rules)  # per mesh shard
    local = dsa_sparse_attention(d.impl, chunk)  # inside the context axis' shard_map

    def attend(q, k, v, *, segment_ids, scale=None, kv_whole=False, index):
        q_idx, k_idx, weights = index
        scale = q.shape[-1] ** -0.5 if scale is None else scale
        kl = functools.partial(indexer_kl_loss, q, k, q_idx, k_idx, weights, segment_ids=segment_ids)
        if context_shards() > 1:
            return dsa_context_attention(
                q, k, v, q_idx, k_idx, weights, top_k=d.index_topk, stage=d.stage, segment_ids=segment_ids,
                scale=scale, rules=rules, kv_whole=kv_whole, query_chunk=chunk, sparse=local, impl=d.impl,
            )  # fmt: skip
        if d.stage == "warmup":
            out = dense.attend(q, k, v, segment_ids=segment_ids, scale=scale, kv_whole=kv_whole)
            return out, kl(scale=scale, query_chunk=chunk)
        indices = dsa_select(
            q_idx, k_idx, weights, top_k=d.index_topk, segment_ids=segment_ids, query_chunk=chunk,
            impl=d.impl, rules=rules,
        )  # fmt: skip
        if d.impl == "reference":
            out = dsa_reference(
                q, k, v, q_idx, k_idx, weights, top_k=d.index_topk, segment_ids=segment_ids, scale=scale
            )
        else:
            out = sparse(q, k, v, indices, scale=scale)
        return out, kl(indices=indices, scale=scale, query_chunk=chunk)

    def init_state(batch, max_len, heads, dim):
        return {"index_keys": jnp.zeros((batch, max_len, d.index_head_dim), cfg.model.dtype)}

    def decode(view, cache, positions, *, scale, prefill=False, index):
        """The new tokens' indexer keys into the cache, then each query's top-k among the cached
        keys up to its position; only those rows are read (a prefill runs the training op)."""
        q_idx, k_idx, weights = index
        rows = jnp.arange(positions.shape[0])[:, None]
        keys = cache["index_keys"].at[rows, positions].set(k_idx.astype(cache["index_keys"].dtype))
        if d.stage == "warmup":
            return causal_decode(view, cache, positions, scale=scale)[0], {"index_keys": keys}
        if prefill:
            t = view.q.shape[1]
            k, v = view.prompt(t)
            indices = dsa_select(
                q_idx, k_idx, weights, top_k=d.index_topk, query_chunk=chunk, impl=d.impl, rules=rules
            )
            out = sparse(view.q, k.astype(view.q.dtype), v.astype(view.q.dtype), indices, scale=scale)
            return out, {"index_keys": keys}
        indices = dsa_select(q_idx, keys, weights, top_k=d.index_topk, q_index=positions)
        return dsa_decode_attention(view, indices, scale, d.impl, rules), {"index_keys": keys}

    return Core(attend, decode, init_state, indexed=True)


CORES = {"dense": _dense_core, "moba": _moba_core, "dsa": _dsa_core}
