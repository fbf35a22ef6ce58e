"""DSA's lightning indexer (docs/dsa.md, items 1-5), owned by a layer whose core is `dsa`, and the
way a kind runs its core with it.

Per token: q^I = W_IQ c' (Hi heads of Di; c' is MLA's normalised query latent, or the hidden state
where there is none), k^I = LayerNorm(W_IK h) (one key of Di, cached), w = W_IW h (Hi weights,
float32). RoPE (rotate-half) covers the first mla.qk_rope_head_dim channels of q^I and k^I. The
indexer's inputs are detached: the language-model loss never reaches it and its KL loss never
reaches the rest of the model. Its parameters draw from their own stream (`own_stream`), so every
other parameter draws as it does without it: a DSA model is the dense one plus indexers.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from effattn_jax.layers import Dense, LayerNorm, apply_rope, rope_of

INDEX_KEY_NORM_EPS = 1e-6  # transformers' DeepseekV32Indexer.k_norm
INDEXER_STREAM = 0xD5A  # folded into the layer's params key: the indexers' own random stream


def own_stream(rngs: nnx.Rngs) -> nnx.Rngs:
    """Rngs for an indexer, derived from the params stream's key and count without drawing from it."""
    stream = rngs.params
    key = jax.random.fold_in(jax.random.fold_in(stream.key[...], stream.count[...]), INDEXER_STREAM)
    return nnx.Rngs(params=key)


class Indexer(nnx.Module):
    def __init__(self, cfg, q_in: int, q_axis: str, *, rngs: nnx.Rngs):
        m, d = cfg.model, cfg.dsa
        rngs = own_stream(rngs)
        hi, di, dtype = d.index_n_heads, d.index_head_dim, jnp.dtype(m.dtype)
        self.wq_b = Dense(
            [q_in], [hi, di], (q_axis, "heads", "head_dim"), rngs=rngs, std=m.init_std, dtype=dtype
        )
        self.wk = Dense([m.d_model], [di], ("embed", "head_dim"), rngs=rngs, std=m.init_std, dtype=dtype)
        self.k_norm = LayerNorm(di, eps=INDEX_KEY_NORM_EPS, axis_name="head_dim")
        self.weights_proj = Dense([m.d_model], [hi], ("embed", "heads"), rngs=rngs, std=m.init_std)
        self.rope_dim = cfg.mla.qk_rope_head_dim
        self.rope = rope_of(m)

    def _rope_first(self, x, positions):
        """RoPE on the first rope_dim channels of x [B, S, H, Di]: [rope ; nope]."""
        r = self.rope_dim
        return jnp.concatenate([apply_rope(x[..., :r], positions, self.rope), x[..., r:]], axis=-1)

    def __call__(self, x, q_in, positions):
        """x [B, S, d_model], q_in [B, S, q_in] (c', or x) -> (q_idx [B, S, Hi, Di], k_idx [B, S, Di],
        weights [B, S, Hi] float32)."""
        x, q_in = jax.lax.stop_gradient(x), jax.lax.stop_gradient(q_in)
        q = self._rope_first(self.wq_b(q_in), positions)
        k = self._rope_first(self.k_norm(self.wk(x))[:, :, None, :], positions)[:, :, 0]
        return q, k, self.weights_proj(x.astype(jnp.float32))


def indexer_for(cfg, core, q_in: int, q_axis: str, rngs) -> Indexer | None:
    """The layer's indexer where its core needs one (`Core.indexed`), else None."""
    return Indexer(cfg, q_in, q_axis, rngs=rngs) if core.indexed else None


def run_core(layer, q, k, v, *, x, q_in, positions, segment_ids, **kw):
    """layer.core's training attention; with an indexer it also gets the indexer's outputs and
    returns each token's KL loss, which the layer sows for the model to capture
    (`sown_indexer_kl`)."""
    if layer.indexer is None:
        return layer.core.attend(q, k, v, segment_ids=segment_ids, **kw)
    index = layer.indexer(x, q_in, positions)
    out, kl = layer.core.attend(q, k, v, segment_ids=segment_ids, index=index, **kw)
    layer.sow(nnx.Intermediate, "indexer_kl", kl)
    return out


def decode_core(layer, view, cache, positions, *, x, q_in, **kw):
    """layer.core's decoding, with the indexer's outputs for these tokens where it has one."""
    if layer.indexer is None:
        return layer.core.decode(view, cache, positions, **kw)
    return layer.core.decode(view, cache, positions, index=layer.indexer(x, q_in, positions), **kw)


def sown_indexer_kl(sown) -> jax.Array | float:
    """The sum of the per-token KL losses [B, S] in the intermediates a module's indexers sowed
    (`nnx.capture(module, nnx.Intermediate)`'s), or 0."""
    kls = jax.tree.leaves(sown)
    return sum(kls[1:], kls[0]) if kls else 0.0
