"""Attention registry: `attention.kind` picks the projections (a module class),
`attention.core` the pattern (a parameter-free function), independently.

Every kind is constructed as `KINDS[kind](cfg, core=CORES[core](cfg), rngs=rngs)`
and called as `module(x, *, positions, segment_ids, token_ids, cache=None)`
returning `(output, cache)`. A core is `fn(q, k, v, *, segment_ids, scale=None)`
with q [B, S, Hq, D], k/v [B, S, Hkv, D]; cores have no parameters, so switching
the core never changes the parameter tree.
"""

from __future__ import annotations

import functools

from effattn_jax.attention.eg_mla import EGMLA
from effattn_jax.attention.mha import MHA
from effattn_jax.attention.mla import MLA
from effattn_jax.ops.dense import dense_attention
from effattn_jax.ops.moba import moba_attention

KINDS = {"mha": MHA, "mla": MLA, "eg_mla": EGMLA}


def _moba_core(cfg):
    from pallas_kernels.moba.tpu import BlockSizes

    m = cfg.moba
    return functools.partial(moba_attention, block_size=m.block_size, top_k=m.top_k, impl=m.impl,
                             block_sizes=BlockSizes(m.q_tile, m.kv_block))


CORES = {"dense": lambda cfg: dense_attention, "moba": _moba_core}
# Which kinds each core supports so far (checked at config time).
CORE_KINDS = {"dense": set(KINDS), "moba": set(KINDS)}


def layer_spec(cfg, layer: int) -> tuple[str, str]:
    """(kind, core) of one layer: `attention.layers`, else `last_layers`, else the defaults."""
    a = cfg.attention
    if a.layers:
        kind, _, core = a.layers[layer].partition(":")
        return kind, core
    if layer >= cfg.model.num_layers - a.last_layers.n:
        return a.last_layers.kind or a.kind, a.last_layers.core or a.core
    return a.kind, a.core
