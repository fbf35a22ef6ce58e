"""Model FLOP accounting (sparsity-aware).

Training FLOPs per token = 6 * (matmul params, output head included) plus the
attention score/value matmuls, 6 * 2 * heads * head_dim * (keys a query attends
to) per layer. Keys attended are averaged over the positions of a full-length
row: t + 1 for dense causal attention; for MoBA the own block's causal part
plus min(top_k - 1, earlier blocks) full blocks.
Compute for scaling laws follows the papers: 6 * N * D with N the non-embedding
parameters, in PFLOP/s-days (1 PFLOP/s-day = 8.64e19 FLOP).
"""

from __future__ import annotations

PFLOPS_DAY = 8.64e19


def mean_attended_keys(seq_len: int, core: str, block_size: int = 0, top_k: int = 0) -> float:
    if core == "dense":
        return (seq_len + 1) / 2
    c = block_size
    total = sum(t % c + 1 + min(top_k - 1, t // c) * c for t in range(seq_len))
    return total / seq_len


def train_flops_per_token(cfg, non_embedding_params: int) -> float:
    from effattn_jax.attention import layer_spec

    m = cfg.model
    head = m.d_model * m.vocab_size  # output projection (tied or not, it is a matmul)
    keys = sum(
        mean_attended_keys(cfg.data.seq_len, layer_spec(cfg, i)[1], cfg.moba.block_size, cfg.moba.top_k)
        for i in range(m.num_layers)
    )
    attn = 2 * m.num_heads * cfg.head_dim * keys
    return 6.0 * (non_embedding_params + head) + 6.0 * attn


def pflops_days(non_embedding_params: int, tokens: float) -> float:
    return 6.0 * non_embedding_params * tokens / PFLOPS_DAY
