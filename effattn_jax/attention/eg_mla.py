"""Embedding-Gated MLA (docs/eg_mla.md). The cache is MLA's (c, k^R); decoding also reads the
token ids, which the model caches once for all layers (`cached_token_ids`).

EG-MLA's paper text was not available; this follows the public description
("latent ... up-projected; a dedicated token embedding (indexed by token ID)
is up-projected to form the gating signal; combined multiplicatively,
followed by layer normalization") — our reading, chosen with `eg_mla.gate_at`:

* latent (default): c~ = LN(W_U c * E_l[x]) of width d_e (E_l: [vocab, d_e],
  one per layer), then k_i = [W_UK,i c~ ; k^R], v_i = W_UV,i c~. Keeps MLA's
  weight absorption over c~; a decode step then costs what MLA's would with a
  d_e-wide latent (measured 1.5-10x MLA at 16K context for d_e 16-128 against
  d_c 48: close to MLA only where d_e is close to MLA's latent width).
* projected (a hypothesis): c~ = LN(W_U c * W_G E_l[x]) of a fixed width d_g
  (`eg_mla.projected_dim`), K/V from c~ as in latent. For decoding, E_l W_G folds
  into a [vocab, d_g] table (`fold_gate`), so a step's cost does not grow with d_e.
* heads (the literal reading): e = E_l[x]; g^K = W_GK e, g^V = W_GV e; per head
  k_i = [LN(W_UK,i c * g^K_i) ; k^R], v_i = LN(W_UV,i c * g^V_i), LayerNorm over
  each head's width (scale and bias shared by the heads). Weight absorption is
  impossible here (gate and norm sit between c and the attention), so decoding
  rebuilds per-head K/V of every cached token (~10x slower than MLA at 16K).

Gate tables are ordinary parameters (logical axes (vocab, gate), sharded over
the vocabulary), initialised N(0, 1) with the gate projections at
std 1/sqrt(d_e) so gates start at unit scale; they are counted as
"embedding-gate params" (effattn_jax.model.param_counts).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from effattn_jax.attention.mla import MLA
from effattn_jax.layers import Dense, LayerNorm


class FoldedGate(nnx.Variable):
    """gate_at=projected: E_l W_G as one [vocab, d_g] table, made for decoding (not trained or saved)."""


class EGMLA(MLA):
    cached_token_ids = True  # decode reads cache["token_ids"], which the model keeps and passes

    def init_kv_up(self, cfg, rngs):
        m, a, e = cfg.model, cfg.mla, cfg.eg_mla
        dtype, h, std = jnp.dtype(m.dtype), m.num_heads, m.init_std
        self.gate_at = e.gate_at
        self.gate_table = nnx.Param(
            jax.random.normal(rngs.params(), (m.vocab_size, e.gate_dim), jnp.float32),
            logical_axes=("vocab", "gate"),
        )
        gate_std = 1.0 / math.sqrt(e.gate_dim)
        if e.gate_at == "heads":
            super().init_kv_up(cfg, rngs)  # W_UK, W_UV from c, as in MLA
            gate_axes = ("gate", "heads", "head_dim")
            self.gk = Dense([e.gate_dim], [h, self.nope], gate_axes, rngs=rngs, std=gate_std, dtype=dtype)
            self.gv = Dense([e.gate_dim], [h, self.v_dim], gate_axes, rngs=rngs, std=gate_std, dtype=dtype)
            self.k_ln, self.v_ln = LayerNorm(self.nope, eps=m.norm_eps), LayerNorm(self.v_dim, eps=m.norm_eps)
        else:
            width, axis = (e.projected_dim, "gate_proj") if e.gate_at == "projected" else (e.gate_dim, "gate")
            if e.gate_at == "projected":
                self.g = Dense([e.gate_dim], [width], ("gate", axis), rngs=rngs, std=gate_std, dtype=dtype)
                self.folded_gate = None
            self.u = Dense([a.kv_lora_rank], [width], ("kv_lora", axis), rngs=rngs, std=std, dtype=dtype)
            self.c_ln = LayerNorm(width, eps=m.norm_eps)
            self.init_up_projections(cfg, rngs, width, axis)  # W_UK, W_UV from the gated latent

    latent_rows_as_cached = False

    def absorbed_latent(self, cache):
        """latent, projected: c~ recomputed from (c, token id) for every cached token; heads: none."""
        if self.gate_at == "heads":
            return None
        return self.c_ln(self.u(cache["c"]) * self.gate(cache["token_ids"]).astype(cache["c"].dtype))

    def absorbed_width(self):
        return None if self.gate_at == "heads" else self.c_ln.scale.shape[-1]

    def gate(self, token_ids):
        """E_l[x] [B, S, d_e]; for gate_at=projected W_G E_l[x] [B, S, d_g] (from the folded table
        once `fold_gate` has made it)."""
        if token_ids is None:
            raise ValueError("eg_mla needs the token ids (the shared attention signature passes them)")
        if self.gate_at == "projected" and self.folded_gate is not None:
            return jnp.take(self.folded_gate[...], token_ids, axis=0)
        e = jnp.take(self.gate_table[...], token_ids, axis=0)
        return self.g(e) if self.gate_at == "projected" else e

    def fold_gate(self) -> None:
        """gate_at=projected, for decoding: E_l W_G as one [vocab, d_g] table, so a decode step
        reads a d_g-wide row per cached token whatever d_e is. A snapshot of the parameters:
        for a model that no longer trains (`model.ready_for_decoding`, which unstacks scanned
        layers first)."""
        if self.gate_at == "projected":
            table = jnp.einsum("ve,eg->vg", self.gate_table[...], self.g.kernel[...].astype(jnp.float32))
            self.folded_gate = nnx.data(FoldedGate(table))  # was None: a static attribute until now

    def kv_heads(self, c, token_ids):
        e = self.gate(token_ids).astype(c.dtype)
        if self.gate_at == "heads":
            return self.k_ln(self.uk(c) * self.gk(e)), self.v_ln(self.uv(c) * self.gv(e))
        ct = self.c_ln(self.u(c) * e)
        return self.uk(ct), self.uv(ct)
