"""The decode cache as the attention cores read it, whatever the kind and core: a `CacheView`
(what a decode call attends over), the view of a plain K/V cache, slot gathers, and the cache
length a decode kernel takes."""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp

from pallas_kernels.common import ALIGN


def cache_length(tokens: int) -> int:
    """Cache slots for `tokens` positions, rounded up to a multiple of ALIGN: slots past the last
    token are never attended, and the TPU MoBA decode kernel needs tile-aligned block starts
    (`pallas_kernels.moba.tpu_decode.fits`)."""
    return -(-tokens // ALIGN) * ALIGN


class CacheView(NamedTuple):
    """A decode call's cache as a core reads it (after the new tokens were written).

    q: [B, T, Hq, D] the query that attends; gate_q: [B, T, Hq, Dg] the query that routes
    (MHA: q itself); length: L cache slots; full(): (k [B, H, L, D], v [B, H, L, Dv]) every
    slot, head-major (dense cores); prompt(T): (k [B, T, H, D], v [B, T, H, Dv]) slots [0, T),
    token-major (a prefill runs the training op over them); fetch(starts
    [B, T, Hq, nb], size): (k, v) [B, T, Hq, nb, size, D|Dv], each query head's blocks from
    its own KV head; gate_keys(slots [B, N]): [B, N, Hg, Dg] the keys the gate averages;
    caches: the raw head-major (k, v) [B, Hkv, L, D|Dv] where the cache is plain K/V (what a
    decode kernel reads), else None; kv_heads: the KV heads that fetch reads from (the latent
    view's one row serves every query head); latent: (c [B, L, d_c], k^R [B, L, d_R]) where the
    latent view's keys are [c ; k^R] and values c as cached (MLA: a kernel gathers them), else None."""

    q: jax.Array
    gate_q: jax.Array
    length: int
    full: Callable
    prompt: Callable
    fetch: Callable
    gate_keys: Callable
    caches: tuple | None = None
    kv_heads: int = 1
    latent: tuple | None = None


def kv_view(q, k_cache, v_cache) -> CacheView:
    """The view of a plain K/V cache, head-major [B, Hkv, L, D|Dv]: MHA's, or per-head K/V
    rebuilt. Head-major keeps a block of one KV head contiguous: a TPU kernel fetches it as
    one (block, D) tile (a [B, L, Hkv, D] cache is tiled over (Hkv, D), so one head's rows
    cannot be sliced out of it), and the XLA gathers copy whole rows."""
    token_major = lambda x: jnp.swapaxes(x, 1, 2)  # [B, H, L, D] -> [B, L, H, D]
    return CacheView(
        q=q,
        gate_q=q,
        length=k_cache.shape[2],
        full=lambda: (k_cache, v_cache),
        prompt=lambda t: (token_major(k_cache[:, :, :t]), token_major(v_cache[:, :, :t])),
        fetch=lambda starts, size: (head_blocks(k_cache, starts, size), head_blocks(v_cache, starts, size)),
        gate_keys=lambda slots: token_major(take_slots(k_cache, slots, axis=2)),
        caches=(k_cache, v_cache),
        kv_heads=k_cache.shape[1],
    )


def take_slots(cache, slots, axis: int = 1):
    """cache [B, ..., L (at `axis`), ...] at slots [B, N] -> the same with N in place of L."""
    idx = slots.reshape(slots.shape[0], *([1] * (axis - 1)), slots.shape[1], *([1] * (cache.ndim - axis - 1)))
    return jnp.take_along_axis(cache, idx, axis=axis)


def head_blocks(cache, starts, size: int):
    """cache [B, Hkv, L, D], block starts [B, T, Hq, blocks] -> [B, T, Hq, blocks, size, D]: each
    query head reads its blocks from its own KV head only."""
    b, t, hq, nb = starts.shape
    heads = jnp.broadcast_to((jnp.arange(hq) // (hq // cache.shape[1]))[:, None], (hq, nb)).reshape(-1)

    def one(cache_b, start, head):  # [Hkv, L, D], scalar, scalar -> [size, D]
        return jax.lax.dynamic_slice(cache_b, (head, start, 0), (1, size, cache_b.shape[-1]))[0]

    per_query = lambda cache_b, starts_q: jax.vmap(one, (None, 0, 0))(cache_b, starts_q.reshape(-1), heads)
    per_row = lambda cache_b, starts_b: jax.vmap(per_query, (None, 0))(cache_b, starts_b)
    return jax.vmap(per_row)(cache, starts).reshape(b, t, hq, nb, size, cache.shape[-1])
