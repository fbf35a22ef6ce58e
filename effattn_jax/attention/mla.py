"""Multi-head Latent Attention (DeepSeek-V2), PAPERS.md §2.

Per token: c = RMSNorm(W_DKV h) (d_c, cached), k^R = RoPE(W_KR h) (d_R, one per
token, shared by all heads, cached); per head k_i = [W_UK,i c ; k^R],
v_i = W_UV,i c; q_i = [W_UQ,i c' ; RoPE(W_QR,i c')] with c' = RMSNorm(W_DQ h)
when q_lora_rank > 0, else a plain projection of h. Softmax scale
1/sqrt(qk_nope + qk_rope). Subclasses change only how per-head K/V come from
the latent (`kv_heads`), so the cache (c, k^R) and the query path are shared.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
from flax import nnx

from effattn_jax.layers import Dense, RMSNorm, apply_rope
from effattn_jax.sharding import constrain


class MLA(nnx.Module):
    def __init__(self, cfg, *, core, rngs: nnx.Rngs):
        m, a = cfg.model, cfg.mla
        h, dtype, std = m.num_heads, jnp.dtype(m.dtype), m.init_std
        self.num_heads, self.nope, self.rope_dim, self.v_dim = h, a.qk_nope_head_dim, a.qk_rope_head_dim, a.v_head_dim
        self.dkv = Dense([m.d_model], [a.kv_lora_rank], ("embed", "kv_lora"), rngs=rngs, std=std, dtype=dtype)
        self.kv_norm = RMSNorm(a.kv_lora_rank, eps=m.norm_eps)
        self.kr = Dense([m.d_model], [a.qk_rope_head_dim], ("embed", "head_dim"), rngs=rngs, std=std, dtype=dtype)
        q_in, q_axis = m.d_model, "embed"
        if a.q_lora_rank:
            self.dq = Dense([m.d_model], [a.q_lora_rank], ("embed", "q_lora"), rngs=rngs, std=std, dtype=dtype)
            self.q_norm = RMSNorm(a.q_lora_rank, eps=m.norm_eps)
            q_in, q_axis = a.q_lora_rank, "q_lora"
        self.q = Dense([q_in], [h, self.nope + self.rope_dim], (q_axis, "heads", "head_dim"), rngs=rngs, std=std,
                       dtype=dtype)
        self.init_kv_up(cfg, rngs)
        self.o = Dense([h, self.v_dim], [m.d_model], ("heads", "head_dim", "embed"), rngs=rngs,
                       std=std / math.sqrt(2 * m.num_layers), dtype=dtype)
        self.core = core
        self.scale = 1.0 / math.sqrt(self.nope + self.rope_dim)
        self.rope_theta = m.rope_theta
        self.q_lora = bool(a.q_lora_rank)

    def init_kv_up(self, cfg, rngs):
        m, a = cfg.model, cfg.mla
        dtype, h = jnp.dtype(m.dtype), m.num_heads
        self.uk = Dense([a.kv_lora_rank], [h, self.nope], ("kv_lora", "heads", "head_dim"), rngs=rngs,
                        std=m.init_std, dtype=dtype)
        self.uv = Dense([a.kv_lora_rank], [h, self.v_dim], ("kv_lora", "heads", "head_dim"), rngs=rngs,
                        std=m.init_std, dtype=dtype)

    def init_cache(self, batch: int, max_len: int, dtype) -> dict:
        """The preallocated decode cache: latent c [B, L, d_c] and RoPE key k^R [B, L, d_R] only."""
        return {"c": jnp.zeros((batch, max_len, self.kv_norm.scale.shape[0]), dtype),
                "kr": jnp.zeros((batch, max_len, self.rope_dim), dtype)}

    def latent(self, x, positions):
        """What is cached per token: c [B, S, d_c] and the RoPE key k^R [B, S, d_R]."""
        c = self.kv_norm(self.dkv(x))
        kr = apply_rope(self.kr(x)[:, :, None, :], positions, self.rope_theta)[:, :, 0]
        return c, kr

    def kv_heads(self, c, token_ids):
        """Per-head key (no-RoPE part) [B, S, H, nope] and value [B, S, H, v] from the latent."""
        return self.uk(c), self.uv(c)

    def query(self, x, positions):
        """(q_nope [B, S, H, nope], RoPE'd q_rope [B, S, H, d_R])."""
        q = self.q(self.q_norm(self.dq(x)) if self.q_lora else x)
        return q[..., : self.nope], apply_rope(q[..., self.nope:], positions, self.rope_theta)

    def __call__(self, x, *, positions, segment_ids, token_ids=None, cache=None):
        if cache is not None:
            raise NotImplementedError("KV-cache decoding lands with the generation issue")
        q_nope, q_rope = self.query(x, positions)
        c, kr = self.latent(x, positions)
        k_nope, v = self.kv_heads(c, token_ids)
        b, s, h, _ = k_nope.shape
        q = constrain(jnp.concatenate([q_nope, q_rope], axis=-1), ("batch", "length", "heads", "head_dim"))
        k = jnp.concatenate([k_nope, jnp.broadcast_to(kr[:, :, None, :], (b, s, h, self.rope_dim))], axis=-1)
        out = self.core(q, k, v, segment_ids=segment_ids, scale=self.scale)
        return self.o(out), None
