"""MoBA (Mixture of Block Attention): the op, its dense oracle and the dispatch by impl.

Semantics: docs/moba.md. The gate is `effattn_jax.ops.routing.moba_routing`,
the one routing every implementation uses. `moba_attention` is the single
dispatch point: reference (dense mask, the oracle), xla (sub-quadratic,
exact; ops/moba_xla.py) or the Pallas kernels (pallas_kernels/moba).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from effattn_jax.config import MOBA_IMPLS
from effattn_jax.ops.context_parallel import context_attention, context_shards, query_positions
from effattn_jax.ops.dense import masked_attention
from effattn_jax.ops.moba_xla import moba_xla, moba_xla_local
from effattn_jax.ops.platform import resolve_impl
from effattn_jax.ops.routing import Routing, moba_routing
from effattn_jax.ops.segments import block_starts
from effattn_jax.sharding import Rules, shard_over_batch_heads
from pallas_kernels import gpu_memory

# re-exported: the model's remat policy and the attention registry reach the kernels only through ops
from pallas_kernels.moba.schedule import SCHEDULE_NAME as SCHEDULE_NAME
from pallas_kernels.moba.schedule import BlockSizes as BlockSizes


def routing_kernel_for(impl: str, kernel: str | None, q, k) -> str | None:
    """The routing kernel (ops/routing.py, routing_kernel) a MoBA `impl` gates with, resolve_impl's
    `kernel` being its attention kernel backend: TPU's on TPU; on a GPU what gpu_dispatch.choose
    answers for the "moba_routing" family (None: XLA)."""
    if kernel not in ("gpu", "mosaic", "triton"):
        return kernel  # None (XLA, the reference) or "tpu"
    from pallas_kernels import gpu_dispatch
    from pallas_kernels.moba.routing_mgpu import supports

    checks = {"mosaic": lambda: supports(q, k.dtype, k.shape[1]), "triton": lambda: None}
    choice = gpu_dispatch.choose("moba_routing", impl, checks)
    return None if choice.kernel is None else f"gpu_{choice.kernel}"


def gpu_kernels(impl: str, block_sizes: BlockSizes, q, v, *, block_size: int) -> tuple[str, str | None]:
    """(attention kernels, routing kernel or None: XLA) that `impl` runs on a GPU for q [B, S, Hq, D]
    and v [B, S, Hkv, Dv] (arrays or ShapeDtypeStructs): ValueError, one line, where a named kernel
    cannot take them (pallas_kernels/gpu_dispatch.py)."""
    from pallas_kernels.moba.parts import gpu_kernels_for

    kernel = resolve_impl(impl, "gpu")[1]
    shape = dict(head_dim=q.shape[-1], v_head_dim=v.shape[-1], itemsize=q.dtype.itemsize)
    sizes = block_sizes.resolve("gpu", block_size=block_size, **shape)
    attention = gpu_kernels_for(kernel, sizes, q, v, block_size=block_size)
    return attention, routing_kernel_for(impl, kernel, q, q)


def gpu_tiles_fit(
    block_sizes: BlockSizes, *, block_size: int, head_dim: int, v_head_dim: int, itemsize: int, device=None
) -> str:
    """Checks MoBA's GPU kernel tiles against the shared memory of `device` (a CUDA device; None:
    this process's GPU, else an H100/H200) before anything compiles: ValueError, one line naming
    the moba.* keys and a set that fits, when over; else one line saying what the tiles resolved
    to and their largest kernel."""
    limit, name = gpu_memory.device_limit(device)
    shape = dict(head_dim=head_dim, v_head_dim=v_head_dim, itemsize=itemsize)
    sizes = block_sizes.resolve("gpu", block_size=block_size, smem_limit=limit, **shape)
    sizes.check_backend("gpu", block_size, smem_limit=limit, device=name, **shape)
    kernel, need = sizes.gpu_smem(head_dim, v_head_dim, itemsize)
    return f"{sizes.tiles_text()}: {kernel} asks about {need:,} of {limit:,} bytes on {name}"


def check_args(q, k, v, block_size, top_k, segment_ids, impl):
    if not (isinstance(block_size, int) and block_size > 0):
        raise ValueError(f"block_size must be a positive int, got {block_size!r}")
    if not (isinstance(top_k, int) and top_k >= 1):
        raise ValueError(f"top_k must be an int >= 1, got {top_k!r}")
    if impl not in MOBA_IMPLS:
        raise ValueError(f"impl must be one of {MOBA_IMPLS}, got {impl!r}")
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise ValueError(f"q, k, v must be [batch, seq, heads, dim]; got q{q.shape} k{k.shape} v{v.shape}")
    if k.shape != v.shape[:3] + (k.shape[3],) or q.shape[:2] != k.shape[:2] or q.shape[3] != k.shape[3]:
        raise ValueError(
            f"shapes do not match: q{q.shape} k{k.shape} v{v.shape} "
            "(q/k share batch, seq, head_dim; k/v share batch, seq, heads)"
        )
    if q.shape[2] % k.shape[2]:
        raise ValueError(f"kv heads ({k.shape[2]}) must divide q heads ({q.shape[2]})")
    if segment_ids is not None and segment_ids.shape != q.shape[:2]:
        raise ValueError(f"segment_ids must be [batch, seq] = {q.shape[:2]}, got {segment_ids.shape}")


def moba_reference_mask(routing: Routing, *, block_size: int, segment_ids=None) -> jax.Array:
    """[B, Hq, S, S] bool: which keys each query attends to under this routing (dense: the oracle)."""
    b, s, hq, _ = routing.past_start.shape
    bs = block_starts(segment_ids, b, s, block_size)  # [B, S] block start of each key
    own = (bs[:, None, :] == routing.own_start[:, :, None]) & (jnp.tril(jnp.ones((s, s), bool))[None])
    past = (bs[:, None, None, :, None] == jnp.moveaxis(routing.past_start, 2, 1)[:, :, :, None, :]).any(-1)
    return own[:, None] | past


def moba_reference(q, k, v, routing: Routing, *, block_size: int, segment_ids=None, scale=None):
    """Dense-mask O(S^2) MoBA, written for clarity: the oracle for every other implementation."""
    mask = moba_reference_mask(routing, block_size=block_size, segment_ids=segment_ids)
    return masked_attention(q, k, v, mask, scale)


def moba_attention(
    q,
    k,
    v,
    *,
    block_size: int,
    top_k: int,
    segment_ids=None,
    scale=None,
    impl: str = "auto",
    block_sizes: BlockSizes | None = None,
    routing_chunk: int = 512,
    rules: Rules | None = None,
    kv_whole: bool = False,
):
    """MoBA attention. q [B, S, Hq, D], k [B, S, Hkv, D], v [B, S, Hkv, Dv] -> [B, S, Hq, Dv] in q's dtype.

    `scale` defaults to 1/sqrt(D). impl: "reference" (dense mask), "xla"
    (sub-quadratic), "pallas" / "pallas_tpu" / "pallas_gpu" (kernels; see
    `resolve_impl`; on a GPU the kernels pallas_kernels/gpu_dispatch.py chooses: those a GPU has
    verified, else the Triton attention kernels and XLA's routing), "pallas_mosaic" /
    "pallas_triton" (those GPU kernels, or one line on why not), "auto".
    `block_sizes`: tile sizes of the kernels (all fields) and of the XLA path (past_q_tile);
    `auto` fields are chosen per backend, head dim, dtype and device (BlockSizes.resolve).
    `routing_chunk`: queries per chunk of gate scores. `rules`: logical sharding rules; under a
    context mesh the kernels run per (batch, head) shard through shard_map. Over a `context` axis (q, k, v in
    the balanced layout) the XLA path or the kernels run per shard; `kv_whole`: see
    `context_attention`.
    """
    check_args(q, k, v, block_size, top_k, segment_ids, impl)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    block_sizes = block_sizes or BlockSizes()
    if context_shards() > 1:
        path, kernel, interpret = resolve_impl(impl)
        if path == "reference":
            raise ValueError("moba impl='reference' does not run over a context axis; use xla")

        def local(q, k, v, q_seg, k_seg, firsts):  # a shard's queries, every block's keys
            q_index = query_positions(firsts, q.shape[1] // len(firsts), q.shape[0])
            r = moba_routing(
                q, k, block_size=block_size, top_k=top_k, segment_ids=k_seg,
                query_chunk=routing_chunk, q_index=q_index, kernel=routing_kernel_for(impl, kernel, q, k),
                interpret=interpret,
            )  # fmt: skip
            if path == "pallas":
                from pallas_kernels.moba.context import moba_pallas_local

                key_starts = block_starts(k_seg, k.shape[0], k.shape[1], block_size)
                return moba_pallas_local(
                    q, k, v, r.own_start, r.past_start, key_starts, firsts, block_size, float(scale),
                    kernel, interpret, block_sizes,
                )  # fmt: skip
            return moba_xla_local(
                q, k, v, r, firsts=firsts, block_size=block_size, segment_ids=k_seg, scale=scale,
                q_tile=block_sizes.resolve("xla").past_q_tile,
            )  # fmt: skip

        return context_attention(local, q, k, v, segment_ids, rules, kv_whole)
    path, kernel, interpret = resolve_impl(impl)
    route = lambda q, k, seg: moba_routing(
        q, k, block_size=block_size, top_k=top_k, segment_ids=seg, query_chunk=routing_chunk,
        kernel=routing_kernel_for(impl, kernel, q, k), interpret=interpret,
    )  # fmt: skip
    if path == "pallas":
        from pallas_kernels.moba.attention import moba_pallas  # Pallas is imported only when used

        def run(q, k, v, seg):  # per shard: routing is per batch row and head, so it shards too
            r = route(q, k, seg)
            return moba_pallas(
                q, k, v, r.own_start, r.past_start, block_size, float(scale), kernel, interpret, block_sizes
            )

        return shard_over_batch_heads(run, q, k, v, segment_ids, rules)
    routing = route(q, k, segment_ids)
    if path == "reference":
        return moba_reference(q, k, v, routing, block_size=block_size, segment_ids=segment_ids, scale=scale)
    return moba_xla(
        q,
        k,
        v,
        routing,
        block_size=block_size,
        segment_ids=segment_ids,
        scale=scale,
        q_tile=block_sizes.resolve("xla").past_q_tile,
    )
