"""DSA's selection on GPU (Pallas -> Triton): the lightning indexer's scores and each query's top-k
in one kernel, the [T, S] scores never in memory (docs/dsa.md; `effattn_jax.ops.dsa.dsa_select`
is the XLA selection it equals).

A Triton program has no VMEM-sized row to keep a query's scores in, so it scores them again on
each pass instead: one program per (batch row, query) finds the k-th largest score exactly by a
radix search over the scores' order-preserving 32-bit keys, RADIX_BITS a pass, most significant
first. A pass scores the query's visible keys CHUNK at a time (q [Hi, Di] against a chunk of k on
the tensor cores, ReLU, the weighted sum over heads) and counts, among the keys whose higher bits
equal the prefix found so far, how many hold each value of the pass's digit (a one-hot [CHUNK,
2^RADIX_BITS] summed over the chunk). The largest digit with enough keys at or above it extends
the prefix. After 32 / RADIX_BITS passes the prefix is the k-th key, and a last pass writes the
keys above it and the earliest of those equal to it (ties to the earlier key, as `lax.top_k`), in
key order, at running offsets (a prefix sum over each chunk). So the scoring runs
32 / RADIX_BITS + 1 times: 5 at 8 bits; the counting costs 2^RADIX_BITS compares a key a pass. A
query with at most top_k visible keys (a document's first top_k tokens; every query of a shorter
document) picks them all: it scores once, to write them. Every pass starts at the first chunk
with a key of the query's document (found, with the count of its visible keys, from the documents
alone), so a packed row costs its documents' lengths, not its own.

The picks and their scores come out in key order, -1 (and -inf) past them; the wrapper orders them
best first (`best_first`, as the TPU selection does).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.common import NT, triton_params
from pallas_kernels.dsa import best_first, query_documents

CHUNK = 32  # keys scored per loop step
RADIX_BITS = 8  # the digit a pass decides (32 / RADIX_BITS passes)
MIN_ROWS = 16  # the smallest M and K of a tensor-core dot
WARPS = 4
INT_MIN = -(2**31)


def _sortable(scores):
    """float32 scores (no NaN) -> int32 keys in the same order (signed)."""
    bits = jax.lax.bitcast_convert_type(scores, jnp.int32)
    return jnp.where(bits >= 0, bits, bits ^ jnp.int32(0x7FFFFFFF))


def _int32(bits: int) -> int:
    """A 32-bit pattern as the int32 of the same bits."""
    return bits - (1 << 32) if bits >= 1 << 31 else bits


def _kernel(q_ref, w_ref, k_ref, seg_ref, pos_ref, qseg_ref, picks_ref, scores_ref, *, top_k, chunk, bits):
    b, t = pl.program_id(0), pl.program_id(1)
    q, w = q_ref[...], w_ref[...][:, None]  # [Hi', Di'], [Hi', 1] (the scale folded in)
    pos, doc = pos_ref[b, t], qseg_ref[b, t]  # the query's position among the keys, its document
    chunks = pos // chunk + 1  # the chunks with a key at or before the query
    lane = jnp.arange(chunk, dtype=jnp.int32)
    bins = jnp.arange(1 << bits, dtype=jnp.int32)

    def score(c):
        """Chunk c's keys: scores [chunk] float32, -inf where not visible, and which are visible."""
        keys = k_ref[b, pl.ds(c * chunk, chunk), :]  # [chunk, Di']
        dots = jax.lax.dot_general(q, keys, NT, preferred_element_type=jnp.float32)  # [Hi', chunk]
        s = jnp.sum(jnp.maximum(dots, 0.0) * w, axis=0)
        visible = (c * chunk + lane <= pos) & (seg_ref[b, pl.ds(c * chunk, chunk)] == doc)
        return jnp.where(visible, s, -jnp.inf), visible

    def count_visible(c, carry):  # from the documents alone, no scoring: how many, from which chunk
        n, first = carry
        seen = jnp.sum(
            ((c * chunk + lane <= pos) & (seg_ref[b, pl.ds(c * chunk, chunk)] == doc)).astype(jnp.int32)
        )
        return n + seen, jnp.where((seen > 0) & (first == chunks), c, first)

    visible_keys, first = jax.lax.fori_loop(0, chunks, count_visible, (jnp.int32(0), chunks))
    want = rank = jnp.minimum(visible_keys, top_k)  # rank: the k-th key's among those matching prefix
    every = visible_keys <= top_k  # every visible key is picked: no search (a document's first K)
    passes = jnp.where(every, first, chunks)  # the search's chunks: first .. passes - 1
    # the unsigned key (sortable ^ INT_MIN) is found digit by digit: prefix holds its decided bits
    prefix = jnp.int32(0)
    for p in range(32 // bits):
        shift = 32 - bits * (p + 1)
        decided = _int32((0xFFFFFFFF << (shift + bits)) & 0xFFFFFFFF)  # the bits above this digit

        def count(c, hist, prefix=prefix, shift=shift, decided=decided):
            s, visible = score(c)
            key = _sortable(s) ^ jnp.int32(INT_MIN)
            match = visible & ((key & decided) == prefix)
            digit = jax.lax.shift_right_logical(key, shift) & ((1 << bits) - 1)
            onehot = (digit[:, None] == bins[None, :]) & match[:, None]
            return hist + jnp.sum(onehot.astype(jnp.int32), axis=0)

        hist = jax.lax.fori_loop(first, passes, count, jnp.zeros((1 << bits,), jnp.int32))
        at_or_above = jnp.sum(hist) - jnp.cumsum(hist) + hist  # keys with a digit >= each bin
        digit = jnp.sum((at_or_above >= rank).astype(jnp.int32)) - 1  # the largest bin reaching rank
        rank = rank - jnp.sum(jnp.where(bins > digit, hist, 0))
        prefix = prefix | jnp.left_shift(digit, shift)
    kth = prefix ^ jnp.int32(INT_MIN)  # the k-th key, signed; `rank` of the keys equal to it are picked

    def write(c, carry):
        written, equal_seen = carry
        s, visible = score(c)
        key = _sortable(s)
        equal = (visible & (key == kth)).astype(jnp.int32)
        equal_before = equal_seen + jnp.cumsum(equal) - equal
        picked = visible & (every | (key > kth) | ((equal > 0) & (equal_before < rank)))
        taken = picked.astype(jnp.int32)
        slot = written + jnp.cumsum(taken) - taken
        pltriton.store(picks_ref.at[b, t, slot], c * chunk + lane, mask=picked)
        pltriton.store(scores_ref.at[b, t, slot], s, mask=picked)
        return written + jnp.sum(taken), equal_seen + jnp.sum(equal)

    jax.lax.fori_loop(first, chunks, write, (jnp.int32(0), jnp.int32(0)))
    slots = picks_ref.shape[-1]

    def fill(j, carry):  # the slots past the picks (`want` of them were written)
        slot = j * chunk + lane
        empty = (slot >= want) & (slot < slots)
        pltriton.store(picks_ref.at[b, t, slot], jnp.full((chunk,), -1, jnp.int32), mask=empty)
        pltriton.store(scores_ref.at[b, t, slot], jnp.full((chunk,), -jnp.inf, jnp.float32), mask=empty)
        return carry

    jax.lax.fori_loop(want // chunk, pl.cdiv(slots, chunk), fill, None)


def index_topk_gpu(
    q_idx, k_idx, weights, *, top_k: int, segment_ids=None, scale=None, q_index=None, interpret=False
):  # fmt: skip
    """`dsa_select`'s contract: q_idx [B, T, Hi, Di], k_idx [B, S, Di], weights [B, T, Hi], the
    queries at positions `q_index` [B, T] among the keys (default: T = S, in order) -> indices
    [B, T, K'] int32, K' = min(top_k, S), best first (ties to the earlier key), -1 past a query's
    visible keys."""
    q_idx, k_idx, weights = (jax.lax.stop_gradient(x) for x in (q_idx, k_idx, weights))
    b, t, hi, di = q_idx.shape
    s = k_idx.shape[1]
    kk = min(top_k, s)
    scale = 1.0 / math.sqrt(hi * di) if scale is None else scale
    hp, dp = (max(MIN_ROWS, pl.next_power_of_2(n)) for n in (hi, di))
    sp = pl.cdiv(s, CHUNK) * CHUNK
    # zero heads and widths add nothing (ReLU(0) = 0, weight 0); keys past S are never visible
    q = jnp.pad(q_idx, ((0, 0), (0, 0), (0, hp - hi), (0, dp - di)))
    w = jnp.pad(weights.astype(jnp.float32) * scale, ((0, 0), (0, 0), (0, hp - hi)))
    k = jnp.pad(k_idx.astype(q_idx.dtype), ((0, 0), (0, sp - s), (0, dp - di)))
    seg, pos, q_seg = query_documents(segment_ids, q_index, b, t, s)
    seg = jnp.pad(seg, ((0, 0), (0, sp - s)), constant_values=-1)
    whole = pl.no_block_spec
    picks, scores = pl.pallas_call(
        functools.partial(_kernel, top_k=kk, chunk=CHUNK, bits=RADIX_BITS),
        grid=(b, t),
        in_specs=[
            pl.BlockSpec((None, None, hp, dp), lambda n, t: (n, t, 0, 0)),
            pl.BlockSpec((None, None, hp), lambda n, t: (n, t, 0)),
            whole,
            whole,
            whole,
            whole,
        ],
        out_specs=[whole, whole],
        out_shape=[
            jax.ShapeDtypeStruct((b, t, kk), jnp.int32),
            jax.ShapeDtypeStruct((b, t, kk), jnp.float32),
        ],
        compiler_params=triton_params(num_warps=WARPS),
        interpret=bool(interpret),
        name="dsa_index_topk_gpu",
    )(q, w, k, seg, pos, q_seg)
    return best_first(picks, scores)
