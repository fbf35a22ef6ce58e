"""DSA's GPU kernels timed (the GPU suite's dsa section; their numbers are checked in its correctness
section): the Triton sparse attention forward + backward against the XLA path it replaces, beside
the indexer's selection (`dsa_select`, XLA) that feeds both; and the Triton latent decode step over
each token's top-k rows against MLA's decode kernel over the whole cache (what DSA saves per step);
and the fused selection kernel against `dsa_select` in XLA. Alternated, median of `repeats`,
compiles before the timing."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from effattn_jax.ops.dsa import dsa_select, dsa_sparse_attention, latent_decode_kernel
from effattn_jax.ops.mla_decode import absorbed_attention
from eval.bench.gpu_checks import latent_step_inputs
from eval.timing import alternated, seconds

KERNEL = "pallas_triton"  # the DSA kernels' backend on GPU


def _indexer(keys, batch: int, queries: int, seq: int, index_heads: int = 4, index_dim: int = 32):
    """Random indexer outputs: q_idx [B, T, Hi, Di], k_idx [B, S, Di], weights [B, T, Hi]."""
    q_idx = jax.random.normal(keys[0], (batch, queries, index_heads, index_dim), jnp.float32)
    k_idx = jax.random.normal(keys[1], (batch, seq, index_dim), jnp.float32)
    return q_idx, k_idx, jax.random.normal(keys[2], (batch, queries, index_heads), jnp.float32)


def attention_case(*, seq, heads, kv_heads, head_dim, v_head_dim, top_k, dtype, repeats) -> dict:
    """ms of forward + backward (sum of the output) of the kernel and of the XLA path over one
    selection, and of the selection itself."""
    keys = jax.random.split(jax.random.key(seq + heads), 6)
    q = jax.random.normal(keys[0], (1, seq, heads, head_dim), dtype)
    k = jax.random.normal(keys[1], (1, seq, kv_heads, head_dim), dtype)
    v = jax.random.normal(keys[2], (1, seq, kv_heads, v_head_dim), dtype)
    index = _indexer(keys[3:], 1, seq, seq)
    select = jax.jit(lambda *x: dsa_select(*x, top_k=top_k))
    indices = select(*index)

    def grad(impl):
        attend = dsa_sparse_attention(impl)
        loss = lambda q, k, v: attend(q, k, v, indices, scale=head_dim**-0.5).astype(jnp.float32).sum()
        return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))

    fns = {"kernel": (grad(KERNEL), (q, k, v)), "xla": (grad("xla"), (q, k, v)), "select": (select, index)}
    for fn, args in fns.values():
        jax.block_until_ready(fn(*args))
    ms = alternated({name: seconds(fn, *args) for name, (fn, args) in fns.items()}, repeats)
    return {
        "case": "attention", "seq": seq, "heads": heads, "kv_heads": kv_heads, "head_dim": head_dim,
        "v_head_dim": v_head_dim, "top_k": top_k, "dtype": jnp.dtype(dtype).name,
        "kernel_fwd_bwd_ms": ms["kernel"] * 1e3, "xla_fwd_bwd_ms": ms["xla"] * 1e3,
        "select_ms": ms["select"] * 1e3, "xla_over_kernel": ms["xla"] / ms["kernel"],
    }  # fmt: skip


def decode_case(*, context, batch, heads, latent, rope, top_k, dtype, repeats) -> dict:
    """ms of one decode step over a full cache: the DSA kernel over each row's top_k latent rows
    against MLA's decode kernel (Triton) over every slot; the selection is made once, outside."""
    keys = jax.random.split(jax.random.key(context + batch + heads), 7)
    q_lat, q_rope, lat, kr = latent_step_inputs(keys, batch, heads, context, latent, rope, dtype)
    pos = jnp.full((batch, 1), context - 1, jnp.int32)
    indices = jax.jit(lambda *x: dsa_select(*x, top_k=top_k, q_index=pos))(
        *_indexer(keys[4:], batch, 1, context)
    )
    scale = (latent + rope) ** -0.5
    sparse = jax.jit(lambda *x: latent_decode_kernel(KERNEL)(*x, indices, scale=scale))
    dense = jax.jit(lambda *x: absorbed_attention(*x, pos, scale, KERNEL))
    args = (q_lat, q_rope, lat, kr)
    for fn in (sparse, dense):
        jax.block_until_ready(fn(*args))
    ms = alternated({"dsa": seconds(sparse, *args), "mla": seconds(dense, *args)}, repeats)
    return {
        "case": "decode", "context": context, "batch": batch, "heads": heads, "top_k": top_k,
        "dtype": jnp.dtype(dtype).name, "dsa_ms": ms["dsa"] * 1e3, "mla_ms": ms["mla"] * 1e3,
        "mla_over_dsa": ms["mla"] / ms["dsa"],
    }  # fmt: skip


def select_case(*, seq, top_k, index_heads, index_dim, dtype, repeats) -> dict:
    """ms of a whole sequence's selection (batch 1): the fused kernel against `dsa_select` in XLA
    (the scores a chunk of queries at a time, then `lax.top_k`)."""
    keys = jax.random.split(jax.random.key(seq + index_heads), 3)
    index = (
        jax.random.normal(keys[0], (1, seq, index_heads, index_dim), dtype),
        jax.random.normal(keys[1], (1, seq, index_dim), dtype),
        jax.random.normal(keys[2], (1, seq, index_heads), jnp.float32),
    )
    fns = {
        impl: jax.jit(lambda *x, impl=impl: dsa_select(*x, top_k=top_k, impl=impl))
        for impl in (KERNEL, "xla")
    }
    for fn in fns.values():
        jax.block_until_ready(fn(*index))
    ms = alternated({impl: seconds(fn, *index) for impl, fn in fns.items()}, repeats)
    return {
        "case": "select", "seq": seq, "top_k": top_k, "index_heads": index_heads, "index_dim": index_dim,
        "dtype": jnp.dtype(dtype).name, "kernel_ms": ms[KERNEL] * 1e3, "xla_ms": ms["xla"] * 1e3,
        "xla_over_kernel": ms["xla"] / ms[KERNEL],
    }  # fmt: skip


def section(suite, rows: list, p: dict, error) -> None:
    """Every attention case, then every decode and selection case, each skipped once the share is
    spent; a case that fails to compile or run is a row with its error."""
    cases = [(attention_case, c) for c in p["attention"]] + [(decode_case, c) for c in p["decode"]]
    cases += [(select_case, c) for c in p["select"]]
    for case, kw in cases:
        if not suite.time_left():
            suite.add(rows, kw | {"dtype": jnp.dtype(kw["dtype"]).name, "skipped": "time budget"})
            continue
        try:
            suite.add(rows, case(**kw, repeats=p["repeats"]))
        except Exception as e:  # noqa: BLE001 - a kernel that fails at a shape is the finding
            suite.add(rows, kw | {"dtype": jnp.dtype(kw["dtype"]).name, "error": error(e)})
