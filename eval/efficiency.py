"""Efficiency measurements of the EG-MLA paper.

    python -m eval.efficiency kv-cache --config configs/egmla/paper/mla_base.yaml [--json]
    python -m eval.efficiency decode-latency [--config a.yaml --config b.yaml ...] --context 1024,4096,16384
    python -m eval.efficiency train-cost [--config ...] [key=value ...]
    python -m eval.efficiency moba-decode [--context 8192,32768,131072] [--batch 1,8] [--json]
    python -m eval.efficiency latent-decode [--context 4096,8192,16384,32768] [--batch 1,16] [--json]

kv-cache: elements and bytes per token of the decode cache, all layers,
counted from the cache arrays the attention modules actually allocate
(`effattn_jax.model.init_cache`, built abstractly: nothing is materialised).
Floating-point entries are the KV-cache figure; integer entries (EG-MLA's
token ids) are reported on their own line. Also reports the parameter split,
with EG-MLA's gate tables apart.

decode-latency: ms per generated token, batch 1, greedy, at each context length:
the decode step (compiled once per model, cache donated as generation donates it) runs at
position `context` over a cache filled synthetically with random entries (a real prefill of
16K tokens is far too slow on a CPU); median of repeated runs after a warm-up. Without
--config it compares the paper models: MHA, MLA, EG-MLA emb256 with the gate at
the heads and at the latent, plus MLA decoding naively (no weight absorption).

moba-decode: ms per decode step of one model with core=moba against the same model with
core=dense (same parameters, one shared synthetic cache, block means taken from its keys),
alternated step by step, median per model. The model is the MoBA paper's small MHA size
(12 layers, d 768, 12 heads, block 512, top_k 3, float32); a (context, batch) whose cache
would exceed --max-cache-gib is skipped and said so. --json prints a list of
{context, batch, moba_ms, dense_ms, ratio}.

latent-decode: ms per absorbed decode step of MLA-Base and EG-MLA kv64 emb256 (the paper
configs, float32), the cache bytes a step reads (latent, RoPE key and, for EG-MLA, token ids,
every layer) and that read rate against this machine's copy bandwidth, measured in the same
run (a 1 GiB float32 array copied into a donated buffer: bytes read + written per second).
Caches are synthetic and donated; the two models alternate step by step.

train-cost: tokens/s and compiled memory of one train step for MHA, MLA and
EG-MLA emb256 at the paper width, measured in one run (batch and sequence
reduced for a CPU by the overrides, default data.batch_size=2 data.seq_len=256
model.remat=false: the paper configs remat for their TPU slice, the measured step does not).
"""

from __future__ import annotations

import functools
import json
import os
import statistics
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

from effattn_jax.cli import ArgumentParser, positive_int, positive_int_list  # noqa: E402
from effattn_jax.config import ConfigError, load_config  # noqa: E402
from effattn_jax.model import Transformer, init_cache, param_counts  # noqa: E402
from effattn_jax.ops.moba_decode import prefill_block_means  # noqa: E402
from effattn_jax.sharding import make_mesh  # noqa: E402
from effattn_jax.train.state import init_state, make_setup  # noqa: E402
from effattn_jax.train.step import make_train_step  # noqa: E402
from eval.common import compiled_bytes, synthetic_batch  # noqa: E402


def kv_cache_report(cfg) -> dict:
    model = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
    dtype = jnp.dtype(cfg.model.dtype)
    caches = jax.eval_shape(lambda: init_cache(model, batch=1, max_len=1, dtype=dtype))
    leaves = jax.tree.leaves(caches)
    floats = [x for x in leaves if jnp.issubdtype(x.dtype, jnp.floating)]
    ints = [x for x in leaves if not jnp.issubdtype(x.dtype, jnp.floating)]
    counts = param_counts(model)
    return {
        "attention_kind": cfg.attention.kind,
        "layers": cfg.model.num_layers,
        "cache_dtype": str(dtype),
        "kv_elements_per_token": int(sum(x.size for x in floats)),
        "kv_bytes_per_token": int(sum(x.size * x.dtype.itemsize for x in floats)),
        "integer_entries_per_token": int(sum(x.size for x in ints)),
        "params_total": counts["total"],
        "params_embedding": counts["embedding"],
        "params_embedding_gate": counts["embedding_gate"],
        "params_non_embedding": counts["non_embedding"],
    }


