"""The one MoBA gate (docs/moba.md, items 1-5), shared by every implementation so
they cannot drift apart: the XLA path, the Pallas kernels and decoding.

Blocks of `block_size` tokens are cut per document (segment), starting at the
document's first token. Query t attends causally to its own block and to the
top (top_k - 1) *earlier* blocks of its document, scored by <q_t, mean(K[block])>
with the unscaled post-RoPE query in float32; ties go to the earlier block.
Every query head routes on its own (GQA without copying K/V).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from effattn_jax.ops.segments import document_positions


class Routing(NamedTuple):
    """Where each query looks. Shapes: own_start [B, S]; past_start [B, S, Hq, k'] with
    k' = min(top_k - 1, blocks - 1), -1 marking an unused slot (fewer earlier blocks than k')."""

    own_start: jax.Array  # first position of the query's own block
    past_start: jax.Array  # first positions of its selected earlier (full) blocks


def moba_routing(
    q,
    k,
    *,
    block_size: int,
    top_k: int,
    segment_ids=None,
    query_chunk: int = 512,
    q_index=None,
    kernel: str | None = None,
    interpret=False,
) -> Routing:
    """The one MoBA gate. q [B, T, Hq, D], k [B, S, Hkv, D]; blocks follow `segment_ids` [B, S];
    the queries are the keys' positions `q_index` [B, T] (default: T = S, all of them in order;
    context parallelism gives a shard's queries); no gradient flows through it. (Decoding gates
    against cached block means with the same selection: ops/moba_decode.py.)
    Cost: T * blocks * D per head (the gate): block means computed once (S * D), then each
    query chunk against all of them as one matmul, masked and reduced to its top k' within the
    chunk; no [T, S] array, no per-query copy of the means, no [T, blocks] scores at once.
    `kernel`: None selects in XLA (here); "tpu", "gpu_triton" or "gpu_mosaic" in that Pallas kernel
    (`routing_kernel`), which keeps each query
    tile's scores on chip, from the same candidates, scores and tie rule; `interpret` runs it
    interpreted (CPU).
    """
    select_in_kernel = routing_kernel(kernel)  # None: here, in XLA
    q, k = jax.lax.stop_gradient(q), jax.lax.stop_gradient(k)
    b, t, hq, d = q.shape
    s, hkv = k.shape[1], k.shape[2]
    c = block_size
    n = -(-s // c)
    kk = min(top_k - 1, n - 1)
    pos = document_positions(segment_ids, b, s)
    doc_start = jnp.arange(s, dtype=jnp.int32)[None] - pos  # [B, S]
    own_block = pos // c  # index of the own block inside the document
    own_start = doc_start + own_block * c
    if q_index is not None:  # the queries' rows of the keys' tables
        doc_start, own_start = (jnp.take_along_axis(x, q_index, axis=1) for x in (doc_start, own_start))
    if kk <= 0:
        return Routing(own_start, jnp.zeros((b, t, hq, 0), jnp.int32))

    starts, means = _full_block_means(k, None if segment_ids is None else pos, c)  # [B, n'], [B, n', Hkv, D]
    if select_in_kernel is not None:
        past = select_in_kernel(
            q, starts, means, doc_start, own_start, kk, seq=s, key_dtype=k.dtype, interpret=interpret
        )
        return Routing(own_start, past)
    chunk = min(query_chunk, t)
    pad = -t % chunk
    by_chunk = lambda x, fill: jnp.moveaxis(
        jnp.pad(x, ((0, 0), (0, pad)) + ((0, 0),) * (x.ndim - 2), constant_values=fill).reshape(
            b, -1, chunk, *x.shape[2:]
        ),
        1,
        0,
    )  # [B, T, ...] -> [T / chunk, B, chunk, ...]

    def select(args):
        """One query chunk: gate scores against every block mean (one matmul), masked to the
        full blocks of the query's document strictly before its own block, then their top k'
        in one pass (ties go to the earlier block). The scores of the whole sequence never
        exist at once."""
        qc, lo, hi = args  # [B, Tc, Hq, D], [B, Tc], [B, Tc]
        qc = qc.astype(jnp.float32).reshape(b, chunk, hkv, hq // hkv, d)
        scores = jnp.einsum("btkgd,bnkd->btkgn", qc, means).reshape(b, chunk, hq, -1)  # [B, Tc, Hq, n']
        candidate = (starts[:, None, :] >= lo[:, :, None]) & (starts[:, None, :] < hi[:, :, None])
        scores = jnp.where(candidate[:, :, None, :], scores, -jnp.inf)
        count = candidate.sum(-1)[:, :, None]  # [B, Tc, 1]: candidates of each query
        picks = []
        for i, pick in enumerate(top_k_first(scores, kk)):  # [B, Tc, Hq] block indices, best first
            start = jnp.take_along_axis(starts, jnp.minimum(pick, starts.shape[1] - 1).reshape(b, -1), axis=1)
            picks.append(jnp.where(count > i, start.reshape(pick.shape), -1))
        return jnp.stack(picks, axis=-1).astype(jnp.int32)  # [B, Tc, Hq, k']

    chosen = jax.lax.map(select, (by_chunk(q, 0), by_chunk(doc_start, 0), by_chunk(own_start, 0)))
    return Routing(own_start, jnp.moveaxis(chosen, 0, 1).reshape(b, -1, hq, kk)[:, :t])


GPU_ROUTING_KERNELS = ("gpu_triton", "gpu_mosaic")  # the GPU kernels by name (ops/moba.py chooses one)


def routing_kernel(kernel: str | None):
    """The Pallas selection for a routing kernel name, or None: the gate selects in XLA. "gpu_triton":
    pallas_kernels/moba/routing_gpu.py; "gpu_mosaic": routing_mgpu.py (Mosaic GPU, bf16/f16); "tpu":
    routing_tpu.py. Which one a MoBA impl runs: ops/moba.py, routing_kernel_for."""
    if kernel in GPU_ROUTING_KERNELS:
        return functools.partial(_gpu_selection, backend=kernel.removeprefix("gpu_"))
    if kernel == "tpu":
        from pallas_kernels import registry  # Pallas is imported only when used

        return registry.kernel("moba", "routing", "tpu")
    if kernel is not None:
        raise ValueError(
            f"routing kernel must be None, 'tpu' or one of {GPU_ROUTING_KERNELS}, got {kernel!r}"
        )
    return None


def _gpu_selection(q, starts, means, lo, hi, picks, *, seq, key_dtype, interpret=False, backend):
    from pallas_kernels import registry
    from pallas_kernels.moba import routing_mgpu

    if backend == "mosaic" and (reason := routing_mgpu.supports(q, key_dtype, seq)):
        raise ValueError(reason)
    select = registry.kernel("moba", "routing", backend)
    return select(q, starts, means, lo, hi, picks, seq=seq, key_dtype=key_dtype, interpret=interpret)


def top_k_first(scores, k: int) -> list[jax.Array]:
    """Indices of the k best entries along the last axis, best first, ties to the lower index:
    one variadic reduction carrying a sorted (value, index) list of length k, so the scores
    are read once (a sort or k argmax passes read them k times or more)."""
    n = scores.shape[-1]
    idx = jax.lax.broadcasted_iota(jnp.int32, scores.shape, scores.ndim - 1)
    empty = (jnp.full(scores.shape, -jnp.inf, scores.dtype), jnp.full(scores.shape, n, jnp.int32))
    operands = [(scores, idx)] + [empty] * (k - 1)
    init = [(jnp.array(-jnp.inf, scores.dtype), jnp.array(n, jnp.int32))] * k

    def merge(a, b):
        """The k best of two best-first lists."""
        cand = list(a) + list(b)
        better = lambda x, y: (x[0] > y[0]) | ((x[0] == y[0]) & (x[1] < y[1]))
        rank = [
            sum(better(y, x).astype(jnp.int32) for j, y in enumerate(cand) if j != i)
            for i, x in enumerate(cand)
        ]
        out = []
        for m in range(k):
            v, i = -jnp.inf, n  # a missing entry (fewer than k candidates)
            for x, r in zip(reversed(cand), reversed(rank), strict=True):
                v, i = jnp.where(r == m, x[0], v), jnp.where(r == m, x[1], i)
            out.append((v, i))
        return out

    best = jax.lax.reduce(operands, init, merge, (scores.ndim - 1,))
    return [i for _, i in best]


def _full_block_means(k, doc_pos, block_size: int):
    """(starts [B, n'], means [B, n', Hkv, D] float32) of every full block of `block_size` keys,
    in position order; n' = S // block_size bounds their number (full blocks do not overlap).
    Only a full block can be a candidate (a block with a later block in its document is full).
    Unused slots start at S, after every query. Keys are summed per block in float32 and the
    mean is rounded to k's dtype, as the kernels would hold it. `doc_pos` [B, S]: in-document
    positions of packed documents; None: one document per row (blocks at multiples of c)."""
    b, s, hkv, d = k.shape
    c = block_size
    n = s // c
    if doc_pos is None:
        starts = jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32) * c, (b, n))
        blocks = k[:, : n * c].reshape(b, n, c, hkv, d)
    else:
        # a full block starts at an in-document multiple of c whose document still has c tokens
        last = jnp.pad(doc_pos, ((0, 0), (0, c - 1)), constant_values=-1)[:, c - 1 :]  # position at p + c - 1
        full = (doc_pos % c == 0) & (last == doc_pos + c - 1)
        starts = jax.vmap(lambda f: jnp.nonzero(f, size=n, fill_value=s)[0])(full).astype(jnp.int32)
        rows = jnp.minimum(starts[:, :, None] + jnp.arange(c), s - 1).reshape(b, n * c)  # [B, n' c]
        blocks = jnp.take_along_axis(k, rows[:, :, None, None], axis=1).reshape(b, n, c, hkv, d)
    return starts, block_means(blocks, k.dtype)


def block_means(blocks, dtype) -> jax.Array:
    """[B, n, C, Hkv, D] keys -> [B, n, Hkv, D] float32 means, rounded to `dtype` as a kernel
    holding them in the compute dtype would. Summed in float32 by a matmul of 8 rows of ones
    (one row would do): a one-row product, like `jnp.sum(..., dtype=float32)`, becomes a
    reduce, and libtpu then makes a float32 copy of the keys (1 GiB at 128K, 16 KV heads);
    8 rows stay a matmul that reads the keys as they are (BENCHMARKS.md)."""
    b, n, c, h, d = blocks.shape
    ones = jnp.ones((8, c), blocks.dtype)
    sums = jnp.einsum(
        "rc,bncx->bnrx", ones, blocks.reshape(b, n, c, h * d), preferred_element_type=jnp.float32
    )
    return (sums[:, :, 0].reshape(b, n, h, d) / c).astype(dtype).astype(jnp.float32)
