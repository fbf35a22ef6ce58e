"""One-line notices at the start of training for settings that run, but not as a user may think:
kernels interpreted on a device that is not theirs, a MoBA top-k that selects every block."""

from __future__ import annotations

from effattn_jax.config import Config
from effattn_jax.ops.platform import resolve_impl, target_backend


def start_notices(cfg: Config) -> list[str]:
    if not cfg.uses_moba:
        return []
    lines = []
    _, kernel, interpret = resolve_impl(cfg.moba.impl)
    if interpret:
        lines.append(
            f"notice: moba.impl={cfg.moba.impl} runs the {kernel} kernels interpreted on this "
            f"{target_backend()} (correct but slow: a test of the kernels, not a way to train)"
        )
    blocks = -(-cfg.data.seq_len // cfg.moba.block_size)
    if cfg.moba.top_k >= blocks:
        lines.append(
            f"notice: moba.top_k={cfg.moba.top_k} covers all {blocks} blocks of a {cfg.data.seq_len}-token "
            "row: every query sees every earlier key (causal attention, at MoBA's cost)"
        )
    return lines
