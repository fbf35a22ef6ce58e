"""The grid step shared by DSA's TPU kernels over picks (tpu_attention.py, tpu_latent_attention.py,
tpu_decode.py): the grid is (batch row, query, chunk of picks), and its last axis walks the query's
chunks, each chunk's row copies started one step ahead into the other of two VMEM slots, the chunks
past the query's last pick copying and computing nothing; and the online softmax's parts."""

from __future__ import annotations

import jax.numpy as jnp
from jax.experimental import pallas as pl


def over_chunks(used_ref, gather, *, init, step, finish) -> None:
    """One grid step: `init()` and chunk 0's copies at the first; chunk j + 1's copies into the
    other slot; `step(j, slot, arrived)` while j is below the query's used chunks (`used_ref`, per
    query), which calls `arrived()` (waits for chunk j's copies) before it reads the slot; `finish()`
    at the last. gather(chunk, slot) -> (start, wait) of that chunk's copies."""
    j, chunks = pl.program_id(2), pl.num_programs(2)
    used = used_ref[pl.program_id(0) * pl.num_programs(1) + pl.program_id(1)]
    slot = j % 2

    @pl.when(j == 0)
    def _():
        init()
        gather(0, 0)[0]()

    @pl.when(j + 1 < used)
    def _():
        gather(j + 1, 1 - slot)[0]()

    @pl.when(j < used)
    def _():
        step(j, slot, gather(j, slot)[1])

    pl.when(j == chunks - 1)(finish)


def softmax_init(m_sc, l_sc, acc_sc) -> None:
    m_sc[...] = jnp.full(m_sc.shape, -jnp.inf, jnp.float32)
    l_sc[...] = jnp.zeros(l_sc.shape, jnp.float32)
    acc_sc[...] = jnp.zeros(acc_sc.shape, jnp.float32)


def softmax_step(s, v, m_sc, l_sc, acc_sc) -> None:
    """One chunk of the online softmax with the heads as rows: scores s [H, C'] (-inf where
    masked), values v [C', Dv] (a matmul on the MXU)."""
    m_prev = m_sc[...]
    m_new = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
    m_safe = jnp.where(m_new > -jnp.inf, m_new, 0.0)  # a chunk of unused picks adds nothing
    p = jnp.exp(s - m_safe)
    alpha = jnp.exp(m_prev - m_safe)
    l_sc[...] = alpha * l_sc[...] + jnp.sum(p, axis=1, keepdims=True)
    acc_sc[...] = alpha * acc_sc[...] + jnp.dot(p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    m_sc[...] = m_new


def softmax_finish(o_ref, lse_ref, m_sc, l_sc, acc_sc) -> None:
    """The output (0 for a query with no pick) and, where `lse_ref` is given, the log-sum-exp the
    backward recomputes p from."""
    l = l_sc[...]
    safe_l = jnp.where(l > 0, l, 1.0)
    o_ref[...] = (acc_sc[...] / safe_l).astype(o_ref.dtype)
    if lse_ref is not None:
        lse_ref[...] = jnp.where(l > 0, m_sc[...], 0.0) + jnp.log(safe_l)


def partial_init(acc_sc):
    """A backward's init: its float32 sum (dq) zeroed."""

    def init():
        acc_sc[...] = jnp.zeros(acc_sc.shape, jnp.float32)

    return init


def partial_finish(out_ref, acc_sc):
    """A backward's finish: its float32 sum written out in the output's dtype."""

    def finish():
        out_ref[...] = acc_sc[...].astype(out_ref.dtype)

    return finish
