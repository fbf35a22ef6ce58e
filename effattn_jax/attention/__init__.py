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
from effattn_jax.ops.moba import moba_attention, moba_reference_mask, moba_routing

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
    return Core(dense_attention, causal_decode_mask, causal_only=True)


def _moba_core(cfg) -> Core:
    from pallas_kernels.moba.tpu import BlockSizes

    m = cfg.moba

    def decode_mask(q, k_cache, positions):  # the training routing, over the cache
        r = moba_routing(q, k_cache, block_size=m.block_size, top_k=m.top_k, query_positions=positions)
        return moba_reference_mask(
            r, block_size=m.block_size, query_positions=positions, num_keys=k_cache.shape[1]
        )

    attend = functools.partial(
        moba_attention,
        block_size=m.block_size,
        top_k=m.top_k,
        impl=m.impl,
        block_sizes=BlockSizes(m.q_tile, m.kv_block),
    )
    return Core(attend, decode_mask)


CORES = {"dense": _dense_core, "moba": _moba_core}


def layer_spec(cfg, layer: int) -> tuple[str, str]:
    """(kind, core) of one layer: `attention.layers`, else `last_layers`, else the defaults."""
    a = cfg.attention
    if a.layers:
        kind, _, core = a.layers[layer].partition(":")
        return kind, core
    if layer >= cfg.model.num_layers - a.last_layers.n:
        return a.last_layers.kind or a.kind, a.last_layers.core or a.core
    return a.kind, a.core
