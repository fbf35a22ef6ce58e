"""MoBA decoding over a KV cache (XLA): the gate reads cached block means, attention reads
only the selected blocks, so a step costs top_k * block_size keys plus one dot product per
block, not the whole context.

The cache holds, beside K and V (or MLA's latent), `block_means` [B, L // C, Hg, Dg] float32:
the mean gate key of every complete block, written when the token that completes a block
arrives (from that block's C cached keys, rounded to the compute dtype as the training gate
rounds it), so no step re-reads the context. A row is one document whose tokens sit at
positions 0, 1, ... of the cache; every decode call writes contiguous positions [B, T]. Slots
a right-padded prompt filled with padding lie in blocks that are only complete once the row's
own tokens have overwritten them, and the block's mean is taken then.

What is read goes through a `CacheView` (ops/cache.py), so an attention kind can gather its own
cache (MHA: K/V rows; MLA: latent rows, expanded only where gathered).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from effattn_jax.ops.cache import CacheView
from effattn_jax.ops.platform import resolve_impl
from effattn_jax.ops.routing import block_means, top_k_first


def empty_block_means(batch: int, max_len: int, kv_heads: int, head_dim: int, block_size: int) -> jax.Array:
    """[B, L // C, Hkv, D] float32 zeros: a block that is never complete needs no slot."""
    return jnp.zeros((batch, max_len // block_size, kv_heads, head_dim), jnp.float32)


def prefill_block_means(means, gate_keys, length: int, *, block_size: int, dtype) -> jax.Array:
    """The means after a prefill that wrote positions [0, length) of every row; `gate_keys`
    [B, length, Hg, Dg] are the prompt's gate keys."""
    b, _, hg, dg = gate_keys.shape
    n = min(length // block_size, means.shape[1])
    blocks = gate_keys[:, : n * block_size].reshape(b, n, block_size, hg, dg)
    return means.at[:, :n].set(block_means(blocks, dtype))


def update_block_means(means, gate_keys, positions, *, block_size: int, dtype) -> jax.Array:
    """The means after a call that wrote the contiguous `positions` [B, T]: every block those
    positions complete gets its mean, from `gate_keys(slots [B, N])` -> [B, N, Hg, Dg] of its C
    slots (nothing else is read)."""
    b, t = positions.shape
    c, n = block_size, means.shape[1]
    if n == 0:
        return means
    touched = min(n, 1 if t == 1 else (t - 1) // c + 2)  # blocks a run of t positions can overlap
    blocks = positions[:, :1] // c + jnp.arange(touched)  # [B, touched]
    complete = (blocks + 1) * c - 1 <= positions[:, -1:]

    def take_means():
        slots = jnp.minimum(blocks, n - 1)[:, :, None] * c + jnp.arange(c)  # [B, touched, C]
        keys = gate_keys(slots.reshape(b, -1))
        fresh = block_means(keys.reshape(b, touched, c, *keys.shape[2:]), dtype)
        # an incomplete block is left as it is; a block past the cache's last full one is dropped
        return means.at[jnp.arange(b)[:, None], jnp.where(complete, blocks, n)].set(fresh, mode="drop")

    # a single-token step completes a block once every C steps: the other steps read nothing
    return jax.lax.cond(complete.any(), take_means, lambda: means)


def moba_decode_attention(
    view: CacheView, means, positions, *, block_size: int, top_k: int, scale, impl: str = "xla"
):
    """The view's queries at `positions` [B, T] -> [B, T, Hq, Dv]. The training semantics
    (docs/moba.md): each query head takes the top (top_k - 1) complete blocks strictly before
    its own by the unscaled float32 gate (ties to the earlier block) plus its own block
    causally. Only those blocks are fetched from the cache. `impl` (as `moba.impl`): where it
    resolves to a kernel, a single-token step over a plain K/V cache runs
    `pallas_kernels/moba/{tpu,gpu,mgpu}_decode.py` where the kernel takes the shape (TPU: cache
    length and block multiples of 32; GPU: what `gpu_decode_choice` answers); everything else runs
    XLA."""
    starts, lo, hi, size = select_blocks(view, means, positions, block_size=block_size, top_k=top_k)
    kernel = decode_kernel(view, size, impl)
    if kernel is not None:
        tables = (x[:, 0] for x in (starts, lo, hi))
        return kernel(view.q[:, 0], *view.caches, *tables, size, float(scale))[:, None]
    return attend_blocks(view, starts, lo, hi, size, scale)


def decode_kernel(view: CacheView, size: int, impl: str):
    """The Pallas decode step `impl` resolves to for this view and block, or None (XLA)."""
    _, kernel, interpret = resolve_impl(impl)
    if kernel is None or view.caches is None or view.q.shape[1] != 1:
        return None
    from pallas_kernels import registry

    if kernel == "tpu":
        from pallas_kernels.moba import tpu_decode

        if not tpu_decode.fits(view.length, size):
            return None
    else:
        kernel = gpu_decode_choice(impl, view, size).kernel
    if kernel is None:
        return None
    return functools.partial(registry.kernel("moba", "decode", kernel), interpret=interpret)


def gpu_decode_choice(impl: str, view: CacheView, size: int):
    """gpu_dispatch.choose for a single-token step over a K/V cache in blocks of `size` slots: the
    Mosaic GPU kernel (mgpu_decode.supports, q in the caches' dtype), the Triton one (a power-of-two
    block), or XLA."""
    from pallas_kernels import gpu_dispatch
    from pallas_kernels.moba import mgpu_decode

    k, v = view.caches

    def mosaic():
        reason = mgpu_decode.supports(
            head_dim=k.shape[-1], v_head_dim=v.shape[-1], size=size, length=k.shape[2], dtype=k.dtype
        )
        if reason is None and not view.q.dtype == k.dtype == v.dtype:
            reason = f"q and the K/V caches must share a dtype, got {view.q.dtype}, {k.dtype}, {v.dtype}"
        return reason

    def triton():
        return (
            None
            if size & (size - 1) == 0
            else f"the Triton decode kernel needs a power-of-two block, got {size}"
        )

    shape = dict(batch=view.q.shape[0], length=view.length)
    return gpu_dispatch.choose("moba_decode", impl, {"mosaic": mosaic, "triton": triton}, shape=shape)


def select_blocks(view: CacheView, means, positions, *, block_size: int, top_k: int):
    """(starts, lo, hi, size): each query head's blocks [B, T, Hq, 1 + k'] (its own first, then
    its picks best first) as `size` cache slots from `starts`, of which slots lo..hi count
    (the own block up to the query; an unused pick has hi < lo)."""
    b, t, hq, _ = view.q.shape
    length, n = view.length, means.shape[1]
    size = min(block_size, length)
    own = positions // block_size  # [B, T] own block index
    # the own block's window, moved back where a short cache ends inside it
    first = jnp.minimum(own * block_size, length - size)
    column = lambda x: jnp.broadcast_to(x[..., None, None], (b, t, hq, 1))
    starts, lo, hi = [column(first)], [column(own * block_size)], [column(positions)]
    kk = min(top_k - 1, n)
    if kk > 0:
        hg, dg = means.shape[2:]
        qg = view.gate_q.astype(jnp.float32).reshape(b, t, hg, hq // hg, dg)
        scores = jnp.einsum("btkgd,bnkd->btkgn", qg, means).reshape(b, t, hq, n)  # one dot per block
        candidate = jnp.arange(n) < own[..., None]  # [B, T, n]: complete blocks before the own one
        scores = jnp.where(candidate[:, :, None], scores, -jnp.inf)
        picks = jnp.minimum(jnp.stack(top_k_first(scores, kk), axis=-1), n - 1)  # [B, T, Hq, k']
        real = jnp.arange(kk) < candidate.sum(-1)[:, :, None, None]  # fewer candidates than k'
        starts.append(picks * block_size)
        lo.append(picks * block_size)
        hi.append(jnp.where(real, picks * block_size + block_size - 1, -1))
    # computed once, not inside the gathers (XLA would fuse the top-k into every gathered element)
    return *jax.lax.optimization_barrier(tuple(jnp.concatenate(x, axis=-1) for x in (starts, lo, hi))), size


def attend_blocks(view: CacheView, starts, lo, hi, size: int, scale):
    """Softmax attention of each (row, query, head) over its blocks' valid slots (XLA): one
    batch of single-query attentions over (1 + k') * size fetched keys each."""
    q = view.q
    b, t, hq, d = q.shape
    slots = starts[..., None] + jnp.arange(size)  # [B, T, Hq, blocks, size]
    valid = ((slots >= lo[..., None]) & (slots <= hi[..., None])).reshape(b, t, hq, -1)
    m = b * t * hq
    keys, values = view.fetch(starts, size)
    keys, values = keys.reshape(m, -1, d), values.reshape(m, valid.shape[-1], -1)
    logits = jnp.einsum("md,mcd->mc", q.reshape(m, d), keys, preferred_element_type=jnp.float32)
    logits = jnp.where(valid, logits.reshape(b, t, hq, -1) * scale, -jnp.inf)
    weights = jax.nn.softmax(logits, axis=-1).reshape(m, -1)
    out = jnp.einsum("mc,mcd->md", weights, values.astype(jnp.float32), preferred_element_type=jnp.float32)
    return out.reshape(b, t, hq, -1).astype(q.dtype)
