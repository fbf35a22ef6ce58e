"""A non-gating per-layer token table (`mla.token_table_dim`, docs/eg_mla.md "The control"): the
parameter-matched control for EG-MLA's gate tables. Each layer l owns E_l [vocab, d_e] (the same
shape and the same lookup E_l[x] as EG-MLA's gate table) and W_l [d_e, d_model]; the block adds
W_l E_l[x] to the hidden state at its input, h <- h + W_l E_l[x], instead of gating the latent.
The tokens' identity reaches every layer as extra capacity, without the multiplicative gate, and
the cache stays MLA's (the step's own token ids are all a decode step reads).

Init: E_l ~ N(0, 1) as EG-MLA's tables; W_l at std init_std / sqrt(d_e), so W_l E_l[x] starts at
the token embedding's scale (init_std per element) as EG-MLA's gates start at the scale of what
they multiply. E_l counts as "token_table" parameters (`model.param_counts`, beside
"embedding_gate"), W_l (a matmul, d_e * d_model per layer) among the non-embedding ones.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from effattn_jax.layers import Dense


class TokenTable(nnx.Module):
    def __init__(self, cfg, *, rngs: nnx.Rngs):
        m, d_e = cfg.model, cfg.mla.token_table_dim
        self.token_table = nnx.Param(
            jax.random.normal(rngs.params(), (m.vocab_size, d_e), jnp.float32),
            logical_axes=("vocab", "gate"),
        )
        self.proj = Dense(
            [d_e],
            [m.d_model],
            ("gate", "embed"),
            rngs=rngs,
            std=m.init_std / math.sqrt(d_e),
            dtype=jnp.dtype(m.dtype),
        )

    def __call__(self, token_ids):
        """token ids [B, S] -> W E[x] [B, S, d_model] in the compute dtype."""
        return self.proj(jnp.take(self.token_table[...], token_ids, axis=0))
