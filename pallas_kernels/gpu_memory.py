"""Shared memory per block on a GPU: what a Pallas -> Triton kernel will ask for, estimated before
anything compiles, and what the device allows. A kernel over the limit fails only when it first
runs (RESOURCE_EXHAUSTED, no fallback), so the tiles are checked against this first.

The estimate (`triton_smem`) counts the operand tiles of a kernel's dots, the way Triton places
them: a tile loaded before the loop stays in shared memory for the loop (once); a tile loaded in
every loop step is multi-buffered by the software pipeline (`num_stages` buffers) when the dot is a
Hopper warpgroup MMA (64 rows or more), one buffer otherwise; a tile computed in registers feeds
its dot from registers, except a transposed one (dK/dV's p^T and dS^T), which goes through shared
memory (one tile at a time); and the [rows, 1] vectors a loop step loads (own starts, lse, delta)
each take a small buffer. It is calibrated against every request measured on an H200
(tests/test_gpu_memory.py lists them): the requests it reproduces exactly, the rest within 3 %.
Beside it, the device's multiprocessor count, which the split decode kernels fill.
"""

from __future__ import annotations

# Shared memory one block may opt into, by CUDA compute capability (bytes)
SMEM_LIMITS = {
    "8.0": 166_912,  # A100
    "8.6": 101_376,  # RTX 30xx, A10, A40
    "8.9": 101_376,  # L4, L40, RTX 40xx
    "9.0": 232_448,  # H100, H200
    "10.0": 232_448,  # B200
}
DEFAULT_CAPABILITY = "9.0"  # what the GPU tiles are chosen for when no GPU is at hand (an AOT export)
WGMMA_ROWS = 64  # a Hopper warpgroup MMA's rows: smaller dots run mma.sync, not pipelined here


def smem_limit(capability: str | None = None) -> int:
    """The per-block limit of a compute capability ("9.0"); an unknown one gets the smallest known,
    so a tile set chosen for it fits anywhere."""
    if capability is None:
        capability = DEFAULT_CAPABILITY
    return SMEM_LIMITS.get(capability, min(SMEM_LIMITS.values()))


def device_limit(device=None) -> tuple[int, str]:
    """(per-block limit, the device named in words) of a CUDA device (default: this process's
    first device); any other device, e.g. the CPU of an AOT export, gets an H100/H200's."""
    import jax

    device = device or jax.devices()[0]
    capability = getattr(device, "compute_capability", None) if device.platform == "gpu" else None
    if capability is None:
        return smem_limit(), f"an H100/H200 (compute capability {DEFAULT_CAPABILITY})"
    return smem_limit(capability), f"{device.device_kind} (compute capability {capability})"


DEFAULT_MULTIPROCESSORS = 132  # an H100/H200 SXM's: what work is split for without a GPU at hand


def multiprocessors(device=None) -> int:
    """Streaming multiprocessors of `device` (default: this process's first device), which a split
    decode kernel fills; anything but a GPU (an AOT export for CUDA, an interpreted run) gets
    DEFAULT_MULTIPROCESSORS."""
    import jax

    device = device or jax.devices()[0]
    count = getattr(device, "core_count", None) if device.platform == "gpu" else None
    return int(count) if count else DEFAULT_MULTIPROCESSORS


def tile(rows: int, cols: int, itemsize: int) -> int:
    return rows * cols * itemsize


def triton_smem(
    *,
    invariant: list[int],
    streamed: list[int],
    mma_rows: int,
    stages: int,
    transposed: list[int] = (),
    row_vectors: list[int] = (),
) -> int:
    """Bytes of shared memory a kernel asks for (the model in the module docstring): `invariant`
    dot operand tiles loaded before the loop, `streamed` ones loaded every step, `transposed`
    register tiles fed to a dot transposed, `row_vectors` the [rows, 1] loads of a step (bytes
    each); `mma_rows` the rows of the kernel's dots."""
    buffers = stages if mma_rows >= WGMMA_ROWS else 1
    return sum(invariant) + buffers * sum(streamed) + max(transposed, default=0) + sum(row_vectors)


def flash_smem(q_rows: int, kv_rows: int, d: int, dv: int, itemsize: int, stages: int, dkv_vectors: int):
    """(forward, dq, dK/dV) bytes of a flash-attention kernel triple (the MoBA GPU kernels):
    forward and dq hold `q_rows` queries (dq: and their dO) and stream K/V sub-blocks of `kv_rows`;
    dK/dV holds a sub-block's keys and values, streams query tiles (q, dO and `dkv_vectors` row
    vectors) and feeds p^T and dS^T to its dots."""
    t = lambda rows, cols: tile(rows, cols, itemsize)
    kv, q = [t(kv_rows, d), t(kv_rows, dv)], [t(q_rows, d)]
    return (
        triton_smem(invariant=q, streamed=kv, mma_rows=q_rows, stages=stages),
        triton_smem(invariant=q + [t(q_rows, dv)], streamed=kv, mma_rows=q_rows, stages=stages),
        triton_smem(
            invariant=kv,
            streamed=q + [t(q_rows, dv)],
            transposed=[t(q_rows, kv_rows)],
            row_vectors=[4 * q_rows] * dkv_vectors,
            mma_rows=kv_rows,
            stages=stages,
        ),
    )


def moba_smem(q_tile: int, past_q_tile: int, kv_block: int, stages: int, d: int, dv: int, itemsize: int):
    """Each MoBA GPU kernel's bytes, by kernel name: the own-block kernels (moba/gpu_own.py, `q_tile`
    query rows; a dK/dV step loads lo, lse and delta) and the whole-block kernels (moba/gpu_blocks.py,
    `past_q_tile` rows; lse and delta)."""
    own = flash_smem(q_tile, kv_block, d, dv, itemsize, stages, dkv_vectors=3)
    block = flash_smem(past_q_tile, kv_block, d, dv, itemsize, stages, dkv_vectors=2)
    names = [f"moba_{kernels}_{part}_gpu" for kernels in ("own", "block") for part in ("fwd", "dq", "dkv")]
    return dict(zip(names, own + block, strict=True))
