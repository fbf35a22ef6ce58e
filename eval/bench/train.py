"""Training throughput vs this machine's float32 matmul peak, measured in one run.

    python -m eval.bench.train --config configs/cpu/default.yaml [key=value ...] [--repeats 5]
        [--profile 15] [--json]

Alternates timed train steps (synthetic tokens, the real step function and shardings) with a
timed 2048^3 float32 matmul, so that machine noise hits both (eval/timing.py); reports medians,
tokens/s, model FLOP/s and its fraction of the matmul peak. The peak (matmul_peak_flops_per_s) is
the matmul's rate at its median time, one call per round (BENCHMARKS.md's figures of 2026-12-02
took the median of each round's best of 5 calls: a higher peak, so lower fractions of it).
`--profile N` then traces a few steps and prints the N XLA ops that took the most time: where the
step goes.
`--json` prints {params, non_embedding_params, flops_per_token, batch, seq_len, compile_s, step_s,
tokens_per_s, model_flops_per_s, matmul_peak_flops_per_s, fraction_of_peak, head_loss_s,
head_matmuls_s, head_matmuls_flops_per_s, free_softmax_fraction_of_peak, top_ops: [[op, seconds
per step], ...]}.
"""

from __future__ import annotations

import collections
import glob
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

from effattn_jax.cli import positive_int
from effattn_jax.config import load_config
from effattn_jax.flops import train_flops_per_token
from effattn_jax.model import param_counts
from effattn_jax.ops.cross_entropy import chunk_len, chunked_cross_entropy
from effattn_jax.sharding import config_mesh
from effattn_jax.train.state import init_state, make_setup
from effattn_jax.train.step import make_train_step
from eval.bench import common
from eval.timing import Carry, alternated, carried, seconds

MATMUL_N = 2048  # the timed matmul's size: the peak is its rate


def matmul_timer(n: int):
    """Times one n x n x n float32 matmul (compiled first): the machine's matmul rate, the peak the
    step's FLOP/s is a fraction of, is 2 n^3 over its median."""
    a = jnp.asarray(np.random.default_rng(0).standard_normal((n, n)), jnp.float32)
    return _warm_timer(jax.jit(lambda x, y: x @ y), a, a)


def head_loss_timer(cfg, embed, batch):
    """Times the tied output projection + cross-entropy (forward and backward) alone, as the
    train step runs it (chunked by `model.loss_chunk_tokens`, or plain when 0): with a 50K
    vocabulary it is most of a small model's step."""
    x = jnp.asarray(
        np.random.default_rng(1).standard_normal((*batch["inputs"].shape, cfg.model.d_model)), jnp.float32
    )
    chunk = cfg.model.loss_chunk_tokens

    def loss(x, w):
        if chunk:
            return chunked_cross_entropy(x, w.T, batch["targets"], batch["loss_mask"], chunk_tokens=chunk)
        logits = jnp.dot(x, w.T, preferred_element_type=jnp.float32)
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).sum()

    return _warm_timer(jax.jit(jax.grad(loss, argnums=(0, 1))), x, embed)


