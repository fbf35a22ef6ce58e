"""MoBA vs dense causal attention: forward+backward wall time and compiled memory.

    python -m eval.bench_attention [--seqs 2048,4096,8192,16384] [--repeats 3]

Batch 1, 4 heads, head dim 64, block 512, top_k 3, float32, on the current
backend. Dense is `jax.nn.dot_product_attention(is_causal=True)` (XLA
implementation). Timings alternate MoBA and dense runs and report medians;
memory is `compiled.memory_analysis()` (CPU devices report no live memory
stats), temp + output + argument bytes.
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from effattn_jax.ops.moba import moba_attention


def make_fns(block_size, top_k, impl):
    def moba_loss(q, k, v):
        return jnp.sum(moba_attention(q, k, v, block_size=block_size, top_k=top_k, impl=impl).astype(jnp.float32))

    def dense_loss(q, k, v):
        out = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="xla")
        return jnp.sum(out.astype(jnp.float32))

    grad = lambda f: jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2)))
    return {"moba": grad(moba_loss), "dense": grad(dense_loss)}


def inputs(seq, heads, head_dim, dtype, seed=0):
    rng = np.random.default_rng(seed)
    shape = (1, seq, heads, head_dim)
    return tuple(jnp.asarray(rng.standard_normal(shape), dtype) for _ in range(3))


def memory_bytes(fn, args) -> int:
    m = fn.lower(*args).compile().memory_analysis()
    return int(m.temp_size_in_bytes + m.output_size_in_bytes + m.argument_size_in_bytes)


def time_once(fn, args) -> float:
    t = time.perf_counter()
    jax.block_until_ready(fn(*args))
    return time.perf_counter() - t


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--seqs", default="2048,4096,8192,16384")
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--block-size", type=int, default=512)
    p.add_argument("--top-k", type=int, default=3)
    p.add_argument("--impl", default="xla")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dtype", default="float32")
    args = p.parse_args(argv)
    fns = make_fns(args.block_size, args.top_k, args.impl)
    print(f"jax {jax.__version__}, backend {jax.default_backend()}, batch 1, heads {args.heads}, head_dim "
          f"{args.head_dim}, block {args.block_size}, top_k {args.top_k}, {args.dtype}, moba impl {args.impl}")
    print("| seq | dense fwd+bwd ms | MoBA fwd+bwd ms | speed-up | dense memory MiB | MoBA memory MiB | memory ratio |")
    print("|---|---|---|---|---|---|---|")
    for seq in [int(s) for s in args.seqs.split(",")]:
        x = inputs(seq, args.heads, args.head_dim, jnp.dtype(args.dtype))
        mem = {name: memory_bytes(fn, x) for name, fn in fns.items()}
        for fn in fns.values():
            time_once(fn, x)  # compile + warm up
        times = {name: [] for name in fns}
        for _ in range(args.repeats):
            for name, fn in fns.items():
                times[name].append(time_once(fn, x))
        td, tm = statistics.median(times["dense"]), statistics.median(times["moba"])
        print(f"| {seq} | {td * 1e3:,.0f} | {tm * 1e3:,.0f} | {td / tm:.2f}x | {mem['dense'] / 2**20:,.0f} | "
              f"{mem['moba'] / 2**20:,.0f} | {mem['dense'] / mem['moba']:.1f}x |", flush=True)


if __name__ == "__main__":
    main()
