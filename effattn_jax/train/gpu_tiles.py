"""MoBA's GPU kernel tiles against a GPU's shared memory, for a config: checked when `train.py`
starts on a GPU and in a dry run, before anything compiles (pallas_kernels/gpu_memory.py)."""

from __future__ import annotations

import jax.numpy as jnp

from effattn_jax.attention import moba_block_sizes
from effattn_jax.config import Config, ConfigError
from effattn_jax.flops import attention_widths
from effattn_jax.ops.moba import gpu_tiles_fit


def check_moba_gpu_tiles(cfg: Config, device=None) -> list[str]:
    """Refuses (ConfigError, one line) MoBA tiles whose GPU kernels would ask `device` (a CUDA
    device; None: this process's GPU, else an H100/H200) for more shared memory per block than
    it has, for each (kind, core=moba) layer's head dims; else one line per layer kind on what
    they resolved to."""
    kinds = {cfg.layer_spec(i)[0] for i in range(cfg.model.num_layers) if cfg.layer_spec(i)[1] == "moba"}
    lines = []
    for kind in sorted(kinds):
        d_qk, d_v = attention_widths(cfg, kind)
        try:
            fit = gpu_tiles_fit(
                moba_block_sizes(cfg),
                block_size=cfg.moba.block_size,
                head_dim=d_qk,
                v_head_dim=d_v,
                itemsize=jnp.dtype(cfg.model.dtype).itemsize,
                device=device,
            )
        except ValueError as e:
            tiles = "/".join(str(getattr(cfg.moba, k)) for k in ("q_tile", "kv_block", "past_q_tile"))
            raise ConfigError("moba.q_tile/kv_block/past_q_tile", tiles, f"{kind} layers: {e}") from None
        lines.append(f"{kind} layers: {fit}")
    return lines
