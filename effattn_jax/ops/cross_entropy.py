"""Cross-entropy of the output head, chunked so the [tokens, vocab] logits never exist at once.

At 32K context a 50K vocabulary is 6.6 GB of float32 logits per sequence; this op holds
[B, chunk, V] of them at a time. Training never needs the logits themselves, only the loss and
its gradients, so the differentiated call computes both in one pass over each chunk: logits,
logsumexp, dlogits = softmax - one_hot (weighted), then dx and an accumulated dW. The backward
only scales them by the loss's cotangent (the loss is a scalar sum, so that is exact). An
undifferentiated call (evaluation) runs the logsumexp pass alone.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec


def chunk_len(seq: int, tokens: int, batch: int) -> int:
    """The largest divisor of seq that keeps batch x chunk <= tokens (at least 1)."""
    want = max(1, tokens // batch)
    return max(c for c in range(1, min(seq, want) + 1) if seq % c == 0)


def _chunks(a: jax.Array, c: int, rows=None) -> jax.Array:
    """[B, S, ...] -> [S / c, B, c, ...]: the scan runs over sequence chunks, the batch (and
    its sharding) stays whole. `rows`: the batch's mesh axes, pinned on the chunks (else XLA
    may split the chunk axis instead, and gather it in every step of the scan)."""
    b, s = a.shape[:2]
    out = jnp.moveaxis(a.reshape(b, s // c, c, *a.shape[2:]), 1, 0)
    if rows is not None:
        out = jax.lax.with_sharding_constraint(out, PartitionSpec(None, rows, *[None] * (out.ndim - 2)))
    return out


def _unchunk(a: jax.Array) -> jax.Array:
    n, b, c = a.shape[:3]
    return jnp.moveaxis(a, 0, 1).reshape(b, n * c, *a.shape[3:])


def _logits(x, w):
    return jnp.einsum("bcd,dv->bcv", x, w, preferred_element_type=jnp.float32)


def _nll(logits, targets):
    """[B, c, V] float32 logits -> (nll [B, c], max, sum of exp(logits - max))."""
    top = logits.max(-1, keepdims=True)
    total = jnp.exp(logits - top).sum(-1, keepdims=True)
    target = jnp.take_along_axis(logits, targets[..., None], axis=-1)
    return (top + jnp.log(total) - target)[..., 0], top, total


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _loss(x, w, targets, weights, c: int, rows):
    def body(total, args):
        xc, tc, wc = args
        nll, _, _ = _nll(_logits(xc, w), tc)
        return total + jnp.sum(nll * wc), None

    total, _ = jax.lax.scan(body, jnp.zeros((), jnp.float32), _scan_args(x, targets, weights, c, rows))
    return total


def _scan_args(x, targets, weights, c, rows):
    return _chunks(x, c, rows), _chunks(targets, c, rows), _chunks(weights.astype(jnp.float32), c, rows)


def _loss_fwd(x, w, targets, weights, c: int, rows):
    def body(carry, args):
        total, dw = carry
        xc, tc, wc = args
        logits = _logits(xc, w)
        nll, top, denom = _nll(logits, tc)
        probs = jnp.exp(logits - top) / denom
        is_target = jnp.arange(logits.shape[-1]) == tc[..., None]
        dlogits = (jnp.where(is_target, probs - 1.0, probs) * wc[..., None]).astype(x.dtype)
        dx = jnp.einsum("bcv,dv->bcd", dlogits, w, preferred_element_type=jnp.float32)
        dw = dw + jnp.einsum("bcd,bcv->dv", xc, dlogits, preferred_element_type=jnp.float32)
        return (total + jnp.sum(nll * wc), dw), dx.astype(x.dtype)

    start = (jnp.zeros((), jnp.float32), jnp.zeros(w.shape, jnp.float32))
    (total, dw), dx = jax.lax.scan(body, start, _scan_args(x, targets, weights, c, rows))
    return total, (_unchunk(dx), dw.astype(w.dtype))


def _loss_bwd(c, rows, res, g):
    dx, dw = res
    return (dx * g).astype(dx.dtype), (dw * g).astype(dw.dtype), None, None


_loss.defvjp(_loss_fwd, _loss_bwd)


def chunked_cross_entropy(x, w, targets, weights, *, chunk_tokens: int, rows=None) -> jax.Array:
    """Σ weights · (−log softmax(x @ w)[target]) as a float32 scalar, without the full logits.

    x [B, S, d] (the final-normed hidden states, compute dtype), w [d, V] (the output
    projection), targets [B, S] int, weights [B, S] (the loss mask). Holds at most
    `chunk_tokens` rows of logits ([B, c, V], c the largest divisor of S with B·c <=
    chunk_tokens). Gradients flow to x and w. `rows`: the mesh axes the batch is split over
    (under a mesh), kept on every chunk."""
    c = chunk_len(x.shape[1], chunk_tokens, x.shape[0])
    return _loss(x, w, targets, weights, c, rows)
