"""MoBA's GPU kernels for a config, checked before anything compiles: when `train.py` starts with a
GPU kernel impl (on a GPU, or interpreted on a CPU) and in a dry run (for an H100/H200 on a host
without a GPU). Which kernels run (pallas_kernels/gpu_dispatch.py: a named kernel that cannot take
the config is refused), then their tiles against the GPU's shared memory
(pallas_kernels/gpu_memory.py). A refusal is a ConfigError: one line naming the keys."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from effattn_jax.attention import moba_block_sizes
from effattn_jax.config import Config, ConfigError
from effattn_jax.flops import attention_widths
from effattn_jax.ops.moba import gpu_kernels, gpu_tiles_fit
from effattn_jax.ops.platform import resolve_impl

TILE_KEYS = "moba.q_tile/kv_block/past_q_tile"


def runs_gpu_kernels(impl: str, backend: str | None = None) -> bool:
    """Whether a moba.impl runs the GPU kernels on `backend` (default: this process's)."""
    return resolve_impl(impl, backend)[1] in ("gpu", "mosaic", "triton")


def check_gpu_kernels(cfg: Config, device=None, *, interpret: bool = False) -> list[str]:
    """For each (kind, core=moba) layer kind: the MoBA attention and routing kernels `moba.impl` runs
    on `device` (a CUDA device; None: this process's GPU, else an H100/H200), and, compiled
    (`interpret` False), their tiles against its shared memory. ConfigError (one line) where a named
    kernel cannot take the config or the tiles cannot fit; else one line per layer kind on what runs."""
    kinds = {cfg.layer_spec(i)[0] for i in range(cfg.model.num_layers) if cfg.layer_spec(i)[1] == "moba"}
    impl, sizes, block = cfg.moba.impl, moba_block_sizes(cfg), cfg.moba.block_size
    dtype = jnp.dtype(cfg.model.dtype)
    lines = []
    for kind in sorted(kinds):
        d_qk, d_v = attention_widths(cfg, kind)
        heads = cfg.model.num_heads
        q = jax.ShapeDtypeStruct((1, cfg.data.seq_len, heads, d_qk), dtype)
        v = jax.ShapeDtypeStruct((1, cfg.data.seq_len, heads, d_v), dtype)
        shape = dict(head_dim=d_qk, v_head_dim=d_v, itemsize=dtype.itemsize)
        try:
            attention, routing = gpu_kernels(impl, sizes, q, v, block_size=block)
        except ValueError as e:
            raise ConfigError("moba.impl", impl, f"{kind} layers: {e}") from None
        try:
            if interpret:
                resolved = sizes.resolve("gpu", block_size=block, **shape)
                resolved.check_backend("gpu", block, compiler=False)
                tiles = resolved.tiles_text()
            else:
                tiles = gpu_tiles_fit(sizes, block_size=block, device=device, **shape)
        except ValueError as e:
            values = "/".join(str(getattr(cfg.moba, k)) for k in ("q_tile", "kv_block", "past_q_tile"))
            raise ConfigError(TILE_KEYS, values, f"{kind} layers: {e}") from None
        routing = (routing or "xla").removeprefix("gpu_")
        lines.append(f"{kind} layers: {attention} attention kernels, {routing} routing; {tiles}")
    return lines
