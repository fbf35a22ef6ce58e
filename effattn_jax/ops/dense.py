"""Dense causal attention with packed-document masking (the `dense` core).

`dense_attention` is the one dispatch (as `moba_attention` is MoBA's): `resolve_dense_impl` picks
splash attention (jax's Pallas TPU kernel: flash attention whose scalar-prefetched block
tables skip fully masked blocks) on TPU, cuDNN flash attention (`jax.nn.dot_product_attention(
implementation="cudnn")`) on GPU where cuDNN takes the shapes, and XLA elsewhere.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from effattn_jax.config import DENSE_IMPLS
from effattn_jax.ops.context_parallel import context_attention, context_shards, query_positions
from effattn_jax.ops.platform import target_backend
from effattn_jax.sharding import Rules, shard_over_batch_heads

CUDNN_DTYPES = (jnp.bfloat16, jnp.float16)


def causal_segment_mask(segment_ids: jax.Array | None, q_len: int, kv_len: int) -> jax.Array:
    """[B or 1, 1, q_len, kv_len] bool: causal and, with segment ids [B, S], same document."""
    causal = jnp.tril(jnp.ones((q_len, kv_len), bool), k=kv_len - q_len)[None, None]
    if segment_ids is None:
        return causal
    same = segment_ids[:, None, -q_len:, None] == segment_ids[:, None, None, :]
    return causal & same


def masked_attention(q, k, v, mask, scale, *, heads_first: bool = False):
    """Plain softmax attention, float32 softmax. q [B, T, Hq, D], k [B, S, Hkv, D], v [B, S, Hkv, Dv]
    (`heads_first`: [B, Hkv, S, D|Dv], a decode cache's layout, read as it is), mask
    broadcastable to [B, Hq, T, S] (True = attend) -> [B, T, Hq, Dv] in q's dtype."""
    b, t, hq, d = q.shape
    hkv, s = (k.shape[1], k.shape[2]) if heads_first else (k.shape[2], k.shape[1])
    kv = "bksd" if heads_first else "bskd"
    qg = q.reshape(b, t, hkv, hq // hkv, d)
    logits = jnp.einsum(f"btkgd,{kv}->bkgts", qg, k, preferred_element_type=jnp.float32) * scale
    mask = jnp.broadcast_to(mask, (b, hq, t, s)).reshape(b, hkv, hq // hkv, t, s)
    logits = jnp.where(mask, logits, -jnp.inf)
    # softmax normalised after the value product: divides [T, Dv] rather than [T, S] (the
    # downstream eval's decode shapes, BENCHMARKS.md); the max is held constant, as in jax.nn.softmax
    weights = jnp.exp(logits - jax.lax.stop_gradient(logits.max(-1, keepdims=True)))
    out = jnp.einsum(f"bkgts,{kv}->bkgtd", weights, v.astype(jnp.float32)) / weights.sum(-1, keepdims=True)
    return out.transpose(0, 3, 1, 2, 4).reshape(b, t, hq, v.shape[-1]).astype(q.dtype)


def local_attention(q, k, v, q_segments, k_segments, firsts, *, scale):
    """A context shard's queries [B, T, Hq, D] (runs starting at `firsts`) over every key [B, S]:
    causal by sequence position, within the document."""
    b, s = k.shape[:2]
    q_pos = query_positions(firsts, q.shape[1] // len(firsts), b)
    mask = jnp.arange(s)[None, None, :] <= q_pos[:, :, None]  # [B, T, S]
    if q_segments is not None:
        mask &= k_segments[:, None, :] == q_segments[:, :, None]
    return masked_attention(q, k, v, mask[:, None], scale)


def _local_splash(q, k, v, q_segments, k_segments, firsts, *, scale, interpret):
    """`local_attention` through splash: the shard's first run of C queries (at i C) sees keys
    [0, (i + 1) C), its second (at (2N - 1 - i) C) keys [0, (2N - i) C). Each goes to the kernel
    as a window of static length ending at its last query (N C and 2N C keys: the causal mask
    of each is static), the keys before position 0 padded under a segment id no query has.
    Splash skips the masked blocks; the windows cost 1.5x the balanced work at most."""
    b, s = k.shape[:2]
    run = q.shape[1] // 2
    n = s // (2 * run)
    if q_segments is None:
        q_segments, k_segments = jnp.ones((b, 2 * run), jnp.int32), jnp.ones((b, s), jnp.int32)
    pad = (n - 1) * run
    front = lambda x, fill=0: jnp.pad(x, ((0, 0), (pad, 0)) + ((0, 0),) * (x.ndim - 2), constant_values=fill)
    kp, vp, segp = front(k), front(v), front(k_segments, jnp.iinfo(jnp.int32).min)
    outs = []
    for j, (first, length) in enumerate(zip(firsts, (n * run, 2 * n * run), strict=True)):
        window = lambda x, first=first, length=length: jax.lax.dynamic_slice_in_dim(
            x, first + run + pad - length, length, axis=1
        )
        rows = slice(j * run, (j + 1) * run)
        outs.append(
            splash_attention(
                q[:, rows],
                window(kp),
                window(vp),
                segment_ids=q_segments[:, rows],
                kv_segment_ids=window(segp),
                scale=scale,
                interpret=interpret,
            )  # fmt: skip
        )
    return jnp.concatenate(outs, axis=1)


def resolve_dense_impl(impl: str, q, v, backend: str | None = None) -> str:
    """The path for an impl name (auto | xla | splash | cudnn) on a JAX backend.

    auto: splash on TPU; on GPU cudnn when cuDNN takes the call (bf16/fp16, equal q/k and v
    head widths up to 128, a multiple of 8: not MLA's wider q/k), else xla; xla on CPU."""
    if impl != "auto":
        return impl
    backend = backend or target_backend()
    if backend == "tpu":
        return "splash"
    d, dv = q.shape[-1], v.shape[-1]
    fits = q.dtype in CUDNN_DTYPES and d == dv and d <= 128 and d % 8 == 0
    return "cudnn" if backend in ("gpu", "cuda", "rocm") and fits else "xla"


def dense_attention(
    q, k, v, *, segment_ids=None, scale=None, impl: str = "xla", rules: Rules | None = None, kv_whole=False
):
    """q: [B, S, Hq, D], k: [B, S, Hkv, D], v: [B, S, Hkv, Dv] (Hkv divides Hq) -> [B, S, Hq, Dv].

    Softmax over every earlier key of the same document. impl: see `resolve_dense_impl`
    (default xla: the plain path every other impl is tested against). `rules`: logical
    sharding rules; under a context mesh the splash kernel runs per (batch, head) shard. Over a
    `context` axis (q, k, v in the balanced layout) the XLA path runs per shard (auto: xla);
    `kv_whole`: see `context_attention`.
    """
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    path = resolve_dense_impl(impl, q, v)
    if path not in DENSE_IMPLS[1:]:
        raise ValueError(f"dense attention impl={impl!r}: expected one of {', '.join(DENSE_IMPLS)}")
    if context_shards() > 1:
        if path == "splash":  # interpreted off TPU (tests)
            local = functools.partial(_local_splash, scale=scale, interpret=target_backend() != "tpu")
        elif path == "xla" or impl == "auto":  # auto on GPU: cuDNN takes whole sequences only
            local = functools.partial(local_attention, scale=scale)
        else:
            raise ValueError(f"dense attention impl={impl!r} does not run over a context axis; use xla")
        return context_attention(local, q, k, v, segment_ids, rules, kv_whole)
    if path == "splash":
        run = lambda q, k, v, seg: splash_attention(q, k, v, segment_ids=seg, scale=scale)
        return shard_over_batch_heads(run, q, k, v, segment_ids, rules)
    if path == "cudnn":  # packed documents as a boolean mask beside the causal one
        mask = None if segment_ids is None else causal_segment_mask(segment_ids, q.shape[1], k.shape[1])
        return jax.nn.dot_product_attention(
            q, k, v, mask=mask, scale=scale, is_causal=True, implementation="cudnn"
        ).astype(q.dtype)
    mask = causal_segment_mask(segment_ids, q.shape[1], k.shape[1])
    if v.shape[-1] != q.shape[-1]:  # jax.nn.dot_product_attention needs equal head dims
        return masked_attention(q, k, v, mask, scale)
    return jax.nn.dot_product_attention(q, k, v, mask=mask, scale=scale, implementation="xla").astype(q.dtype)


def splash_attention(
    q, k, v, *, segment_ids=None, kv_segment_ids=None, scale: float, block: int = 512, interpret: bool = False
):
    """Causal attention through jax's splash kernel (TPU; `interpret` runs it on CPU). Shapes as
    `dense_attention`; S must be a multiple of min(block, S). Splash applies no scale: q is
    scaled first. GQA and a different v width go to the kernel as they are. With more keys L than
    queries T the queries are the last T positions (the causal mask ends at the keys' end), and
    `kv_segment_ids` [B, L] are the keys' (default: `segment_ids`)."""
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as masks

    _, t, hq, _ = q.shape
    length = k.shape[1]
    bs = min(block, t)
    if t % bs or length % bs:
        raise ValueError(
            f"splash attention: sequence length {t} (keys {length}) is not a multiple of its block {bs}; "
            "pad the sequence or set attention.dense_impl=xla"
        )
    sizes = splash.BlockSizes(
        block_q=bs, block_kv=bs, block_kv_compute=bs, block_q_dkv=bs, block_kv_dkv=bs,
        block_kv_dkv_compute=bs, block_q_dq=bs, block_kv_dq=bs,
    )  # fmt: skip
    kernel = splash.make_splash_mha(
        masks.MultiHeadMask([masks.CausalMask((t, length), offset=length - t)] * hq),
        block_sizes=sizes,
        head_shards=1,
        q_seq_shards=1,
        interpret=interpret,
    )
    heads_first = lambda x: jnp.swapaxes(x, 1, 2)  # [B, S, H, D] <-> [B, H, S, D]
    q = heads_first(q * jnp.asarray(scale, q.dtype))
    k, v = heads_first(k), heads_first(v)
    if segment_ids is None:
        out = jax.vmap(kernel)(q, k, v)
    else:
        kv_segment_ids = segment_ids if kv_segment_ids is None else kv_segment_ids
        out = jax.vmap(
            lambda q, k, v, seg, kv_seg: kernel(q, k, v, segment_ids=splash.SegmentIds(seg, kv_seg))
        )(q, k, v, segment_ids, kv_segment_ids)
    return heads_first(out).astype(q.dtype)
