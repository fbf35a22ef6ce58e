"""Multi-head Latent Attention (DeepSeek-V2), docs/mla.md.

Per token: c = RMSNorm(W_DKV h) (d_c, cached), k^R = RoPE(W_KR h) (d_R, one per
token, shared by all heads, cached); per head k_i = [W_UK,i c ; k^R],
v_i = W_UV,i c; q_i = [W_UQ,i c' ; RoPE(W_QR,i c')] with c' = RMSNorm(W_DQ h)
when q_lora_rank > 0, else a plain projection of h. Softmax scale
1/sqrt(qk_nope + qk_rope). Subclasses change only how per-head K/V come from
the latent (`kv_heads`), so the cache (c, k^R) and the query path are shared.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from effattn_jax.layers import Dense, RMSNorm, apply_rope
from effattn_jax.sharding import constrain, sharding_rules


class MLA(nnx.Module):
    def __init__(self, cfg, *, core, rngs: nnx.Rngs):
        m, a = cfg.model, cfg.mla
        h, dtype, std = m.num_heads, jnp.dtype(m.dtype), m.init_std
        self.num_heads, self.v_dim = h, a.v_head_dim
        self.nope, self.rope_dim = a.qk_nope_head_dim, a.qk_rope_head_dim
        self.dkv = Dense([m.d_model], [a.kv_lora_rank], ("embed", "kv_lora"), rngs=rngs, std=std, dtype=dtype)
        self.kv_norm = RMSNorm(a.kv_lora_rank, eps=m.norm_eps)
        self.kr = Dense(
            [m.d_model], [a.qk_rope_head_dim], ("embed", "head_dim"), rngs=rngs, std=std, dtype=dtype
        )
        q_in, q_axis = m.d_model, "embed"
        if a.q_lora_rank:
            self.dq = Dense(
                [m.d_model], [a.q_lora_rank], ("embed", "q_lora"), rngs=rngs, std=std, dtype=dtype
            )
            self.q_norm = RMSNorm(a.q_lora_rank, eps=m.norm_eps)
            q_in, q_axis = a.q_lora_rank, "q_lora"
        self.q = Dense(
            [q_in],
            [h, self.nope + self.rope_dim],
            (q_axis, "heads", "head_dim"),
            rngs=rngs,
            std=std,
            dtype=dtype,
        )
        self.init_kv_up(cfg, rngs)
        self.o = Dense(
            [h, self.v_dim],
            [m.d_model],
            ("heads", "head_dim", "embed"),
            rngs=rngs,
            std=std / math.sqrt(2 * m.num_layers),
            dtype=dtype,
        )
        self.core = core
        self.scale = 1.0 / math.sqrt(self.nope + self.rope_dim)
        self.rope_theta = m.rope_theta
        self.q_lora = bool(a.q_lora_rank)
        self.rules = sharding_rules(cfg)

    def init_kv_up(self, cfg, rngs):
        """The per-head up-projections W_UK, W_UV from the cached latent c."""
        self.init_up_projections(cfg, rngs, cfg.mla.kv_lora_rank, "kv_lora")

    def init_up_projections(self, cfg, rngs, in_dim: int, in_axis: str):
        """uk: [in_dim] -> [H, nope], uv: [in_dim] -> [H, v] (EG-MLA's latent placement reuses them)."""
        m, h, dtype = cfg.model, cfg.model.num_heads, jnp.dtype(cfg.model.dtype)
        axes = (in_axis, "heads", "head_dim")
        self.uk = Dense([in_dim], [h, self.nope], axes, rngs=rngs, std=m.init_std, dtype=dtype)
        self.uv = Dense([in_dim], [h, self.v_dim], axes, rngs=rngs, std=m.init_std, dtype=dtype)

    def init_cache(self, batch: int, max_len: int, dtype) -> dict:
        """The preallocated decode cache: latent c [B, L, d_c] and RoPE key k^R [B, L, d_R] (plus
        the core's own entries over the per-head keys, e.g. MoBA's block means)."""
        return {
            "c": jnp.zeros((batch, max_len, self.kv_norm.scale.shape[0]), dtype),
            "kr": jnp.zeros((batch, max_len, self.rope_dim), dtype),
        } | self.core.init_state(batch, max_len, self.num_heads, self.nope + self.rope_dim)

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
        return q[..., : self.nope], apply_rope(q[..., self.nope :], positions, self.rope_theta)

    def __call__(self, x, *, positions, segment_ids, token_ids=None):
        q_nope, q_rope = self.query(x, positions)
        c, kr = self.latent(x, positions)
        k_nope, v = self.kv_heads(c, token_ids)
        q = constrain(
            jnp.concatenate([q_nope, q_rope], axis=-1), ("batch", "length", "heads", "head_dim"), self.rules
        )
        return self.o(
            self.core.attend(q, self.full_keys(k_nope, kr), v, segment_ids=segment_ids, scale=self.scale)
        )

    def full_keys(self, k_nope, kr):
        """Per-head keys [k_nope ; k^R] with the shared RoPE key broadcast to every head."""
        b, s, h, _ = k_nope.shape
        return jnp.concatenate(
            [k_nope, jnp.broadcast_to(kr[:, :, None, :], (b, s, h, self.rope_dim))], axis=-1
        )

    def write_cache(self, cache, rows, positions, c, kr, token_ids):
        return cache | {
            "c": cache["c"].at[rows, positions].set(c.astype(cache["c"].dtype)),
            "kr": cache["kr"].at[rows, positions].set(kr.astype(cache["kr"].dtype)),
        }

    def absorbed_latent(self, cache):
        """The latent that attention can run over with absorbed weights [B, L, d]; None if impossible."""
        return cache["c"]

    def decode(self, x, *, positions, token_ids, cache, absorb: bool = True, prefill: bool = False):
        """New tokens x [B, T, d_model] at `positions` [B, T] -> ([B, T, d_model], cache).

        absorb=True (dense core only): W_UK folds into the query and W_UV applies after
        attention, so scores and values come straight from the cached latent:
        q_i.k_s = (W_UK,i^T q_nope,i) . c_s + q_rope,i . k^R_s. Otherwise per-head K/V of
        every cached token are rebuilt from the cache (the naive path, also MoBA's). `prefill`:
        see `Core`."""
        c, kr = self.latent(x, positions)
        rows = jnp.arange(x.shape[0])[:, None]
        cache = self.write_cache(cache, rows, positions, c, kr, token_ids)
        q_nope, q_rope = self.query(x, positions)
        lat = self.absorbed_latent(cache) if absorb and self.core.causal_only else None
        if lat is not None:
            w_uk, w_uv = self.uk.kernel[...].astype(lat.dtype), self.uv.kernel[...].astype(lat.dtype)
            q_lat = jnp.einsum("bthn,dhn->bthd", q_nope, w_uk)
            logits = jnp.einsum(
                "bthd,bsd->bhts", q_lat, lat, preferred_element_type=jnp.float32
            ) + jnp.einsum("bthr,bsr->bhts", q_rope, cache["kr"], preferred_element_type=jnp.float32)
            mask = jnp.arange(lat.shape[1])[None, None, None, :] <= positions[:, None, :, None]
            probs = jax.nn.softmax(jnp.where(mask, logits * self.scale, -jnp.inf), axis=-1)
            out = jnp.einsum(
                "bthd,dhv->bthv",
                jnp.einsum("bhts,bsd->bthd", probs, lat.astype(jnp.float32)),
                w_uv.astype(jnp.float32),
            ).astype(x.dtype)
        else:
            k_nope, v = self.kv_heads(cache["c"], cache.get("token_ids"))
            q = jnp.concatenate([q_nope, q_rope], axis=-1)
            k = self.full_keys(k_nope, cache["kr"])
            out, state = self.core.decode(q, k, v, cache, positions, scale=self.scale, prefill=prefill)
            cache = cache | state
        return self.o(out), cache
