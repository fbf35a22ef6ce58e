"""Multi-head attention with grouped KV heads (MHA, GQA, MQA) and RoPE."""

from __future__ import annotations

import math

import jax.numpy as jnp
from flax import nnx

from effattn_jax.attention.indexer import decode_core, indexer_for, run_core
from effattn_jax.layers import Dense, RMSNorm, apply_rope, rope_of
from effattn_jax.ops.cache import kv_view
from effattn_jax.sharding import constrain, sharding_rules


class MHA(nnx.Module):
    cached_token_ids = False  # see EGMLA

    def __init__(self, cfg, *, core, rngs: nnx.Rngs):
        m = cfg.model
        h, kv, d = m.num_heads, cfg.num_kv_heads, cfg.head_dim
        dtype = jnp.dtype(m.dtype)
        out_std = m.init_std / math.sqrt(2 * m.num_layers)
        proj = dict(rngs=rngs, std=m.init_std, dtype=dtype, bias=m.qkv_bias)
        self.q = Dense([m.d_model], [h, d], ("embed", "heads", "head_dim"), **proj)
        self.k = Dense([m.d_model], [kv, d], ("embed", "kv_heads", "head_dim"), **proj)
        self.v = Dense([m.d_model], [kv, d], ("embed", "kv_heads", "head_dim"), **proj)
        norm = lambda: RMSNorm(d, eps=m.norm_eps, axis_name="head_dim") if m.qk_norm else None
        self.q_norm, self.k_norm = norm(), norm()
        self.o = Dense(
            [h, d], [m.d_model], ("heads", "head_dim", "embed"), rngs=rngs, std=out_std, dtype=dtype
        )
        self.core = core
        self.rope = rope_of(m)
        self.rules = sharding_rules(cfg)
        self.indexer = indexer_for(cfg, core, m.d_model, "embed", rngs)  # DSA's (core=dsa)

    def init_cache(self, batch: int, max_len: int, dtype) -> dict:
        """The preallocated decode cache: K and V head-major, [B, KV, L, D] each (see `kv_view`),
        plus the core's own entries, e.g. MoBA's block means."""
        kv, d = self.k.kernel.shape[1:]
        shape = (batch, kv, max_len, d)
        return {"k": jnp.zeros(shape, dtype), "v": jnp.zeros(shape, dtype)} | self.core.init_state(
            batch, max_len, kv, d
        )

    def qkv(self, x, positions):
        q, k = self.q(x), self.k(x)  # [B, S, H, D], [B, S, KV, D]
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        return apply_rope(q, positions, self.rope), apply_rope(k, positions, self.rope), self.v(x)

    def __call__(self, x, *, positions, segment_ids, token_ids=None):
        """x: [B, S, d_model] -> [B, S, d_model]. `token_ids` is unused by MHA."""
        q, k, v = self.qkv(x, positions)
        q = constrain(q, ("batch", "length", "heads", "head_dim"), self.rules)
        return self.o(run_core(self, q, k, v, x=x, q_in=x, positions=positions, segment_ids=segment_ids))

    def decode(self, x, *, positions, token_ids, cache, absorb: bool = True, prefill: bool = False):
        """New tokens x [B, T, d_model] at `positions` [B, T]: written into the cache, then
        attended over it -> ([B, T, d_model], cache). `prefill`: see `Core`. (`absorb`
        concerns latent kinds only.)"""
        q, k, v = self.qkv(x, positions)
        # every axis but D indexed, so the write stays an in-place scatter (XLA CPU turns a
        # scatter it can slice into a dynamic-update-slice and copies the cache for its readers)
        at = (
            jnp.arange(x.shape[0])[:, None, None],
            jnp.arange(k.shape[2])[None, :, None],
            positions[:, None],
        )
        write = lambda a, new: a.at[at].set(jnp.swapaxes(new, 1, 2).astype(a.dtype))  # new as [B, KV, T, D]
        cache = cache | {"k": write(cache["k"], k), "v": write(cache["v"], v)}
        view = kv_view(q, cache["k"], cache["v"])
        scale = q.shape[-1] ** -0.5
        out, state = decode_core(self, view, cache, positions, x=x, q_in=x, scale=scale, prefill=prefill)
        return self.o(out), cache | state