PAPER = os.path.join(os.path.dirname(__file__), "..", "configs", "egmla", "paper")
# (label, config file, overrides, decode with absorbed weights)
PAPER_DECODE = [
    ("MHA", "mha_base.yaml", [], True),
    ("MLA (absorbed)", "mla_base.yaml", [], True),
    ("MLA (naive)", "mla_base.yaml", [], False),
    ("EG-MLA emb256, gate at heads", "eg_mla_kv64_emb256.yaml", ["eg_mla.gate_at=heads"], True),
    ("EG-MLA emb256, gate at latent (absorbed)", "eg_mla_kv64_emb256.yaml", ["eg_mla.gate_at=latent"], True),
]


def _variants(configs, extra):
    if configs:
        return [(c, c, list(extra), True) for c in configs]
    return [(label, os.path.join(PAPER, f), o + list(extra), absorb) for label, f, o, absorb in PAPER_DECODE]


def compiled_decode_step(cfg, context: int, *, absorb: bool):
    """(compiled decode step, its arguments): one new token at position `context` over a cache
    of `context` earlier tokens filled with random entries (batch 1). The step returns (logits,
    cache) and donates the cache, as generation does (else each step would copy it)."""
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(model)
    step = jax.jit(
        lambda p, t, pos, c: nnx.merge(graphdef, p).decode(t, pos, c, absorb=absorb), donate_argnums=3
    )
    caches = synthetic_caches(model, 1, context + 1, jnp.dtype(cfg.model.dtype), seed=context)
    args = (params, jnp.ones((1, 1), jnp.int32), jnp.full((1, 1), context, jnp.int32), caches)
    return step.lower(*args).compile(), args


def synthetic_caches(model, batch: int, length: int, dtype=jnp.float32, *, seed: int = 0) -> list[dict]:
    """Every cache array of `init_cache` filled with random entries: normal floats, token ids
    drawn from the vocabulary (what a filled cache holds, without running a prefill)."""
    key = jax.random.key(seed)
    vocab = model.embed[...].shape[0]
    fill = lambda x, key: (
        jax.random.normal(key, x.shape, x.dtype)
        if jnp.issubdtype(x.dtype, jnp.floating)
        else jax.random.randint(key, x.shape, 0, vocab, x.dtype)
    )
    caches = init_cache(model, batch, length, dtype)
    return [
        {name: fill(x, jax.random.fold_in(key, 64 * layer + i)) for i, (name, x) in enumerate(c.items())}
        for layer, c in enumerate(caches)
    ]


def decode_bytes_accessed(cfg, context: int, *, absorb: bool) -> float:
    """Bytes one decode step moves, from XLA's cost analysis of the compiled step."""
    compiled, _ = compiled_decode_step(cfg, context, absorb=absorb)
    return float(compiled.cost_analysis()["bytes accessed"])


def decode_latency(cfg, contexts: list[int], *, absorb: bool, repeats: int = 5) -> dict[int, float]:
    """Median ms per decode step at each context length (synthetic cache, batch 1)."""
    out = {}
    for ctx in contexts:
        step, (params, tokens, pos, caches) = compiled_decode_step(cfg, ctx, absorb=absorb)
        times = []
        for i in range(repeats + 1):  # the first warms up
            t = time.perf_counter()
            logits, caches = step(params, tokens, pos, caches)  # each step writes the same slot
            jax.block_until_ready(logits)
            if i:
                times.append(time.perf_counter() - t)
        out[ctx] = statistics.median(times) * 1e3
    return out


MOBA_DECODE_MODEL = [
    "model.num_layers=12",
    "model.d_model=768",
    "model.num_heads=12",
    "model.mlp_dim=3072",
    "model.dtype=float32",
    "moba.block_size=512",
    "moba.top_k=3",
]


