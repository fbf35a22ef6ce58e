"""MoBA vs dense causal attention on this machine (the XLA paths): forward+backward wall time and
compiled memory.

    python -m eval.bench.attention [--seqs 2048,4096,8192,16384] [--repeats 3] [--json]

On a GPU, the kernels against cuDNN: `python -m eval.bench.gpu_suite` (its attention section).

Batch 1, 4 heads, head dim 64, block 512, top_k 3, float32, on the current backend. Dense is
`jax.nn.dot_product_attention(is_causal=True)` (XLA implementation). Both programs are compiled
and checked to fit first (a length that cannot fit is skipped in one line); timings alternate
MoBA and dense runs and report medians (eval/timing.py); memory is each compiled program's
`effattn_jax.memory.program_bytes` (XLA's memory analysis: arguments + outputs + temporaries;
CPU devices report no live memory stats). `--json` prints a list of rows {seq, dense_ms,
moba_ms, speedup, dense_bytes, moba_bytes}, or {seq, skipped} for a length that cannot fit.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from effattn_jax.cli import positive_int, positive_int_list
from effattn_jax.memory import DoesNotFit, check_fits, program_bytes
from effattn_jax.ops.moba import moba_attention
from eval.bench import common
from eval.timing import alternated, seconds


def make_fns(block_size, top_k, impl):
    def moba_loss(q, k, v):
        return jnp.sum(
            moba_attention(q, k, v, block_size=block_size, top_k=top_k, impl=impl).astype(jnp.float32)
        )

    def dense_loss(q, k, v):
        out = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="xla")
        return jnp.sum(out.astype(jnp.float32))

    grad = lambda f: jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2)))
    return {"moba": grad(moba_loss), "dense": grad(dense_loss)}


def inputs(seq, heads, head_dim, dtype, seed=0):
    rng = np.random.default_rng(seed)
    shape = (1, seq, heads, head_dim)
    return tuple(jnp.asarray(rng.standard_normal(shape), dtype) for _ in range(3))


def structured_inputs(seq, heads, head_dim, dtype, seed=0, strength=2.0, batch=1, kv_heads=None):
    """q [batch, seq, heads, D] and k/v [batch, seq, kv_heads (default heads), D] sharing a slowly
    varying positional signal, so nearby blocks score higher (block-local routing, as trained models
    show); strength 0 gives uniform routing."""
    rng = np.random.default_rng(seed)
    pos = np.arange(seq)[:, None] / 4096.0
    freqs = np.exp(-np.arange(head_dim // 2) / (head_dim // 2) * np.log(64.0))[None]
    signal = np.concatenate([np.sin(pos * freqs), np.cos(pos * freqs)], axis=-1)[None, :, None, :]
    kv_heads = kv_heads or heads
    make = lambda h: rng.standard_normal((batch, seq, h, head_dim)) + strength * signal
    v = rng.standard_normal((batch, seq, kv_heads, head_dim))
    return tuple(jnp.asarray(x, dtype) for x in (make(heads), make(kv_heads), v))


def measure(fns, seq: int, args) -> dict:
    """One row: both programs compiled and checked to fit (dense first: the larger; each runs alone,
    one after the other), then timed alternately."""
    x = inputs(seq, args.heads, args.head_dim, jnp.dtype(args.dtype))
    compiled = {}
    try:
        for name in sorted(fns, key=lambda n: n != "dense"):
            compiled[name] = fns[name].lower(*x).compile()
            check_fits(compiled[name], jax.local_devices()[:1], f"{name} at {seq}", "a shorter --seqs")
    except DoesNotFit as e:
        return {"seq": seq, "skipped": str(e)}
    mem = {name: program_bytes(c) for name, c in compiled.items()}
    t = alternated({name: seconds(c, *x) for name, c in compiled.items()}, args.repeats)
    return {"seq": seq, "dense_ms": t["dense"] * 1e3, "moba_ms": t["moba"] * 1e3,
            "speedup": t["dense"] / t["moba"], "dense_bytes": mem["dense"],
            "moba_bytes": mem["moba"]}  # fmt: skip


def main(argv=None):
    p = common.parser(__doc__, __file__)
    p.add_argument("--seqs", type=positive_int_list, default=[2048, 4096, 8192, 16384])
    p.add_argument("--heads", type=positive_int, default=4)
    p.add_argument("--head-dim", type=positive_int, default=64)
    p.add_argument("--block-size", type=positive_int, default=512)
    p.add_argument("--top-k", type=positive_int, default=3)
    p.add_argument("--impl", default="xla")
    p.add_argument("--repeats", type=positive_int, default=3)
    p.add_argument("--dtype", default="float32")
    args = p.parse_args(argv)
    fns = make_fns(args.block_size, args.top_k, args.impl)
    about = (
        f"batch 1, heads {args.heads}, head_dim {args.head_dim}, block {args.block_size}, "
        f"top_k {args.top_k}, {args.dtype}, moba impl {args.impl}"
    )
    with common.report(args, about) as emit:
        print(
            "| seq | dense fwd+bwd ms | MoBA fwd+bwd ms | speed-up "
            "| dense memory MiB | MoBA memory MiB | memory ratio |"
        )
        print("|---|---|---|---|---|---|---|")
        rows = []
        for seq in args.seqs:
            r = measure(fns, seq, args)
            rows.append(r)
            if "skipped" in r:
                print(f"| {seq} | skipped: {r['skipped']} |||||", flush=True)
                continue
            dense, moba = r["dense_bytes"] / 2**20, r["moba_bytes"] / 2**20
            times = f"{r['dense_ms']:,.0f} | {r['moba_ms']:,.0f} | {r['speedup']:.2f}x"
            print(f"| {seq} | {times} | {dense:,.0f} | {moba:,.0f} | {dense / moba:.1f}x |", flush=True)
        emit(rows)


if __name__ == "__main__":
    main()
