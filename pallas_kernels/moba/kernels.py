"""Which modules run the two parts of a MoBA call, per kernel backend, and what each must provide.
pallas_kernels/registry.py registers these loaders as ("moba", "attention", backend).

A kernel backend is "tpu" (tpu_own.py, tpu_blocks.py), "triton" (gpu_own.py, gpu_blocks.py) or
"mosaic" (mgpu_own.py, mgpu_blocks.py); what each part's module must provide is its protocol
(`OwnKernels`, `BlockKernels`, and `ShapeChecked` for those gpu_dispatch asks before choosing).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class OwnKernels(Protocol):
    """The own block's kernels (each backend's own argument names: the TPU's work in chunks of the
    block, the GPU's in tiles of queries)."""

    own_tables: Callable[..., tuple]  # own_start [B, S] -> the tables the two entries take after K, V
    own_attention_fwd: Callable[..., tuple]  # -> (o float32, lse)
    own_attention_bwd: Callable[..., tuple]  # -> (dq, dK, dV)


@runtime_checkable
class BlockKernels(Protocol):
    """The selected earlier blocks' kernels, over the schedule's tiles (schedule.past_tiles)."""

    window_starts: Callable[..., Any]  # each group's first key of its window
    block_attention_fwd: Callable[..., tuple]  # -> (o rows float32, lse rows)
    block_attention_bwd: Callable[..., tuple]  # -> (dq tiles, dK, dV)


@runtime_checkable
class ShapeChecked(Protocol):
    """Kernels that say which shapes they take (the Mosaic GPU ones: gpu_dispatch asks first)."""

    supports: Callable[..., str | None]  # None where they run, else one line on why not


@dataclasses.dataclass(frozen=True)
class Kernels:
    """The modules one MoBA call runs: the own block's and the selected blocks'."""

    own: OwnKernels
    blocks: BlockKernels


def tpu() -> Kernels:
    from pallas_kernels.moba import tpu_blocks, tpu_own

    return Kernels(tpu_own, tpu_blocks)


def triton() -> Kernels:
    from pallas_kernels.moba import gpu_blocks, gpu_own

    return Kernels(gpu_own, gpu_blocks)


def mosaic() -> Kernels:
    from pallas_kernels.moba import mgpu_blocks, mgpu_own

    return Kernels(mgpu_own, mgpu_blocks)
