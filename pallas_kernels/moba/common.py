"""What the MoBA kernels' bodies share (TPU and GPU): the online-softmax forward step and the
dK/dV step of the backward. The schedule they run is in schedule.py."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.common import TN


def online_softmax_init(rows: int, dv: int):
    """(running max, running sum, accumulator) of a flash-attention forward over `rows` queries."""
    return (
        jnp.full((rows, 1), -jnp.inf, jnp.float32),
        jnp.zeros((rows, 1), jnp.float32),
        jnp.zeros((rows, dv), jnp.float32),
    )


def online_softmax_step(carry, s, v):
    """One key step of a flash-attention forward: scores s [Qt, Ck] (-inf where masked) and
    values v [Ck, Dv] folded into (m, l, acc) [Qt, 1], [Qt, 1], [Qt, Dv]."""
    m, l, acc = carry
    m_new = jnp.maximum(m, jnp.max(s, axis=1, keepdims=True))
    m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # a row that has seen no key yet
    p, alpha = jnp.exp(s - m_safe), jnp.exp(m - m_safe)
    acc = alpha * acc + jnp.dot(p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return m_new, alpha * l + jnp.sum(p, axis=1, keepdims=True), acc


def dkv_step(carry, q, do, p, ds, scale):
    """dK, dV [Ck, D|Dv] += the contribution of queries q, dO [Qt, D|Dv] with probabilities p and
    score gradients ds [Qt, Ck] (flash attention's dK/dV loop)."""
    dk, dv = carry
    dk = dk + jax.lax.dot_general(ds.astype(q.dtype), q, TN, preferred_element_type=jnp.float32) * scale
    dv = dv + jax.lax.dot_general(p.astype(do.dtype), do, TN, preferred_element_type=jnp.float32)
    return dk, dv
