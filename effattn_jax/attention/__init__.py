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
such as MoBA's block means); cores have no parameters, so switching the core never
changes the parameter tree.

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
from effattn_jax.ops.dense import dense_attention, masked_attention
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


CORES = {"dense": _dense_core, "moba": _moba_core}
