"""What every kernel here shares (MoBA and MLA decode, TPU and GPU): dot dimension numbers,
the TPU tile alignment, the interpret-mode switch, Triton's compiler parameters, the target GPU of
a lowering without one, the cost estimate of an attention pass, the merge of a split decode's
partial results, and the chunks of picks a DSA kernel loops over."""

from __future__ import annotations

import jax.numpy as jnp

NT = (((1,), (1,)), ((), ()))  # dot_general dimension numbers for a @ b.T
TN = (((0,), (0,)), ((), ()))  # ... and for a.T @ b

ALIGN = 32  # a multiple of the sublane tile of any dtype down to 8 bits (sublane_tile)


def sublane_tile(dtype) -> int:
    """Rows of a TPU (8, 128) tile of 32-bit words in this dtype: 8 float32, 16 bf16, 32 for 8 bits.
    A copy whose rows start at a multiple of it starts on a whole tile."""
    return 32 // jnp.dtype(dtype).itemsize


def tpu_vmem_limit(blocks: int, scratch: int, temporaries: int) -> int:
    """`vmem_limit_bytes` for a TPU kernel step: its blocks double-buffered, its scratch and its
    float32 temporaries (estimated by the kernel), never below Mosaic's default scoped limit of
    16 MiB. A MoBA block of 4,096 needs 20-40 MiB, under the 64 MiB of a v5p core."""
    return max(2 * blocks + scratch + temporaries, 16 << 20)


def mosaic_gpu_interpret(interpret):
    """plgpu.kernel's `interpret` for the Mosaic GPU kernels: an InterpretGPUParams is used as given
    (e.g. `detect_races=True`), True runs the GPU interpreter, False compiles (None)."""
    from jax.experimental.pallas import mosaic_gpu as plgpu  # imported only for the Mosaic GPU kernels

    if isinstance(interpret, plgpu.InterpretGPUParams):
        return interpret
    return plgpu.InterpretGPUParams() if interpret else None


def tpu_interpret(interpret):
    """pallas_call's `interpret` for the TPU kernels: "tpu" runs the TPU interpreter
    (`pltpu.InterpretParams()`: DMAs, semaphores, TPU memory on CPU), an InterpretParams is
    used as given (e.g. `detect_races=True`), anything else is a plain bool."""
    from jax.experimental.pallas import tpu as pltpu  # imported only for the TPU kernels

    if isinstance(interpret, pltpu.InterpretParams):
        return interpret
    return pltpu.InterpretParams() if interpret == "tpu" else bool(interpret)


TRITON_WARPS, TRITON_STAGES = 4, 2  # the GPU kernels' defaults (`moba.num_warps`, `moba.num_stages`: auto)


def triton_params(num_warps: int = TRITON_WARPS, num_stages: int = TRITON_STAGES):
    """Compiler parameters of the GPU kernels (Pallas -> Triton). `num_stages` is the software
    pipeline's depth: the buffers of each tile a loop step loads (pallas_kernels/gpu_memory.py)."""
    from jax.experimental.pallas import triton as pltriton

    return pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def gpu_lowering_target(device_kind: str = "NVIDIA H200"):
    """A context in which the GPU kernels lower for CUDA on a machine without a GPU (`jax.export` with
    `platforms=["cuda"]`): Pallas's Triton lowering takes the compute capability from this abstract
    device (jax >= 0.11 raises without one). An H200, the GPU suite's, by default."""
    import jax

    device = jax.sharding.AbstractDevice(device_kind=device_kind, num_cores=None, platform="gpu")
    return jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), (), abstract_device=device))


def attention_cost(pairs: int, qk_dim: int, v_dim: int, bytes_read: int):
    """The `pl.CostEstimate` of an attention pass over `pairs` (query, key) pairs that reads
    `bytes_read` of cache: a score and a weighted value per pair, one exp per pair."""
    from jax.experimental import pallas as pl

    return pl.CostEstimate(
        flops=2 * pairs * (qk_dim + v_dim), transcendentals=pairs, bytes_accessed=bytes_read
    )


def combine_partials(out, m, l, axis: int):
    """Attention over the union of key sets from each set's normalised output `out` (its feature
    axis last), softmax maximum `m` and sum `l` (out's shape without the feature axis), the sets
    along `axis`: each set weighted by its share of the whole softmax sum (flash-decoding's
    combine). A set with no keys (m = -inf, l = 0) weighs nothing; one set at least must have keys."""
    weight = l * jnp.exp(m - jnp.max(m, axis=axis, keepdims=True))
    total = jnp.sum(weight, axis=axis)
    return jnp.sum(weight[..., None] * out, axis=axis) / total[..., None]


def used_chunks(idx, chunk: int):
    """[B, T, 1] int32 from picks idx [B, T, K] (-1: none): the chunks of `chunk` picks up to each
    query's last pick (at least 1); the DSA kernels loop over those only, so a query with few picks
    (early in its document, or decoding a short context) reads no chunk of unused ones."""
    last = jnp.max(jnp.where(idx >= 0, jnp.arange(idx.shape[-1]), 0), axis=-1, keepdims=True)
    return (last // chunk + 1).astype(jnp.int32)


def smem_row_length(n: int) -> int:
    """A length of at least n that a 1-D block of int32 in a Mosaic kernel may take: a power of two
    of at least 128 below 1024, else a multiple of 1024 (a query's picks, flat in SMEM)."""
    if n <= 1024:
        return max(128, 1 << (n - 1).bit_length())
    return -(-n // 1024) * 1024
