"""MoBA vs dense causal attention: forward+backward wall time and compiled memory.

    python -m eval.bench.attention [--seqs 2048,4096,8192,16384] [--repeats 3]
    python -m eval.bench.attention --backend gpu [--out results.md]   # on a GPU machine

GPU mode (see `gpu_main`): Pallas MoBA kernels vs cuDNN flash attention vs MoBA
xla, forward+backward, bf16, batch 1, 16 heads, head dim 128, block 512,
top_k 3, at 8K/32K/128K, with block-local ("realistic") and uniform routing.
Everything is compiled once at a small shape first (fail fast); each case then
prints its row as soon as it is measured.

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

from effattn_jax.memory import DoesNotFit, check_fits, fit_checked
from effattn_jax.ops.moba import moba_attention
from eval.bench.common import compiled_bytes, time_once


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


def structured_inputs(seq, heads, head_dim, dtype, seed=0, strength=2.0):
    """q/k sharing a slowly varying positional signal, so nearby blocks score higher
    (block-local routing, as trained models show); strength 0 gives uniform routing."""
    rng = np.random.default_rng(seed)
    pos = np.arange(seq)[:, None] / 4096.0
    freqs = np.exp(-np.arange(head_dim // 2) / (head_dim // 2) * np.log(64.0))[None]
    signal = np.concatenate([np.sin(pos * freqs), np.cos(pos * freqs)], axis=-1)[None, :, None, :]
    make = lambda: rng.standard_normal((1, seq, heads, head_dim)) + strength * signal
    return tuple(
        jnp.asarray(x, dtype) for x in (make(), make(), rng.standard_normal((1, seq, heads, head_dim)))
    )


def gpu_main(args):
    """Pallas MoBA vs cuDNN (and MoBA xla up to 32K) on the GPU, bf16, forward+backward."""
    dtype = jnp.bfloat16

    def loss(attn):
        fn = jax.value_and_grad(lambda q, k, v: jnp.sum(attn(q, k, v).astype(jnp.float32)), argnums=(0, 1, 2))
        return fit_checked(jax.jit(fn), "the case", "a shorter --seqs")

    moba = lambda impl: loss(
        lambda q, k, v: moba_attention(q, k, v, block_size=args.block_size, top_k=args.top_k, impl=impl)
    )
    fns = {
        "pallas": moba("pallas_gpu"),
        "xla": moba("xla"),
        "cudnn": loss(
            lambda q, k, v: jax.nn.dot_product_attention(
                q, k, v, is_causal=True, implementation=args.dense_impl
            )
        ),
    }
    small = structured_inputs(args.warmup_seq, args.heads, args.head_dim, dtype)
    for name, fn in fns.items():  # compile every kernel once, small: fail fast
        t = time.perf_counter()
        jax.block_until_ready(fn(*small))
        print(f"warm-up {name} at {args.warmup_seq}: {time.perf_counter() - t:.1f} s", flush=True)
    rows = [
        "| seq | routing | cuDNN ms | Pallas MoBA ms | MoBA xla ms | Pallas vs cuDNN |",
        "|---|---|---|---|---|---|",
    ]
    print(rows[0] + "\n" + rows[1], flush=True)
    for seq in [int(s) for s in args.seqs.split(",")]:
        for routing, strength in (("block-local", 2.0), ("uniform", 0.0)):
            x = structured_inputs(seq, args.heads, args.head_dim, dtype, strength=strength)
            ms = {}
            for name, fn in fns.items():
                if name == "xla" and seq > 32768:
                    continue  # gathers per tile: too slow/large at 128K, and not the GPU path
                start = time.perf_counter()
                try:
                    fn(*x)  # compile for this shape, checked to fit first
                except DoesNotFit as e:
                    print(f"skipped: {e}", flush=True)
                    ms[name] = float("nan")
                    continue
                times = []
                while len(times) < args.repeats and time.perf_counter() - start < args.case_timeout:
                    times.append(time_once(fn, x))
                ms[name] = statistics.median(times) * 1e3 if times else float("nan")
            xla_ms = ms.get("xla", float("nan"))
            row = (
                f"| {seq} | {routing} | {ms['cudnn']:,.1f} | {ms['pallas']:,.1f} | {xla_ms:,.1f} "
                f"| {ms['cudnn'] / ms['pallas']:.2f}x |"
            )
            rows.append(row)
            print(row, flush=True)
            if args.out:
                with open(args.out, "w") as f:
                    f.write(
                        f"jax {jax.__version__}, {jax.devices()[0].device_kind}\n\n" + "\n".join(rows) + "\n"
                    )


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
    p.add_argument("--backend", default="cpu", choices=["cpu", "gpu"])
    p.add_argument("--case-timeout", type=float, default=60.0, help="gpu mode: seconds per case")
    p.add_argument("--out", default="", help="gpu mode: also write the table here")
    p.add_argument("--dense-impl", default="cudnn", help="gpu mode: dense baseline (xla for a CPU dry run)")
    p.add_argument("--warmup-seq", type=int, default=2048)
    args = p.parse_args(argv)
    if args.backend == "gpu":
        defaults = {"seqs": "8192,32768,131072", "heads": 16, "head_dim": 128}
        for k, v in defaults.items():
            if getattr(args, k) == p.get_default(k):
                setattr(args, k, v)
        return gpu_main(args)
    fns = make_fns(args.block_size, args.top_k, args.impl)
    print(
        f"jax {jax.__version__}, backend {jax.default_backend()}, batch 1, heads {args.heads}, head_dim "
        f"{args.head_dim}, block {args.block_size}, top_k {args.top_k}, {args.dtype}, moba impl {args.impl}"
    )
    print(
        "| seq | dense fwd+bwd ms | MoBA fwd+bwd ms | speed-up "
        "| dense memory MiB | MoBA memory MiB | memory ratio |"
    )
    print("|---|---|---|---|---|---|---|")
    for seq in [int(s) for s in args.seqs.split(",")]:
        x = inputs(seq, args.heads, args.head_dim, jnp.dtype(args.dtype))
        compiled = {}  # compiled once, measured and run; dense first: the larger
        try:  # both run in this process, one after the other: each must fit on its own
            for name in sorted(fns, key=lambda n: n != "dense"):
                compiled[name] = fns[name].lower(*x).compile()
                check_fits(compiled[name], jax.local_devices()[:1], f"{name} at {seq}", "a shorter --seqs")
        except DoesNotFit as e:
            print(f"| {seq} | skipped: {e} |||||", flush=True)
            continue
        mem = {name: compiled_bytes(c) for name, c in compiled.items()}
        for c in compiled.values():
            time_once(c, x)  # warm up
        times = {name: [] for name in fns}
        for _ in range(args.repeats):
            for name, c in compiled.items():
                times[name].append(time_once(c, x))
        td, tm = statistics.median(times["dense"]), statistics.median(times["moba"])
        print(
            f"| {seq} | {td * 1e3:,.0f} | {tm * 1e3:,.0f} | {td / tm:.2f}x | {mem['dense'] / 2**20:,.0f} | "
            f"{mem['moba'] / 2**20:,.0f} | {mem['dense'] / mem['moba']:.1f}x |",
            flush=True,
        )


if __name__ == "__main__":
    main()
