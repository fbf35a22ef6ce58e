"""MoBA and DSA vs dense causal attention on this machine (the XLA paths): forward+backward wall
time and compiled memory.

    python -m eval.bench.attention [--seqs 2048,4096,8192,16384] [--repeats 3] [--json]

On a GPU, the kernels against cuDNN: `python -m eval.bench.gpu_suite` (its attention section).

Batch 1, 4 heads, head dim 64, MoBA block 512 and top_k 3, DSA top-k 1,536 (as many keys as three
blocks), float32, on the current backend. Dense is `jax.nn.dot_product_attention(is_causal=True)`
(XLA implementation). DSA's indexer reads q itself (Hi = heads, Di = head dim), the head-mean of
k and unit weights, so it costs what a real indexer of that size costs; only the attention's
gradients are taken (the indexer gets none from it). Each program is compiled and checked to
fit first (one that cannot is skipped in one line, the others still run); timings alternate the
programs and report medians (eval/timing.py); memory is each compiled program's
`effattn_jax.memory.program_bytes` (XLA's memory analysis: arguments + outputs + temporaries;
CPU devices report no live memory stats). `--json` prints a list of rows {seq, dense_ms,
moba_ms, dsa_ms, speedup (dense / MoBA), dsa_speedup (dense / DSA), dense_bytes, moba_bytes,
dsa_bytes}, a program that cannot fit left out and named with its reason in `skipped`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from effattn_jax.cli import positive_int, positive_int_list, subset_of
from effattn_jax.memory import DoesNotFit, check_fits, program_bytes
from effattn_jax.ops.dsa import dsa_attention
from effattn_jax.ops.moba import moba_attention
from eval.bench import common
from eval.timing import alternated, seconds


def make_fns(block_size, top_k, impl, dsa_top_k=1536):
    def dsa_loss(q, k, v):
        index = jax.lax.stop_gradient((q, k.mean(axis=2), jnp.ones(q.shape[:3], jnp.float32)))
        return jnp.sum(dsa_attention(q, k, v, *index, top_k=dsa_top_k).astype(jnp.float32))

    def moba_loss(q, k, v):
        return jnp.sum(
            moba_attention(q, k, v, block_size=block_size, top_k=top_k, impl=impl).astype(jnp.float32)
        )

    def dense_loss(q, k, v):
        out = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="xla")
        return jnp.sum(out.astype(jnp.float32))

    grad = lambda f: jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2)))
    return {"moba": grad(moba_loss), "dense": grad(dense_loss), "dsa": grad(dsa_loss)}


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
    """One row: every program compiled and checked to fit (dense first: the largest; each runs
    alone, one after the other), then those that fit timed alternately."""
    x = inputs(seq, args.heads, args.head_dim, jnp.dtype(args.dtype))
    compiled, skipped = {}, {}
    for name in sorted(fns, key=lambda n: n != "dense"):
        compiled[name] = fns[name].lower(*x).compile()
        try:
            check_fits(compiled[name], jax.local_devices()[:1], f"{name} at {seq}", "a shorter --seqs")
        except DoesNotFit as e:
            skipped[name] = str(e)
            del compiled[name]
    row = {"seq": seq} | ({"skipped": skipped} if skipped else {})
    if not compiled:
        return row
    t = alternated({name: seconds(c, *x) for name, c in compiled.items()}, args.repeats)
    for name, c in compiled.items():
        row |= {f"{name}_ms": t[name] * 1e3, f"{name}_bytes": program_bytes(c)}
    if "dense" in t:
        row |= {
            key: t["dense"] / t[name]
            for key, name in (("speedup", "moba"), ("dsa_speedup", "dsa"))
            if name in t
        }
    return row


def _cells(row: dict) -> str:
    """The table's cells after the length: each program's time (or why it was skipped), the
    speed-ups, each program's memory."""
    skipped = row.get("skipped", {})
    ms = lambda n: (
        f"{row[f'{n}_ms']:,.0f}" if f"{n}_ms" in row else f"skipped: {skipped[n]}" if n in skipped else "—"
    )
    ratio = lambda key: f"{row[key]:.2f}x" if key in row else "—"
    mib = lambda n: f"{row[f'{n}_bytes'] / 2**20:,.0f}" if f"{n}_bytes" in row else "—"
    cells = [*(ms(n) for n in NAMES), ratio("speedup"), ratio("dsa_speedup"), *(mib(n) for n in NAMES)]
    return " | ".join(cells)


NAMES = ("dense", "moba", "dsa")


def main(argv=None):
    p = common.parser(__doc__, __file__)
    p.add_argument("--seqs", type=positive_int_list, default=[2048, 4096, 8192, 16384])
    p.add_argument("--heads", type=positive_int, default=4)
    p.add_argument("--head-dim", type=positive_int, default=64)
    p.add_argument("--block-size", type=positive_int, default=512)
    p.add_argument("--top-k", type=positive_int, default=3)
    p.add_argument("--dsa-top-k", type=positive_int, default=1536)
    p.add_argument("--programs", type=subset_of(NAMES), default=NAMES, help="which of dense,moba,dsa to run")
    p.add_argument("--impl", default="xla")
    p.add_argument("--repeats", type=positive_int, default=3)
    p.add_argument("--dtype", default="float32")
    args = p.parse_args(argv)
    fns = make_fns(args.block_size, args.top_k, args.impl, args.dsa_top_k)
    fns = {name: fns[name] for name in args.programs}
    about = (
        f"batch 1, heads {args.heads}, head_dim {args.head_dim}, block {args.block_size}, "
        f"top_k {args.top_k}, DSA top-k {args.dsa_top_k}, {args.dtype}, moba impl {args.impl}"
    )
    with common.report(args, about) as emit:
        print(
            "| seq | dense fwd+bwd ms | MoBA fwd+bwd ms | DSA fwd+bwd ms | MoBA speed-up | DSA speed-up "
            "| dense memory MiB | MoBA memory MiB | DSA memory MiB |"
        )
        print("|---|---|---|---|---|---|---|---|---|")
        rows = []
        for seq in args.seqs:
            row = measure(fns, seq, args)
            rows.append(row)
            print(f"| {seq} | {_cells(row)} |", flush=True)
        emit(rows)


if __name__ == "__main__":
    main()