def moba_decode_cases(contexts, batches, max_cache_gib: float):
    """(context, batch, fits) for every pair: whether one float32 cache fits the budget."""
    per_token = 2 * 12 * 768 * 4  # K and V, 12 layers, d 768, float32
    return [(c, b, b * (c + 1) * per_token <= max_cache_gib * 2**30) for c in contexts for b in batches]


def moba_vs_dense_decode(context: int, batch: int, *, repeats: int = 5) -> dict:
    """Median ms of a decode step at position `context` for the MoBA and the dense model, the
    two alternated over one donated cache (each step writes the same slot)."""
    steps, caches = {}, None
    for core in ("moba", "dense"):
        cfg = load_config(None, MOBA_DECODE_MODEL + [f"attention.core={core}", f"data.seq_len={context + 1}"])
        model = Transformer(cfg, rngs=nnx.Rngs(0))  # same seed: the same parameters for both
        graphdef, params = nnx.split(model)
        step = jax.jit(lambda p, t, pos, c, g=graphdef: nnx.merge(g, p).decode(t, pos, c), donate_argnums=3)
        steps[core] = functools.partial(step, params)
        if caches is None:  # the MoBA model's cache: K/V plus block means
            caches = _synthetic_moba_caches(model, batch, context + 1, cfg.moba.block_size)
    tokens = jnp.ones((batch, 1), jnp.int32)
    pos = jnp.full((batch, 1), context, jnp.int32)
    times = {core: [] for core in steps}
    for i in range(repeats + 1):  # the first round compiles and warms up
        for core, step in steps.items():
            t = time.perf_counter()
            logits, caches = step(tokens, pos, caches)
            jax.block_until_ready(logits)
            if i:
                times[core].append(time.perf_counter() - t)
    moba, dense = (statistics.median(times[c]) * 1e3 for c in ("moba", "dense"))
    return {"context": context, "batch": batch, "moba_ms": moba, "dense_ms": dense, "ratio": moba / dense}


LATENT_MODELS = [("MLA-Base", "mla_base.yaml"), ("EG-MLA kv64 emb256", "eg_mla_kv64_emb256.yaml")]


def copy_bandwidth(gib: float = 1.0, repeats: int = 5) -> float:
    """Bytes read + written per second copying a float32 array into a donated buffer."""
    x = jnp.ones((int(gib * 2**28),), jnp.float32)
    copy = jax.jit(lambda x, out: x + 0.0, donate_argnums=1)
    out = copy(x, jnp.zeros_like(x))
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        out = jax.block_until_ready(copy(x, out))
        times.append(time.perf_counter() - t)
    return 2 * x.nbytes / statistics.median(times)


def latent_decode(context: int, batch: int, *, repeats: int = 5) -> list[dict]:
    """Median ms of an absorbed decode step at position `context` for each LATENT_MODELS
    entry (alternated over their donated caches) and the cache bytes each step reads."""
    steps, caches, read = {}, {}, {}
    for label, name in LATENT_MODELS:
        cfg = load_config(os.path.join(PAPER, name), [f"data.seq_len={context + 1}", "model.dtype=float32"])
        model = Transformer(cfg, rngs=nnx.Rngs(0))
        graphdef, params = nnx.split(model)
        step = jax.jit(lambda p, t, pos, c, g=graphdef: nnx.merge(g, p).decode(t, pos, c), donate_argnums=3)
        steps[label] = functools.partial(step, params)
        caches[label] = synthetic_caches(model, batch, context + 1, seed=context)
        read[label] = sum(x.nbytes for c in caches[label] for x in c.values())
    tokens, pos = jnp.ones((batch, 1), jnp.int32), jnp.full((batch, 1), context, jnp.int32)
    times = {label: [] for label in steps}
    for i in range(repeats + 1):  # the first round compiles and warms up
        for label, step in steps.items():
            t = time.perf_counter()
            logits, caches[label] = step(tokens, pos, caches[label])
            jax.block_until_ready(logits)
            if i:
                times[label].append(time.perf_counter() - t)
    return [
        {"model": label, "context": context, "batch": batch, "ms": statistics.median(times[label]) * 1e3,
         "cache_bytes_read": read[label]}
        for label in steps
    ]  # fmt: skip


