"""Attention registry: `attention.kind` picks the projections (a module class),
`attention.core` the pattern (a parameter-free function), independently.

Every kind is constructed as `KINDS[kind](cfg, core=CORES[core], rngs=rngs)` and
called as `module(x, *, positions, segment_ids, token_ids, cache=None)`
returning `(output, cache)`. Cores have no parameters, so switching the core
never changes the parameter tree.
"""

from __future__ import annotations

from effattn_jax.attention.mha import MHA
from effattn_jax.ops.dense import dense_attention

KINDS = {"mha": MHA}
CORES = {"dense": dense_attention}


def layer_spec(cfg, layer: int) -> tuple[str, str]:
    """(kind, core) of one layer: `attention.layers`, else `last_layers`, else the defaults."""
    a = cfg.attention
    if a.layers:
        kind, _, core = a.layers[layer].partition(":")
        return kind, core
    if layer >= cfg.model.num_layers - a.last_layers.n:
        return a.last_layers.kind or a.kind, a.last_layers.core or a.core
    return a.kind, a.core
