"""Model FLOP accounting (sparsity-aware).

Training FLOPs per token = 6 * (matmul params, output head included) plus the
attention score and value matmuls: per layer and query head, 2 * d_qk FLOPs
per attended key for q.k and 2 * d_v for p.v, times 3 for forward + backward.
The widths are the layer kind's: MHA d_qk = d_v = head_dim; MLA and EG-MLA
d_qk = qk_nope + qk_rope and d_v = v_head_dim. Keys attended are averaged over
the positions of a full-length row: t + 1 for dense causal attention; for MoBA
the own block's causal part plus min(top_k - 1, earlier blocks) full blocks.
The MoBA gate (S * blocks * D per head) is not counted: it is small next to the
attention, and the papers do not count it either. DSA attends min(index_topk, t + 1) keys
(every visible key in its warm-up stage) and its indexer is counted, as it is not small: 2 * Hi *
Di FLOPs per visible key for the selection's scores (forward only, no gradient), and as much per
key of its KL loss (the selected keys, or every visible one in the warm-up) times 3.
Compute for scaling laws, in PFLOP/s-days (1 PFLOP/s-day = 8.64e19 FLOP), is one of
COMPUTE_MEASURES: `full`, the training FLOPs above (every matmul, the output head and
attention at its real key count included), or `6nd`, the papers' 6 * N * D with N the
non-embedding parameters, which at small sizes leaves out most of the work.
"""

from __future__ import annotations

from effattn_jax.config import Config

PFLOPS_DAY = 8.64e19
COMPUTE_MEASURES = ("full", "6nd")
# Peak dense bf16 FLOP/s of one device (vendors' data sheets), MFU's denominator: (a fragment of
# jax's device_kind, peak), the first fragment found wins
PEAK_BF16_FLOPS = (
    ("H100 PCIe", 756e12),
    ("H100", 989e12),  # SXM
    ("H200", 989e12),
    ("A100", 312e12),
    ("TPU v4", 275e12),
    ("TPU v5 lite", 197e12),  # v5e
    ("TPU v5", 459e12),  # v5p
    ("TPU v6 lite", 918e12),  # v6e
)


def peak_flops(device_kind: str) -> float | None:
    """Peak dense bf16 FLOP/s of a device of this kind, None when not in PEAK_BF16_FLOPS (a CPU)."""
    return next((peak for fragment, peak in PEAK_BF16_FLOPS if fragment in device_kind), None)


def mean_attended_keys(seq_len: int, core: str, block_size: int = 0, top_k: int = 0) -> float:
    """Keys a query attends to, averaged over the positions of a full-length row (DSA: `top_k` is
    dsa.index_topk)."""
    if core == "dense":
        return (seq_len + 1) / 2
    if core == "dsa":
        return sum(min(top_k, t + 1) for t in range(seq_len)) / seq_len
    c = block_size
    total = sum(t % c + 1 + min(top_k - 1, t // c) * c for t in range(seq_len))
    return total / seq_len


def attention_widths(cfg: Config, kind: str) -> tuple[int, int]:
    """(d_qk, d_v): the per-head widths of the score and value matmuls of a layer kind."""
    if kind == "mha":
        return cfg.head_dim, cfg.head_dim
    return cfg.mla.qk_nope_head_dim + cfg.mla.qk_rope_head_dim, cfg.mla.v_head_dim


def absorbed_latent_width(cfg: Config, kind: str) -> int:
    """The width of the latent `dsa.absorb` attends over: c (MLA) or EG-MLA's gated c~."""
    if kind == "mla":
        return cfg.mla.kv_lora_rank
    return cfg.eg_mla.projected_dim if cfg.eg_mla.gate_at == "projected" else cfg.eg_mla.gate_dim


def attention_flops_per_token(cfg: Config) -> float:
    """Score and value matmul FLOPs of one training token (forward + backward), all layers."""
    attn, indexer, dsa, s = 0.0, 0.0, cfg.dsa, cfg.data.seq_len
    for layer in range(cfg.model.num_layers):
        kind, core = cfg.layer_spec(layer)
        d_qk, d_v = attention_widths(cfg, kind)
        if core == "dsa" and dsa.absorb and dsa.stage == "sparse":  # scores and values over the latent
            d_v = absorbed_latent_width(cfg, kind)
            d_qk = d_v + cfg.mla.qk_rope_head_dim
        if core == "dsa":
            keys = mean_attended_keys(s, "dense" if dsa.stage == "warmup" else "dsa", top_k=dsa.index_topk)
            per_key = 2 * dsa.index_n_heads * dsa.index_head_dim
            indexer += per_key * (mean_attended_keys(s, "dense") + 3 * keys)
        else:
            keys = mean_attended_keys(s, core, cfg.moba.block_size, cfg.moba.top_k)
        attn += 2 * (d_qk + d_v) * cfg.model.num_heads * keys
    return 3.0 * attn + indexer


def train_flops_per_token(cfg: Config, non_embedding_params: int) -> float:
    """Model FLOPs of one training token (forward + backward) under this config's cores; after a
    MoBA -> dense switch, pass `cfg.with_full_attention()`."""
    head = cfg.model.d_model * cfg.model.vocab_size  # output projection (tied or not, it is a matmul)
    return 6.0 * (non_embedding_params + head) + attention_flops_per_token(cfg)


def pflops_days(non_embedding_params: int, tokens: float) -> float:
    return 6.0 * non_embedding_params * tokens / PFLOPS_DAY


def run_pflops_days(cfg: Config, non_embedding_params: int, step: int, *, compute: str = "full") -> float:
    """Training compute of a run up to `step` (COMPUTE_MEASURES); with `full`, the steps after a
    MoBA -> dense switch count as dense."""
    if compute not in COMPUTE_MEASURES:
        raise ValueError(f"compute={compute!r}: allowed: {', '.join(COMPUTE_MEASURES)}")
    tokens_per_step = cfg.data.batch_size * cfg.data.seq_len
    if compute == "6nd":
        return pflops_days(non_embedding_params, step * tokens_per_step)
    switch = cfg.full_attention_from_step or step
    before, after = min(step, switch), max(step - switch, 0)
    flops = (
        train_flops_per_token(cfg, non_embedding_params) * before
        + train_flops_per_token(cfg.with_full_attention(), non_embedding_params) * after
    )
    return flops * tokens_per_step / PFLOPS_DAY