def _synthetic_moba_caches(model, batch: int, length: int, block_size: int) -> list[dict]:
    """Random K/V for every slot and the block means they imply."""
    caches = synthetic_caches(model, batch, length)
    for c in caches:
        c["block_means"] = prefill_block_means(
            c["block_means"], jnp.swapaxes(c["k"], 1, 2), length, block_size=block_size, dtype=c["k"].dtype
        )
    return caches


def train_cost(cfg, steps: int = 3) -> dict:
    """Median seconds per train step, tokens/s and compiled memory (synthetic batch)."""
    setup = make_setup(cfg, make_mesh(1, 1, 1))
    state = init_state(setup)
    b, s = cfg.data.batch_size, cfg.data.seq_len
    batch = jax.device_put(synthetic_batch(b, s), setup.batch_sharding())
    step = make_train_step(setup).lower(state, batch).compile()  # compiled once: measured and run
    state, m = step(state, batch)
    jax.block_until_ready(m)
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        state, m = step(state, batch)
        jax.block_until_ready(m)
        times.append(time.perf_counter() - t)
    sec = statistics.median(times)
    return {"step_s": sec, "tokens_per_s": b * s / sec, "memory_gib": compiled_bytes(step) / 2**30}


def main(argv=None) -> int:
    p = ArgumentParser(description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    kv = sub.add_parser("kv-cache", help="KV-cache elements and bytes per token")
    kv.add_argument("--config", required=True)
    kv.add_argument("--json", action="store_true")
    kv.add_argument("overrides", nargs="*")
    dl = sub.add_parser("decode-latency", help="ms/token of batch-1 greedy decoding per context length")
    dl.add_argument("--config", action="append", default=[])
    dl.add_argument("--context", type=positive_int_list, default="1024,4096,16384")
    dl.add_argument("--repeats", type=positive_int, default=5)
    dl.add_argument("overrides", nargs="*")
    md = sub.add_parser("moba-decode", help="ms/token of MoBA vs dense decoding, one model size")
    md.add_argument("--context", type=positive_int_list, default="8192,32768,131072")
    md.add_argument("--batch", type=positive_int_list, default="1,8")
    md.add_argument("--repeats", type=positive_int, default=5)
    md.add_argument("--max-cache-gib", type=float, default=10.0, help="skip cases whose cache is larger")
    md.add_argument("--json", action="store_true")
    ld = sub.add_parser(
        "latent-decode", help="ms/token and cache read rate of absorbed MLA / EG-MLA decoding"
    )
    ld.add_argument("--context", type=positive_int_list, default="4096,8192,16384,32768")
    ld.add_argument("--batch", type=positive_int_list, default="1,16")
    ld.add_argument("--repeats", type=positive_int, default=5)
    ld.add_argument("--json", action="store_true")
    tc = sub.add_parser("train-cost", help="tokens/s and compiled memory of one train step")
    tc.add_argument("--config", action="append", default=[])
    tc.add_argument("overrides", nargs="*")
    args = p.parse_args(argv)
    try:
        if args.command == "decode-latency":
            return _print_decode_latency(args)
        if args.command == "train-cost":
            return _print_train_cost(args)
        if args.command == "moba-decode":
            return _print_moba_decode(args)
        if args.command == "latent-decode":
            return _print_latent_decode(args)
        cfg = load_config(args.config, args.overrides)
    except ConfigError as e:
        print(e, file=sys.stderr)
        return 2
    r = kv_cache_report(cfg)
    if args.json:
        print(json.dumps(r))
        return 0
    print(
        f"{args.config}: attention.kind={r['attention_kind']}, {r['layers']} layers, "
        f"cache dtype {r['cache_dtype']}"
    )
    print(
        f"KV cache: {r['kv_elements_per_token']:,} elements/token = {r['kv_bytes_per_token']:,} bytes/token"
    )
    print(f"integer cache entries (token ids): {r['integer_entries_per_token']:,}/token")
    print(
        f"params: {r['params_total']:,} total, {r['params_embedding']:,} embedding, "
        f"{r['params_embedding_gate']:,} embedding-gate, {r['params_non_embedding']:,} other"
    )
    return 0


def _print_decode_latency(args) -> int:
    contexts = args.context
    print(
        f"jax {jax.__version__} on {jax.devices()[0].device_kind}; batch 1, one decode step at each context; "
        "the cache is filled synthetically (random entries), no prefill was run"
    )
    print("| model | " + " | ".join(f"{c:,} ctx ms/token" for c in contexts) + " |")
    print("|---|" + "---|" * len(contexts))
    for label, path, overrides, absorb in _variants(args.config, args.overrides):
        ms = decode_latency(load_config(path, overrides), contexts, absorb=absorb, repeats=args.repeats)
        print(f"| {label} | " + " | ".join(f"{ms[c]:.1f}" for c in contexts) + " |", flush=True)
    return 0


def _print_moba_decode(args) -> int:
    cases = moba_decode_cases(args.context, args.batch, args.max_cache_gib)
    if not args.json:
        print(
            f"jax {jax.__version__} on {jax.devices()[0].device_kind}; 12 layers, d 768, 12 heads, "
            "block 512, top_k 3, float32; synthetic cache; median of "
            f"{args.repeats} alternated steps"
        )
        print("| context | batch | MoBA ms/token | dense ms/token | MoBA / dense |")
        print("|---|---|---|---|---|")
    rows = []
    for context, batch, fits in cases:
        if not fits:
            print(
                f"context {context}, batch {batch}: skipped, its cache exceeds --max-cache-gib "
                f"{args.max_cache_gib}",
                file=sys.stderr,
            )
            continue
        r = moba_vs_dense_decode(context, batch, repeats=args.repeats)
        rows.append(r)
        if not args.json:
            print(
                f"| {context:,} | {batch} | {r['moba_ms']:.1f} | {r['dense_ms']:.1f} | {r['ratio']:.3f} |",
                flush=True,
            )
    if args.json:
        print(json.dumps(rows))
    return 0


def _print_latent_decode(args) -> int:
    bandwidth = copy_bandwidth()
    if not args.json:
        print(
            f"jax {jax.__version__} on {jax.devices()[0].device_kind}; paper configs, float32, synthetic "
            f"donated caches, median of {args.repeats} alternated steps; copy bandwidth "
            f"{bandwidth / 1e9:.2f} GB/s (read + written)"
        )
        print("| model | context | batch | ms/token | cache MB read | read GB/s | of copy bandwidth |")
        print("|---|---|---|---|---|---|---|")
    rows = []
    for context in args.context:
        for batch in args.batch:
            for r in latent_decode(context, batch, repeats=args.repeats):
                r["read_bytes_per_s"] = r["cache_bytes_read"] / (r["ms"] / 1e3)
                r["of_copy_bandwidth"] = r["read_bytes_per_s"] / bandwidth
                rows.append(r)
                if not args.json:
                    print(
                        f"| {r['model']} | {context:,} | {batch} | {r['ms']:.1f} | "
                        f"{r['cache_bytes_read'] / 1e6:,.0f} | {r['read_bytes_per_s'] / 1e9:.2f} | "
                        f"{r['of_copy_bandwidth']:.0%} |",
                        flush=True,
                    )
    if args.json:
        print(json.dumps({"copy_bytes_per_s": bandwidth, "rows": rows}))
    return 0


def _print_train_cost(args) -> int:
    extra = args.overrides or ["data.batch_size=2", "data.seq_len=256", "model.remat=false"]
    configs = args.config or [
        os.path.join(PAPER, f) for f in ("mha_base.yaml", "mla_base.yaml", "eg_mla_kv64_emb256.yaml")
    ]
    print(
        f"jax {jax.__version__} on {jax.devices()[0].device_kind}; overrides {' '.join(extra)}; "
        "synthetic batch"
    )
    print("| config | step s | tokens/s | compiled memory GiB |")
    print("|---|---|---|---|")
    for path in configs:
        r = train_cost(load_config(path, extra))
        name = os.path.basename(path)
        print(
            f"| {name} | {r['step_s']:.2f} | {r['tokens_per_s']:,.0f} | {r['memory_gib']:.2f} |", flush=True
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
