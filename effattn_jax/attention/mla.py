"""Multi-head Latent Attention (DeepSeek-V2), docs/mla.md.

Per token: c = RMSNorm(W_DKV h) (d_c, cached), k^R = RoPE(W_KR h) (d_R, one per
token, shared by all heads, cached); per head k_i = [W_UK,i c ; k^R],
v_i = W_UV,i c; q_i = [W_UQ,i c' ; RoPE(W_QR,i c')] with c' = RMSNorm(W_DQ h)
when q_lora_rank > 0, else a plain projection of h. Softmax scale
1/sqrt(qk_nope + qk_rope). Subclasses change only how per-head K/V come from
the latent (`kv_heads`), so the cache (c, k^R) and the query path are shared.
With `mla.token_table_dim` the layer also owns a non-gating token table (`token_table`,
attention/token_table.py) that its block adds to the hidden state at the layer's input.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
from flax import nnx

from effattn_jax.attention.indexer import decode_core, indexer_for, run_core
from effattn_jax.attention.token_table import TokenTable
from effattn_jax.layers import Dense, RMSNorm, apply_rope, rope_of
from effattn_jax.ops.cache import CacheView, kv_view, take_slots
from effattn_jax.ops.mla_decode import absorbed_attention
from effattn_jax.sharding import constrain, sharding_rules

# the latent norms' epsilon (c and c'): DeepSeek's code builds them with its RMSNorm's default,
# whatever rms_norm_eps says; model.norm_eps governs the other norms (docs/mla.md)
LATENT_NORM_EPS = 1e-6


class MLA(nnx.Module):
    cached_token_ids = False  # see EGMLA

    def __init__(self, cfg, *, core, rngs: nnx.Rngs):
        m, a = cfg.model, cfg.mla
        h, dtype, std = m.num_heads, jnp.dtype(m.dtype), m.init_std
        self.num_heads, self.v_dim = h, a.v_head_dim
        self.nope, self.rope_dim = a.qk_nope_head_dim, a.qk_rope_head_dim
        self.dkv = Dense([m.d_model], [a.kv_lora_rank], ("embed", "kv_lora"), rngs=rngs, std=std, dtype=dtype)
        self.kv_norm = RMSNorm(a.kv_lora_rank, eps=LATENT_NORM_EPS)
        self.kr = Dense(
            [m.d_model], [a.qk_rope_head_dim], ("embed", "head_dim"), rngs=rngs, std=std, dtype=dtype
        )
        q_in, q_axis = m.d_model, "embed"
        if a.q_lora_rank:
            self.dq = Dense(
                [m.d_model], [a.q_lora_rank], ("embed", "q_lora"), rngs=rngs, std=std, dtype=dtype
            )
            self.q_norm = RMSNorm(a.q_lora_rank, eps=LATENT_NORM_EPS)
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
        self.rope = rope_of(m)
        self.scale = self.rope.softmax_factor / math.sqrt(self.nope + self.rope_dim)
        self.q_lora = bool(a.q_lora_rank)
        self.decode_impl = a.decode_impl
        self.rules = sharding_rules(cfg)
        # EG-MLA's parameter-matched control (mla.token_table_dim): a table the block adds at its
        # input (Block.with_token_table), made last so the other parameters draw as without it
        self.token_table = TokenTable(cfg, rngs=rngs) if a.token_table_dim else None
        # DSA's indexer (core=dsa) reads the query latent c' (or h); it draws from its own stream
        self.indexer = indexer_for(cfg, core, q_in, q_axis, rngs)
        self.absorb_training = self.indexer is not None and cfg.dsa.absorb and cfg.dsa.stage == "sparse"

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
        } | self.core.init_state(batch, max_len, *self.gate_space())

    def gate_space(self) -> tuple[int, int]:
        """(heads, width) of the keys a sparse core's gate averages: the absorbed latent and k^R
        (one key for all heads) where W_UK can be absorbed, else the per-head keys."""
        d = self.absorbed_width()
        return (1, d + self.rope_dim) if d else (self.num_heads, self.nope + self.rope_dim)

    def absorbed_width(self) -> int | None:
        """Width of the latent W_UK and W_UV apply to (d_c); None where absorption is impossible."""
        return self.kv_norm.scale.shape[0]

    def latent(self, x, positions):
        """What is cached per token: c [B, S, d_c] and the RoPE key k^R [B, S, d_R]."""
        c = self.kv_norm(self.dkv(x))
        kr = apply_rope(self.kr(x)[:, :, None, :], positions, self.rope)[:, :, 0]
        return c, kr

    def kv_heads(self, c, token_ids):
        """Per-head key (no-RoPE part) [B, S, H, nope] and value [B, S, H, v] from the latent."""
        return self.uk(c), self.uv(c)

    def query_input(self, x):
        """What the query projections read: c' = RMSNorm(W_DQ h) [B, S, q_lora], or h itself."""
        return self.q_norm(self.dq(x)) if self.q_lora else x

    def query(self, q_in, positions):
        """(q_nope [B, S, H, nope], RoPE'd q_rope [B, S, H, d_R]) from `query_input`."""
        q = self.q(q_in)
        return q[..., : self.nope], apply_rope(q[..., self.nope :], positions, self.rope)

    def __call__(self, x, *, positions, segment_ids, token_ids=None):
        q_in = self.query_input(x)
        q_nope, q_rope = self.query(q_in, positions)
        c, kr = self.latent(x, positions)
        # over a context axis what is all-gathered is the latent, the RoPE key (and EG-MLA's
        # token ids), not per-head K/V: each shard expands the whole sequence's from them
        whole = lambda a, axes: None if a is None else constrain(a, ("batch", None, *axes), self.rules)
        c, kr, token_ids = whole(c, ("kv_lora",)), whole(kr, ("head_dim",)), whole(token_ids, ())
        core_args = dict(x=x, q_in=q_in, positions=positions, segment_ids=segment_ids, scale=self.scale)
        lat = self.absorbed_latent({"c": c, "token_ids": token_ids}) if self.absorb_training else None
        if lat is not None:  # DSA's sparse stage as MQA over the latent rows (dsa.absorb)
            q_lat = jnp.einsum("bshn,dhn->bshd", q_nope, self.uk.kernel[...].astype(q_nope.dtype))
            q = constrain(
                jnp.concatenate([q_lat, q_rope.astype(q_lat.dtype)], axis=-1),
                ("batch", "length", "heads", None),
                self.rules,
            )
            keys = jnp.concatenate([lat, kr.astype(lat.dtype)], axis=-1)[:, :, None]  # [B, S, 1, d + d_R]
            out = run_core(self, q, keys, lat[:, :, None], kv_whole=True, **core_args)  # [B, S, H, d]
            return self.o(jnp.einsum("bshd,dhv->bshv", out, self.uv.kernel[...].astype(out.dtype)))
        k_nope, v = self.kv_heads(c, token_ids)
        q = constrain(
            jnp.concatenate([q_nope, q_rope], axis=-1), ("batch", "length", "heads", "head_dim"), self.rules
        )
        keys = self.full_keys(k_nope, kr)
        return self.o(run_core(self, q, keys, v, kv_whole=True, **core_args))

    def full_keys(self, k_nope, kr):
        """Per-head keys [k_nope ; k^R] with the shared RoPE key broadcast to every head."""
        b, s, h, _ = k_nope.shape
        return jnp.concatenate(
            [k_nope, jnp.broadcast_to(kr[:, :, None, :], (b, s, h, self.rope_dim))], axis=-1
        )

    def write_cache(self, cache, rows, positions, c, kr):
        # every axis indexed (the width too), so the write stays an in-place scatter: XLA CPU
        # turns a row scatter at batch 1 into a dynamic-update-slice and copies the cache for
        # each of its readers
        def write(a, x):
            width = jnp.arange(a.shape[-1])[None, None, :]
            return a.at[rows[..., None], positions[..., None], width].set(x.astype(a.dtype))

        return cache | {"c": write(cache["c"], c), "kr": write(cache["kr"], kr)}

    latent_rows_as_cached = True  # absorbed_latent is the cache's c itself (EG-MLA's is recomputed)

    def absorbed_latent(self, cache):
        """The latent that attention can run over with absorbed weights [B, L, d]; None if impossible."""
        return cache["c"]

    def decode(self, x, *, positions, token_ids, cache, absorb: bool = True, prefill: bool = False):
        """New tokens x [B, T, d_model] at `positions` [B, T] -> ([B, T, d_model], cache).

        absorb=True: W_UK folds into the query and W_UV applies after attention, so scores and
        values come straight from the cached latent: q_i.k_s = (W_UK,i^T q_nope,i) . c_s +
        q_rope,i . k^R_s (a sparse core reads only its blocks of the latent: `latent_view`).
        Otherwise per-head K/V of every cached token are rebuilt from the cache (the naive
        path). `prefill`: see `Core`."""
        c, kr = self.latent(x, positions)
        rows = jnp.arange(x.shape[0])[:, None]
        cache = self.write_cache(cache, rows, positions, c, kr)
        q_in = self.query_input(x)
        q_nope, q_rope = self.query(q_in, positions)
        core_args = dict(x=x, q_in=q_in, scale=self.scale, prefill=prefill)
        lat = self.absorbed_latent(cache) if absorb and self.core.causal_only else None
        if lat is not None:
            w_uk, w_uv = self.uk.kernel[...].astype(lat.dtype), self.uv.kernel[...].astype(jnp.float32)
            q_lat = jnp.einsum("bthn,dhn->bthd", q_nope, w_uk)
            out = absorbed_attention(q_lat, q_rope, lat, cache["kr"], positions, self.scale, self.decode_impl)
            out = jnp.einsum("bthd,dhv->bthv", out, w_uv).astype(x.dtype)
            return self.o(out), cache
        sparse_latent = self.absorbed_width() and not self.core.causal_only  # what a sparse core gates on
        latent = self.latent_view(cache, q_nope, q_rope) if sparse_latent else None
        if absorb and latent is not None:  # a sparse core over the latent: MQA in latent space
            out, state = decode_core(self, latent, cache, positions, **core_args)
            out = jnp.einsum("bthd,dhv->bthv", out, self.uv.kernel[...].astype(out.dtype))
        else:
            k_nope, v = self.kv_heads(cache["c"], cache.get("token_ids"))
            head_major = lambda x: jnp.swapaxes(x, 1, 2)  # [B, L, H, D] -> kv_view's [B, H, L, D]
            keys = self.full_keys(k_nope, cache["kr"])
            view = kv_view(jnp.concatenate([q_nope, q_rope], axis=-1), head_major(keys), head_major(v))
            if latent is not None:  # the cache keeps the latent gate's means
                view = view._replace(gate_q=latent.gate_q, gate_keys=latent.gate_keys)
            out, state = decode_core(self, view, cache, positions, **core_args)
        return self.o(out), cache | state

    def latent_view(self, cache, q_nope, q_rope) -> CacheView:
        """The cache as one KV head in latent space: keys [c~ ; k^R] (width d + d_R), values c~,
        queries [W_UK,i^T q_nope,i ; q_rope,i], so that q_i.k_s is the per-head score. Rows are
        expanded to c~ only where read (gathered blocks, a completed block, the prompt)."""
        q_lat = jnp.einsum("bthn,dhn->bthd", q_nope, self.uk.kernel[...].astype(q_nope.dtype))
        q = jnp.concatenate([q_lat, q_rope], axis=-1)
        parts = [name for name in ("c", "token_ids") if name in cache]

        def rows(slots):  # slots [B, N] -> keys [B, N, 1, d + d_R], values [B, N, 1, d]
            lat = self.absorbed_latent({name: take_slots(cache[name], slots) for name in parts})
            keys = jnp.concatenate([lat, take_slots(cache["kr"], slots).astype(lat.dtype)], axis=-1)
            return keys[:, :, None], lat[:, :, None]

        def fetch(starts, size):  # [B, T, H, nb] -> [B, T, H, nb, size, width]
            slots = (starts[..., None] + jnp.arange(size)).reshape(starts.shape[0], -1)
            return tuple(x.reshape(*starts.shape, size, x.shape[-1]) for x in rows(slots))

        def prompt(t):
            return rows(jnp.broadcast_to(jnp.arange(t), (q.shape[0], t)))

        return CacheView(
            q=q,
            gate_q=q,
            length=cache["c"].shape[1],
            full=lambda: tuple(jnp.swapaxes(x, 1, 2) for x in prompt(cache["c"].shape[1])),  # one head
            prompt=prompt,
            fetch=fetch,
            gate_keys=lambda slots: rows(slots)[0],
            latent=(cache["c"], cache["kr"]) if self.latent_rows_as_cached else None,
        )
