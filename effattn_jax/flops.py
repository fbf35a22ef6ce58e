"""Model FLOP accounting.

Training FLOPs per token = 6 * (matmul params, output head included) plus the
attention score/value matmuls: 6 * 2 * layers * heads * head_dim * context,
where a causal query sees on average (seq_len + 1) / 2 keys (dense core).
Compute for scaling laws follows the papers: 6 * N * D with N the non-embedding
parameters, in PFLOP/s-days (1 PFLOP/s-day = 8.64e19 FLOP).
"""

from __future__ import annotations

PFLOPS_DAY = 8.64e19


def train_flops_per_token(cfg, non_embedding_params: int) -> float:
    m = cfg.model
    head = m.d_model * m.vocab_size  # output projection (tied or not, it is a matmul)
    context = (cfg.data.seq_len + 1) / 2
    attn = 2 * m.num_layers * m.num_heads * cfg.head_dim * context
    return 6.0 * (non_embedding_params + head) + 6.0 * attn


def pflops_days(non_embedding_params: int, tokens: float) -> float:
    return 6.0 * non_embedding_params * tokens / PFLOPS_DAY