def head_matmuls_timer(cfg, embed, batch):
    """Times the three matmuls of the chunked loss alone (logits, dx, dW accumulated as the loss
    does, chunk by chunk) with no softmax: the head's floor on this machine, so the line it
    prints bounds what a faster softmax could still win."""
    b, s = batch["inputs"].shape
    c = chunk_len(s, cfg.model.loss_chunk_tokens or s * b, b)
    x = jnp.asarray(np.random.default_rng(2).standard_normal((b, s, cfg.model.d_model)), jnp.float32)

    def matmuls(x, w):  # w [d, V]
        def body(dw, xc):
            logits = jnp.einsum("bcd,dv->bcv", xc, w)
            dx = jnp.einsum("bcv,dv->bcd", logits, w)
            return dw + jnp.einsum("bcd,bcv->dv", xc, logits), dx

        chunks = jnp.moveaxis(x.reshape(b, s // c, c, -1), 1, 0)
        return jax.lax.scan(body, jnp.zeros(w.shape, jnp.float32), chunks)

    return _warm_timer(jax.jit(matmuls), x, embed.T)


def top_ops(step, state, batch, steps: int = 3):
    """Traces `steps` train steps -> (XLA op, seconds per step), largest first. An op's time is
    its own: ops it encloses (a scan's body inside its while) are counted as theirs, not
    twice. Summed over the threads that ran it, so on 2 cores the ops can add up to more than
    the step; a multithreaded matmul counts its wait for the other thread. The names are the
    optimized HLO's (XLA_FLAGS="--xla_dump_to=DIR --xla_dump_hlo_as_text" shows what each is)."""
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d):
            for _ in range(steps):
                state, m = step(state, batch)
            jax.block_until_ready(m)
        (path,) = glob.glob(f"{d}/**/*.xplane.pb", recursive=True)
        data = jax.profiler.ProfileData.from_file(path)
    seconds = collections.Counter()
    for plane in data.planes:
        for line in plane.lines:
            # an op's event names its HLO instruction; executor and thread-pool events do not
            events = [e for e in line.events if any(k == "hlo_op" for k, _ in e.stats)]
            events.sort(key=lambda e: (e.start_ns, -e.duration_ns))
            enclosing = []  # (end, name) of the ops open at this event's start
            for e in events:
                while enclosing and enclosing[-1][0] <= e.start_ns:
                    enclosing.pop()
                if enclosing:
                    seconds[enclosing[-1][1]] -= e.duration_ns / 1e9 / steps
                seconds[e.name] += e.duration_ns / 1e9 / steps
                enclosing.append((e.start_ns + e.duration_ns, e.name))
    return seconds.most_common()


def _warm_timer(f, *args):
    """Runs f once (compile), then returns a timer of one call."""
    jax.block_until_ready(f(*args))
    return seconds(f, *args)


def main(argv=None):
    p = common.parser(__doc__, __file__)
    p.add_argument("--config", default="configs/cpu/default.yaml")
    p.add_argument("--repeats", type=positive_int, default=5)
    p.add_argument("--steps-per-repeat", type=positive_int, default=3)
    p.add_argument("--profile", type=int, default=0, metavar="N", help="print the N costliest XLA ops")
    p.add_argument("overrides", nargs="*")
    args = p.parse_args(argv)
    with common.report(args, f"{args.config} {' '.join(args.overrides)}".strip()) as emit:
        emit(measure(args))


def measure(args) -> dict:
    """Every figure, printed as it is known; the dict --json prints."""
    cfg = load_config(args.config, args.overrides)
    mesh = config_mesh(cfg.mesh)
    setup = make_setup(cfg, mesh)
    state = init_state(setup)
    step = make_train_step(setup)
    b, s = cfg.data.batch_size, cfg.data.seq_len
    batch = jax.device_put(common.synthetic_batch(b, s), setup.batch_sharding())
    t0 = time.perf_counter()
    state, m = step(state, batch)
    jax.block_until_ready(m)
    compile_s = time.perf_counter() - t0
    counts = param_counts(setup.model(state["params"]))
    flops_tok = train_flops_per_token(cfg, counts["non_embedding"])
    run = Carry(state)
    contenders = {  # each warmed up already
        "step": carried(lambda state: step(state, batch), run, calls=args.steps_per_repeat),
        "matmul": matmul_timer(MATMUL_N),
        "head": head_loss_timer(cfg, jnp.copy(state["params"]["embed"]), batch),
        "matmuls": head_matmuls_timer(cfg, jnp.copy(state["params"]["embed"]), batch),
    }
    med = alternated(contenders, args.repeats, warmup=0)
    st, ht, mt = med["step"], med["head"], med["matmuls"]
    peak = 2 * MATMUL_N**3 / med["matmul"]
    tok_s = b * s / st
    head_flops = 6 * b * s * cfg.model.d_model * cfg.model.vocab_size
    out = {"params": counts["total"], "non_embedding_params": counts["non_embedding"],
           "flops_per_token": flops_tok, "batch": b, "seq_len": s, "compile_s": compile_s, "step_s": st,
           "tokens_per_s": tok_s, "model_flops_per_s": tok_s * flops_tok, "matmul_peak_flops_per_s": peak,
           "fraction_of_peak": tok_s * flops_tok / peak, "head_loss_s": ht, "head_matmuls_s": mt,
           "head_matmuls_flops_per_s": head_flops / mt,
           "free_softmax_fraction_of_peak": tok_s * flops_tok * st / (st - ht + mt) / peak}  # fmt: skip
    print(
        f"model: {counts['total']:,} params ({counts['non_embedding']:,} non-embedding), "
        f"{flops_tok / 1e6:.1f} MFLOP/token, batch {b}x{s}"
    )
    print(f"first step (compile+run): {compile_s:.1f} s")
    print(f"train step median: {st * 1e3:.0f} ms  -> {tok_s:,.0f} tokens/s")
    print(
        f"model FLOP/s: {tok_s * flops_tok / 1e9:.1f} GFLOP/s; "
        f"float32 matmul peak ({MATMUL_N}^3, median of {args.repeats}): {peak / 1e9:.1f} GFLOP/s"
    )
    print(f"fraction of peak: {out['fraction_of_peak']:.1%}")
    print(
        f"output head + cross-entropy alone (fwd+bwd, loss_chunk_tokens={cfg.model.loss_chunk_tokens}): "
        f"{ht * 1e3:.0f} ms = {ht / st:.0%} of the step"
    )
    print(
        f"output head's 3 matmuls alone (no softmax): {mt * 1e3:.0f} ms = {head_flops / mt / 1e9:.1f} "
        f"GFLOP/s ({head_flops / mt / peak:.0%} of the peak); the step with a free softmax: "
        f"{out['free_softmax_fraction_of_peak']:.1%} of the peak"
    )
    out["top_ops"] = []
    if args.profile:
        print(
            f"costliest XLA ops, ms per step summed over threads (profiled; the step is {st * 1e3:.0f} ms):"
        )
        out["top_ops"] = top_ops(step, run.value, batch)[: args.profile]
        for name, sec in out["top_ops"]:
            print(f"  {sec * 1e3:8.1f}  {sec / st:5.1%}  {name}")
    return out


if __name__ == "__main__":
    main()
