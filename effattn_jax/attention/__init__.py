"""Attention registry: `attention.kind` picks the projections (a module class),
`attention.core` the pattern (a parameter-free `Core`), independently; any kind
works with any core.

Every kind is constructed as `KINDS[kind](cfg, core=CORES[core](cfg), rngs=rngs)`
and called as `module(x, *, positions, segment_ids, token_ids)` for training and
`module.decode(x, *, positions, token_ids, cache)` -> `(output, cache)` for
generation, with the cache from `module.init_cache`. A core (`Core`) holds the
training attention `attend(q, k, v, *, segment_ids, scale=None)` (q [B, S, Hq, D],
k/v [B, S, Hkv, D]) and the mask it implies when decoding over a cache; cores have
no parameters, so switching the core never changes the parameter tree.

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
from effattn_jax.ops.dense import dense_attention
from effattn_jax.ops.moba import moba_attention, moba_reference_mask
from effattn_jax.ops.routing import moba_routing
from effattn_jax.sharding import sharding_rules
from pallas_kernels.moba.common import BlockSizes

KINDS = {"mha": MHA, "mla": MLA, "eg_mla": EGMLA}


@dataclasses.dataclass(frozen=True)
class Core:
    """An attention pattern. `attend(q, k, v, *, segment_ids, scale=None)` for training;
    `decode_mask(q, k_cache, positions)` -> [B, Hq or 1, T, L] bool for decoding over a
    cache of L slots, queries at absolute `positions` [B, T] of one document."""

    attend: Callable
    decode_mask: Callable
    causal_only: bool = False  # every query sees its whole past (lets MLA decode with absorbed weights)


def causal_decode_mask(q, k_cache, positions):
    return jnp.arange(k_cache.shape[1])[None, None, None, :] <= positions[:, None, :, None]


def _dense_core(cfg) -> Core:
    attend = functools.partial(dense_attention, impl=cfg.attention.dense_impl, rules=sharding_rules(cfg))
    return Core(attend, causal_decode_mask, causal_only=True)


def _moba_core(cfg) -> Core:
    moba = cfg.moba

    def decode_mask(q, k_cache, positions):  # the training routing, over the cache
        r = moba_routing(
            q,
            k_cache,
            block_size=moba.block_size,
            top_k=moba.top_k,
            query_positions=positions,
            query_chunk=moba.routing_chunk,
        )
        return moba_reference_mask(
            r, block_size=moba.block_size, query_positions=positions, num_keys=k_cache.shape[1]
        )

    attend = functools.partial(
        moba_attention,
        block_size=moba.block_size,
        top_k=moba.top_k,
        impl=moba.impl,
        block_sizes=BlockSizes(moba.q_tile, moba.kv_block, moba.bwd_tile_chunk, moba.past_q_tile),
        routing_chunk=moba.routing_chunk,
        rules=sharding_rules(cfg),
    )
    return Core(attend, decode_mask)


CORES = {"dense": _dense_core, "moba": _moba_core}
