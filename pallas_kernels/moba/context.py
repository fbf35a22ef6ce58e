"""MoBA's kernels (TPU and GPU) for a context shard's queries (effattn_jax/ops/context_parallel.py):
the shard holds runs of C queries (C a whole number of blocks) at sequence positions `firsts`,
and every key of the sequence.

The selected earlier blocks need nothing new: the whole-block kernel gathers its tiles' query
rows from the shard's queries and reads their blocks from the whole sequence's keys (the
schedule is built with the keys' length). The own block lies in the run's keys or in the block
before them (packed documents), so each run goes to the own-block kernel as a window of its own:
one block of dummy queries (zeros, dO = 0 in the backward: they add nothing) over the c keys
before the run, then the run; the kernel computes c / C more rows than the run has. The parts
are merged by log-sum-exp (parts.merge), and the backward mirrors attention.py's: the windows' dK/dV
are added into the whole sequence's, and the selected blocks' dK/dV are added to them (on TPU
by their kernel, in place; on GPU by one gathering pass, which finds each key's block from
`key_starts`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from pallas_kernels.moba import parts
from pallas_kernels.moba.parts import KernelCall
from pallas_kernels.moba.schedule import SCHEDULE_NAME


def moba_pallas_local(
    q, k, v, own_start, past_start, key_starts, firsts, block_size, scale, backend, interpret, block_sizes
):
    """q [B, T, Hq, D]: runs of T / len(firsts) positions starting at `firsts` (traced ints,
    multiples of the block); k, v [B, S, Hkv, D|Dv] the whole sequence; own_start [B, T] and
    past_start [B, T, Hq, K'] absolute positions (moba_routing with q_index); key_starts [B, S]
    the first position of each key's block (segments.block_starts) -> [B, T, Hq, Dv]."""
    call = KernelCall.fitted(
        block_sizes, q, v, block_size=block_size, scale=scale, backend=backend, interpret=interpret
    )
    past = parts.past_schedule(past_start, hkv=k.shape[2], call=call, key_len=k.shape[1])
    own_start, past = checkpoint_name((own_start, past), SCHEDULE_NAME)
    firsts = jnp.stack([jnp.asarray(f, jnp.int32) for f in firsts])
    return _local(q, k, v, own_start, past, key_starts, firsts, call)


def _window(x, first, size: int, c: int):
    """Positions [first - c, first - c + size) of x [B, S, ...], zeros before position 0."""
    padded = jnp.pad(x, ((0, 0), (c, 0)) + ((0, 0),) * (x.ndim - 2))
    return jax.lax.dynamic_slice_in_dim(padded, first, size, axis=1)


def _with_dummies(x, c: int, fill=0):
    """x [B, C, ...] after c dummy rows of `fill`."""
    return jnp.pad(x, ((0, 0), (c, 0)) + ((0, 0),) * (x.ndim - 2), constant_values=fill)


def _runs(q, own_start, firsts, c):
    """Per run: (rows of q, first position, the window's own_start: dummies at 0, the run's
    relative to the window's first key)."""
    run = q.shape[1] // firsts.shape[0]
    for j in range(firsts.shape[0]):
        rows = slice(j * run, (j + 1) * run)
        own = _with_dummies(own_start[:, rows] - (firsts[j] - c), c)
        yield rows, firsts[j], own


def _own_parts(q, k, v, own_start, firsts, call: KernelCall):
    """The own block's (o float32 [B, T, Hq, Dv], lse [B, T, Hq]), window by window."""
    b, _, hq, _ = q.shape
    c = call.block_size
    outs, lses = [], []
    for rows, first, own in _runs(q, own_start, firsts, c):
        size = c + rows.stop - rows.start
        qw, kw, vw = _with_dummies(q[:, rows], c), _window(k, first, size, c), _window(v, first, size, c)
        _, lay = parts.layout(qw, kw, vw, call)
        o, lse = parts.own_forward(call, qw, lay, own)
        outs.append(lay.back(o, b, size, hq)[:, c:])
        lses.append(lse[:, c:])
    return jnp.concatenate(outs, axis=1), jnp.concatenate(lses, axis=1)


def _add_at(acc, g, first):
    """acc [B, c + S, ...] float32 with g [B, size, ...] added at rows [first, first + size)."""
    now = jax.lax.dynamic_slice_in_dim(acc, first, g.shape[1], axis=1)
    return jax.lax.dynamic_update_slice_in_dim(acc, now + g.astype(jnp.float32), first, axis=1)


@functools.partial(jax.custom_vjp, nondiff_argnums=(7,))
def _local(q, k, v, own_start, past, key_starts, firsts, call):
    return _fwd(q, k, v, own_start, past, key_starts, firsts, call)[0]


def _fwd(q, k, v, own_start, past, key_starts, firsts, call: KernelCall):
    b, t, hq, d = q.shape
    o_own, lse_own = _own_parts(q, k, v, own_start, firsts, call)
    if past is None:
        out, lse = o_own.astype(q.dtype), lse_own
    else:
        lay = parts.kv_layout(k, v, call, q_heads=hq)  # the whole sequence's K/V
        o_rows, l_rows = parts.past_forward(call, q.reshape(-1, d), lay, past)
        own = lambda start, size: tuple(
            jax.lax.dynamic_slice_in_dim(x, start, size, axis=1) for x in (o_own, lse_own)
        )
        out, lse = parts.merge(own, past, o_rows, l_rows, (b, t, hq), q.dtype)
    return out, (q, k, v, own_start, past, key_starts, firsts, out, lse)


def _bwd(call: KernelCall, res, d_out):
    q, k, v, own_start, past, key_starts, firsts, out, lse = res
    b, t, hq, d = q.shape
    s, hkv, c = k.shape[1], k.shape[2], call.block_size
    delta = jnp.sum(d_out.astype(jnp.float32) * out.astype(jnp.float32), axis=-1)  # [B, T, Hq]
    dq_parts = []
    dk = jnp.zeros((b, s + c, hkv, k.shape[3]), jnp.float32)  # c rows before position 0
    dv = jnp.zeros((b, s + c, hkv, v.shape[3]), jnp.float32)
    for rows, first, own in _runs(q, own_start, firsts, c):
        size = c + rows.stop - rows.start
        qw, kw, vw = _with_dummies(q[:, rows], c), _window(k, first, size, c), _window(v, first, size, c)
        _, lay = parts.layout(qw, kw, vw, call)
        dq_w, dk_w, dv_w = parts.own_backward(
            call, qw, lay, own, _with_dummies(d_out[:, rows], c), _with_dummies(lse[:, rows], c, jnp.inf),
            _with_dummies(delta[:, rows], c).reshape(-1),
        )  # fmt: skip
        dq_parts.append(lay.back(dq_w, b, size, hq)[:, c:])
        if call.backend == "tpu":  # the GPU's dK/dV come as [B, size, Hkv, D]
            dk_w, dv_w = lay.back(dk_w, b, size, hkv), lay.back(dv_w, b, size, hkv)
        dk, dv = _add_at(dk, dk_w, first), _add_at(dv, dv_w, first)
    dq = jnp.concatenate(dq_parts, axis=1)
    dk, dv = dk[:, c:].astype(k.dtype), dv[:, c:].astype(v.dtype)
    if past is not None:
        lay = parts.kv_layout(k, v, call, q_heads=hq)
        flat = (
            q.reshape(-1, d),
            d_out.reshape(-1, d_out.shape[-1]).astype(lay.v.dtype),
            lse.reshape(-1),
            delta.reshape(-1),
        )
        if call.backend == "tpu":
            dq_t, dk_l, dv_l = parts.past_backward(call, flat, lay, past, lay.to(dk), lay.to(dv), key_starts)
            dk, dv = lay.back(dk_l, b, s, hkv), lay.back(dv_l, b, s, hkv)
        else:
            dq_t, dk, dv = parts.past_backward(call, flat, lay, past, dk, dv, key_starts)
        dq_own = dq
        own_dq = lambda start, size: jax.lax.dynamic_slice_in_dim(dq_own, start, size, axis=1)
        dq = parts.combine_dq(own_dq, past, dq_t.reshape(-1, d), (b, t, hq), q.dtype)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None, None, None, None


_local.defvjp(_fwd, _bwd)
