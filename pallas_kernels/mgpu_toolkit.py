"""What the Mosaic GPU kernels (Pallas `plgpu` on Hopper: moba/mgpu_own.py, moba/mgpu_blocks.py,
moba/mgpu_decode.py, moba/routing_mgpu.py, mla_decode/mgpu.py) share: shared-memory buffers tiled
and swizzled for warpgroup matmuls (wgmma), the matmuls themselves, accumulation from registers,
the layouts of a wgmma result's rows and columns, one step of the online softmax, the ring of TMA
stages and the memory warpgroup that feeds it. Their interpreter switch is common.py's
`mosaic_gpu_interpret`.

Interpreted, one thing differs: the interpreter's wgmma reads both operands from shared memory and
it has no pl.run_state, so a register operand (p, dS) cannot feed a matmul that accumulates in
place. `accumulate` is the one function that takes the other path; `interpreter_staging` declares
the shared memory that path goes through (none in a compiled kernel).
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

SWIZZLE = 128  # bytes: a wgmma operand's rows come in 128-byte swizzle groups
ROW = plgpu.Layout.WGMMA.reduce(1)  # a [rows] vector laid out as a wgmma result's rows
COL = plgpu.Layout.WGMMA.reduce(0)  # ... and as its columns
MEMORY_REGISTERS = 40  # per thread of a memory warpgroup (it only issues TMA copies)


def named(body, name: str, **static):
    """A kernel body with its static arguments bound, named `name` (the compiled kernel's symbol,
    and what a profile shows)."""
    fn = functools.partial(body, **static)
    fn.__name__ = name
    return fn


# ---------------------------------------------------------------------------------------------
# Shared memory and warpgroup matmuls


def swizzled_smem(shape, dtype):
    """A shared-memory buffer laid out for a wgmma operand (and the TMA copies that fill it): tiles
    of 8 rows of 128 bytes, swizzled over 128 bytes."""
    tiling = plgpu.TilingTransform((8, SWIZZLE // jnp.dtype(dtype).itemsize))
    return plgpu.SMEM(shape, dtype, transforms=(tiling, plgpu.SwizzleTransform(SWIZZLE)))


def matmul(a, b, shape):
    """a @ b [M, N] float32 by one warpgroup matmul into a fresh accumulator, waited for (a, b: SMEM)."""
    return matmul_sum([(a, b)], shape)


def matmul_sum(pairs, shape):
    """The sum of a @ b over `pairs` [M, N] float32, by warpgroup matmuls into one fresh accumulator."""

    def run(acc_ref):
        for a, b in pairs:
            plgpu.wgmma(acc_ref, a, b)
        return acc_ref[...]

    return pl.run_scoped(run, plgpu.ACC(shape, jnp.float32))


def matmuls(*pairs, shape):
    """a @ b for each (a, b) of `pairs`, by warpgroup matmuls into fresh float32 accumulators of
    `shape`, all issued before the first wait (the tensor cores run them back to back)."""

    def run(*accs):
        for acc, (a, b) in zip(accs, pairs, strict=True):
            plgpu.wgmma(acc, a, b)
        return tuple(acc[...] for acc in accs)

    return pl.run_scoped(run, *[plgpu.ACC(shape, jnp.float32)] * len(pairs))


def interpreter_staging(shape, dtype, interpret: bool):
    """The scratch `accumulate` stages register operands through when interpreted (a swizzled
    buffer of `shape`; a leading axis gives each warpgroup its slot), None compiled: a compiled
    kernel allocates nothing for it."""
    return swizzled_smem(shape, dtype) if interpret else None


def accumulate(accs, xs, bs, staging, *, slot=None):
    """acc + x @ b for each (acc, x, b) of `accs`, `xs`, `bs`: x a register tile (p or dS, cast to
    b's dtype), b in shared memory; a tuple, in order.

    Compiled (`staging` None): warpgroup matmuls that read x from registers and accumulate into
    acc in place (pl.run_state), all issued before one wait. Interpreted (`staging` from
    interpreter_staging; `slot`: this warpgroup's slot of it): the interpreter's wgmma reads only
    shared memory and has no pl.run_state, so each x goes through `staging` into a fresh
    accumulator that is added to acc. The same sums; only the operand path differs."""
    if staging is None:

        def run(refs):
            for ref, x, b in zip(refs, xs, bs, strict=True):
                plgpu.wgmma(ref, x, b)

        return pl.run_state(run)(tuple(plgpu.ACC.init(acc) for acc in accs))
    buffer = staging if slot is None else staging.at[slot]
    out = []
    for acc, x, b in zip(accs, xs, bs, strict=True):
        buffer[...] = x
        plgpu.commit_smem()
        out.append(acc + matmul(buffer, b, acc.shape))
    return tuple(out)


# ---------------------------------------------------------------------------------------------
# Layouts of a wgmma result, and the online softmax over its rows


def full_rows(n: int, value):
    """[n] float32 of `value` in the layout of a wgmma result's rows (a running max or sum)."""
    return plgpu.layout_cast(jnp.full((n,), value, jnp.float32), ROW)


def full_tile(shape, value):
    """[M, N] float32 of `value` in a wgmma result's layout (an accumulator's start)."""
    return plgpu.layout_cast(jnp.full(shape, value, jnp.float32), plgpu.Layout.WGMMA)


def load_rows(ref):
    """A [rows] shared-memory vector in the layout of a wgmma result's rows."""
    return plgpu.load(ref, layout=ROW)


def load_cols(ref):
    """A [cols] shared-memory vector in the layout of a wgmma result's columns."""
    return plgpu.load(ref, layout=COL)


def tile_iota(shape, dim: int):
    """Each element's index along `dim` of an [M, N] tile, in a wgmma result's layout."""
    return plgpu.broadcasted_iota(jnp.int32, shape, dim, layout=plgpu.Layout.WGMMA)


def col_iota(n: int):
    """0 .. n - 1 in the layout of a wgmma result's columns."""
    return plgpu.broadcasted_iota(jnp.int32, (n,), 0, layout=COL)


def softmax_step(s, m, l):
    """One online-softmax step over the base-2 scores s [rows, keys] from the running max m and
    sum l [rows] -> (p = 2^(s - m_new), m_new, l_new, alpha = 2^(m - m_new), the factor the
    caller rescales its accumulator by)."""
    m_new = jnp.maximum(m, s.max(axis=1))
    alpha = jnp.exp2(m - m_new)
    p = jnp.exp2(s - lax.broadcast_in_dim(m_new, s.shape, [0]))
    return p, m_new, l * alpha + p.sum(axis=1), alpha


# ---------------------------------------------------------------------------------------------
# The ring of TMA stages: step n of a loop streams into slot n % stages


def fill_ring(steps, stages: int, fetch):
    """Issue the first `stages` fetches of a loop of `steps` (fetch(n) copies step n into its slot)."""
    for n in range(stages):
        pl.when(n < steps)(functools.partial(fetch, n))


def refill_ring(n, steps, stages: int, fetch):
    """Step n has read its slot for the last time: fetch step n + stages into it."""

    @pl.when(n + stages < steps)
    def _():
        fetch(n + stages)


def stream_ring(count, stages: int, fetch, free):
    """A memory warpgroup's loop: fetch(i, slot) for i < count into a ring of `stages` slots, each
    after the compute warpgroups have released it (free: barriers, one a slot, they arrive on).

    Then it waits for the release of the last min(stages, count) steps too, which no later fetch
    waits for: so it ends only after the compute warpgroups are done with every slot, having
    observed every phase its consumed barriers completed (a barrier left with a completed phase
    its waiter never saw is out of step for any later use; jax's emit_pipeline_warp_specialized
    ends the same way, and jax 0.11's Mosaic GPU interpreter fails such a kernel)."""

    @pl.loop(0, count)
    def _(i):
        slot = lax.rem(i, stages)

        @pl.when(i >= stages)
        def _():
            for barrier in free:
                plgpu.barrier_wait(barrier.at[slot])

        fetch(i, slot)

    @pl.loop(jnp.maximum(count - stages, 0), count)
    def _(i):
        for barrier in free:
            plgpu.barrier_wait(barrier.at[lax.rem(i, stages)])


# ---------------------------------------------------------------------------------------------
# Warp specialisation: warpgroups 0 .. wgs - 1 compute, warpgroup wgs streams the ring


def _share_registers(wgs: int, memory: bool) -> None:
    """With two or more compute warpgroups, moves registers from the memory warpgroup to them
    (setmaxnreg; 64K 32-bit registers per SM, multiples of 8 per thread up to 255)."""
    if wgs < 2:
        return  # two warpgroups already get 256 each
    if memory:
        plgpu.set_max_registers(MEMORY_REGISTERS, action="decrease")
    else:
        per_thread = (65536 - 128 * MEMORY_REGISTERS) // (128 * wgs) // 8 * 8
        plgpu.set_max_registers(min(per_thread, 240), action="increase")


def compute_warpgroups(wg, wgs: int):
    """Decorates a compute warpgroups' program: run by warpgroups 0 .. wgs - 1, with the
    registers the memory warpgroup gives up."""

    def decorate(body):
        @pl.when(wg < wgs)
        def _():
            _share_registers(wgs, memory=False)
            body()

    return decorate


def memory_warpgroup(wg, wgs: int, count, stages: int, fetch, free) -> None:
    """The memory warpgroup's program (warpgroup wgs): it gives up registers, then streams
    `count` steps into the ring (stream_ring)."""

    @pl.when(wg == wgs)
    def _():
        _share_registers(wgs, memory=True)
        stream_ring(count, stages, fetch, free)
