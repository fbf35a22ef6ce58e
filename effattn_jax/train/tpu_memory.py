"""MoBA's TPU kernels against a TPU core's fast memories, for a config and a compiled train step:
the scalar-prefetched tables in SMEM and the scoped VMEM each kernel call asks for."""

from __future__ import annotations

from effattn_jax.attention import moba_block_sizes
from effattn_jax.config import Config
from pallas_kernels.moba.tpu_smem import CallTables, moba_call_tables


def moba_tpu_tables(cfg: Config, mesh_sizes: dict[str, int]) -> list[CallTables]:
    """The MoBA TPU kernel calls of one layer's train step on one chip, with the largest call's
    SMEM tables, from the config and the mesh's axis sizes (arithmetic, nothing traced)."""
    context, tensor = mesh_sizes.get("context", 1), mesh_sizes.get("tensor", 1)
    sizes = moba_block_sizes(cfg).resolve("tpu")
    return moba_call_tables(
        batch=max(1, cfg.data.batch_size // (mesh_sizes.get("data", 1) * mesh_sizes.get("fsdp", 1))),
        queries=cfg.data.seq_len // context,
        key_len=cfg.data.seq_len,
        q_heads=max(1, cfg.model.num_heads // tensor),
        kv_heads=max(1, cfg.num_kv_heads // tensor),
        block_size=cfg.moba.block_size,
        top_k=cfg.moba.top_k,
        past_q_tile=sizes.past_q_tile,
        runs=2 if context > 1 else 1,
    )
