"""MoBA with Pallas kernels over a whole sequence: schedule -> kernels -> log-sum-exp merge, as a
custom_vjp, assembled from parts.py (shared with a context shard's path, context.py).

Forward: the own block runs through the backend's own-block kernel (TPU: tpu_own.py, chunks
of the sequence; GPU: tiles of queries, Triton's gpu_own.py or Mosaic GPU's mgpu_own.py, as
gpu_dispatch chooses) and the selected earlier blocks through its whole-block kernel
(tpu_blocks.py, gpu_blocks.py or mgpu_blocks.py), each giving (o, lse) per (query, part); the
parts of a query are merged by log-sum-exp into the output O and the global LSE L. Backward
(docs/moba.md, "Backward"): with delta = rowsum(dO * O), each part's gradient is an ordinary
flash-attention backward against the global L, so the backward kernels run over the same
schedule, each writing its part once; one XLA pass then gathers dq's parts, and dK/dV's on
GPU (on TPU the selected blocks' kernel adds its dK/dV into the own part's in place).
On TPU the kernels read q, K, V and dO where they lie when a head is whole 128-lane tiles
(`parts.reads_in_place`); otherwise, and on GPU, through head-major copies.

`interpret=False` compiles for the backend's hardware, so the block sizes are
checked against what that compiler accepts (`BlockSizes.check_backend`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from pallas_kernels.moba.parts import (
    KernelCall,
    combine_dq,
    layout,
    merge,
    own_backward,
    own_forward,
    past_backward,
    past_forward,
    past_schedule,
)
from pallas_kernels.moba.schedule import SCHEDULE_NAME


def moba_pallas(
    q, k, v, own_start, past_start, block_size, scale, backend, interpret, block_sizes, *, kernels=None
):
    """MoBA attention from a routing (own_start [B, S], past_start [B, S, Hq, K']) -> [B, S, Hq, Dv].

    The selected blocks' schedule is built here, outside the custom_vjp, and named
    SCHEDULE_NAME (jax.checkpoint_name) with own_start: the backward takes it as it is, and a
    remat policy that saves the name (the model's) does not build it again when it recomputes
    the forward. The schedule is integers (no gradient), and its sort, scatters and gathers
    are slow to compile on TPU (BENCHMARKS.md). `block_sizes`: the tiles (`auto` fields are
    chosen here: KernelCall.fitted). `kernels` (kernels.Kernels): other modules to run than the
    backend's registered ones."""
    call = KernelCall.fitted(
        block_sizes,
        q,
        v,
        block_size=block_size,
        scale=scale,
        backend=backend,
        interpret=interpret,
        kernels=kernels,
    )
    past = past_schedule(past_start, hkv=k.shape[2], call=call)
    own_start, past = checkpoint_name((own_start, past), SCHEDULE_NAME)
    return _scheduled(q, k, v, own_start, past, call)


def forward(q, k, v, own_start, past, call: KernelCall):
    """(out [B, S, Hq, Dv], lse [B, S, Hq]); past: the selected blocks' schedule
    (schedule.PastTiles), None when top_k = 1."""
    b, s, hq, _ = q.shape
    qf, lay = layout(q, k, v, call)
    o_own, lse_own = own_forward(call, q, lay, own_start)
    if past is None:
        return lay.back(o_own, b, s, hq), lse_own
    o_rows, l_rows = past_forward(call, qf, lay, past)
    own = lambda start, size: (
        lay.chunk(o_own, start, size, b, hq),
        jax.lax.dynamic_slice_in_dim(lse_own, start, size, axis=1),
    )
    return merge(own, past, o_rows, l_rows, (b, s, hq), q.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _scheduled(q, k, v, own_start, past, call):
    return _fwd(q, k, v, own_start, past, call)[0]


def _fwd(q, k, v, own_start, past, call):
    out, lse = forward(q, k, v, own_start, past, call)
    # the rounded output is also the residual: delta = rowsum(dO * O), as in flash attention
    out = out.astype(q.dtype)
    return out, (q, k, v, own_start, past, out, lse)


def _bwd(call, res, d_out):
    """Each part's kernels give its gradients; dq is then one pass that gathers its parts, a
    chunk of positions at a time. dK/dV: on TPU the selected blocks' kernel adds each group's
    sum into the own part's dK/dV in place; on GPU one fused pass gathers them too (no
    zero-filled float32 arrays or scatter-adds on either)."""
    q, k, v, own_start, past, out, lse = res
    b, s, hq, d = q.shape
    hkv = k.shape[2]
    qf, lay = layout(q, k, v, call)
    do = d_out.astype(jnp.float32)
    delta = jnp.sum(do * out.astype(jnp.float32), axis=-1).reshape(-1)  # [B*S*Hq]
    dq, dk, dv = own_backward(call, q, lay, own_start, d_out, lse, delta)
    if past is None:
        dq = lay.back(dq, b, s, hq)
    else:
        # q gathered again, not shared with the forward's gather, whose output would otherwise
        # stay live across the forward's merge: one more gather for less peak memory
        # (BENCHMARKS.md, "History")
        flat = (
            jax.lax.optimization_barrier(qf),
            d_out.reshape(-1, d_out.shape[-1]).astype(lay.v.dtype),
            lse.reshape(-1),
            delta,
        )
        dq_t, dk, dv = past_backward(call, flat, lay, past, dk, dv, own_start)
        dq_own = dq
        own_dq = lambda start, size: lay.chunk(dq_own, start, size, b, hq)
        dq = combine_dq(own_dq, past, dq_t.reshape(-1, d), (b, s, hq), q.dtype)
    if call.backend == "tpu":
        dk, dv = lay.back(dk, b, s, hkv), lay.back(dv, b, s, hkv)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None, None


_scheduled.defvjp(_fwd, _bwd)
