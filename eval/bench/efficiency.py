"""Efficiency measurements of the EG-MLA paper.

    python -m eval.bench.efficiency kv-cache --config configs/egmla/paper/mla_base.yaml [--json]
    python -m eval.bench.efficiency decode-latency [--config a.yaml ...] --context 1024,4096,16384 [--json]
    python -m eval.bench.efficiency train-cost [--config ...] [key=value ...] [--json]
    python -m eval.bench.efficiency moba-decode [--context 8192,32768,131072] [--batch 1,8] [--json]
    python -m eval.bench.efficiency latent-decode [--context 4096,8192,16384,32768] [--batch 1,16] [--json]

kv-cache: elements and bytes per token of the decode cache, all layers,
counted from the cache arrays the attention modules actually allocate
(`effattn_jax.model.init_cache`, built abstractly: nothing is materialised).
Floating-point entries are the KV-cache figure; integer entries (EG-MLA's
token ids) are reported on their own line. Also reports the parameter split,
with EG-MLA's gate tables apart. --json prints {attention_kind, layers, cache_dtype,
kv_elements_per_token, kv_bytes_per_token, integer_entries_per_token, params_total,
params_embedding, params_embedding_gate, params_token_table, params_non_embedding}.

decode-latency: ms per generated token, batch 1, greedy, at each context length:
the decode step (compiled once per model, cache donated as generation donates it) runs at
position `context` over a cache filled synthetically with random entries (a real prefill of
16K tokens is far too slow on a CPU); median of repeated runs after a warm-up. Without
--config it compares the paper models: MHA, MLA, EG-MLA emb256 with the gate at
the heads and at the latent, emb256 and emb1024 with the gate at the latent and projected to
256 (docs/eg_mla.md), plus MLA decoding naively (no weight absorption). --alternate: the
--config models (absorbed) stepped in turn, --repeats turns, medians (for ratios of close
steps, which one model after another measures with the machine's drift between them).
--json prints a list of {model, context, ms}.

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
Caches are synthetic and donated; the two models alternate step by step. --json prints
{copy_bytes_per_s, rows: [{model, context, batch, ms, cache_bytes_read, read_bytes_per_s,
of_copy_bandwidth}]}.

train-cost: tokens/s and compiled memory of one train step for MHA, MLA and
EG-MLA emb256 at the paper width, measured in one run (batch and sequence
reduced for a CPU by the overrides, default data.batch_size=2 data.seq_len=256
model.remat=false: the paper configs remat for their TPU slice, the measured step does not).
The memory is `effattn_jax.memory.program_bytes` of the compiled step: arguments + outputs +
temporaries, the donated train state counted once. --json prints a list of {config, step_s,
tokens_per_s, memory_gib}.

Every timing is eval/timing.py's: medians, the contenders of a table taking turns.
"""

from __future__ import annotations

import os
import sys

import jax

from effattn_jax.cli import positive_int, positive_int_list
from effattn_jax.config import ConfigError, load_config
from effattn_jax.memory import DoesNotFit, check_fits, program_bytes
from effattn_jax.sharding import make_mesh
from effattn_jax.train.state import init_state, make_setup
from effattn_jax.train.step import make_train_step
from eval.bench import common
from eval.decoding import (
    PAPER,
    copy_bandwidth,
    decode_latency,
    decode_latency_alternated,
    kv_cache_report,
    latent_decode,
    moba_decode_cases,
    moba_vs_dense_decode,
)
from eval.timing import Carry, alternated, carried

LATENT = ["eg_mla.gate_at=latent"]
PROJECTED_256 = ["eg_mla.gate_at=projected", "eg_mla.projected_dim=256"]  # MLA-Base's latent width
# (label, config file, overrides, decode with absorbed weights)
PAPER_DECODE = [
    ("MHA", "mha_base.yaml", [], True),
    ("MLA (absorbed)", "mla_base.yaml", [], True),
    ("MLA (naive)", "mla_base.yaml", [], False),
    ("EG-MLA emb256, gate at heads", "eg_mla_kv64_emb256.yaml", ["eg_mla.gate_at=heads"], True),
    ("EG-MLA emb256, gate at latent (absorbed)", "eg_mla_kv64_emb256.yaml", LATENT, True),
    ("EG-MLA emb1024, gate at latent (absorbed)", "eg_mla_kv64_emb1024.yaml", LATENT, True),
    ("EG-MLA emb256, gate projected to 256 (folded)", "eg_mla_kv64_emb256.yaml", PROJECTED_256, True),
    ("EG-MLA emb1024, gate projected to 256 (folded)", "eg_mla_kv64_emb1024.yaml", PROJECTED_256, True),
]


def _variants(configs, extra):
    if configs:
        return [(c, c, list(extra), True) for c in configs]
    return [(label, os.path.join(PAPER, f), o + list(extra), absorb) for label, f, o, absorb in PAPER_DECODE]


def train_cost(cfg, steps: int = 3) -> dict:
    """Median seconds per train step, tokens/s and compiled memory (synthetic batch)."""
    setup = make_setup(cfg, make_mesh(1, 1, 1))
    state = init_state(setup)
    b, s = cfg.data.batch_size, cfg.data.seq_len
    batch = jax.device_put(common.synthetic_batch(b, s), setup.batch_sharding())
    step = make_train_step(setup).lower(state, batch).compile()  # compiled once: measured and run
    check_fits(step, jax.local_devices()[:1], "the train step", "a smaller batch or sequence")
    sec = alternated({"step": carried(lambda state: step(state, batch), Carry(state))}, steps)["step"]
    return {"step_s": sec, "tokens_per_s": b * s / sec, "memory_gib": program_bytes(step) / 2**30}


def main(argv=None) -> int:
    p = common.parser(__doc__, __file__, json=False)
    sub = p.add_subparsers(dest="command", required=True)
    kv = sub.add_parser("kv-cache", help="KV-cache elements and bytes per token")
    kv.add_argument("--config", required=True)
    kv.add_argument("overrides", nargs="*")
    dl = sub.add_parser("decode-latency", help="ms/token of batch-1 greedy decoding per context length")
    dl.add_argument("--config", action="append", default=[])
    dl.add_argument("--context", type=positive_int_list, default="1024,4096,16384")
    dl.add_argument("--repeats", type=positive_int, default=5)
    dl.add_argument(
        "--alternate", action="store_true", help="the --config models stepped in turn, --repeats turns"
    )
    dl.add_argument("overrides", nargs="*")
    md = sub.add_parser("moba-decode", help="ms/token of MoBA vs dense decoding, one model size")
    md.add_argument("--context", type=positive_int_list, default="8192,32768,131072")
    md.add_argument("--batch", type=positive_int_list, default="1,8")
    md.add_argument("--repeats", type=positive_int, default=5)
    md.add_argument("--max-cache-gib", type=float, default=10.0, help="skip cases whose cache is larger")
    ld = sub.add_parser(
        "latent-decode", help="ms/token and cache read rate of absorbed MLA / EG-MLA decoding"
    )
    ld.add_argument("--context", type=positive_int_list, default="4096,8192,16384,32768")
    ld.add_argument("--batch", type=positive_int_list, default="1,16")
    ld.add_argument("--repeats", type=positive_int, default=5)
    tc = sub.add_parser("train-cost", help="tokens/s and compiled memory of one train step")
    tc.add_argument("--config", action="append", default=[])
    tc.add_argument("overrides", nargs="*")
    for subcommand in (kv, dl, md, ld, tc):
        common.add_json(subcommand)
    args = p.parse_args(argv)
    if args.command == "decode-latency" and args.alternate and not args.config:
        p.error("--alternate compares the --config models (absorbed): name at least one")
    run = {"kv-cache": _print_kv_cache, "decode-latency": _print_decode_latency,
           "train-cost": _print_train_cost, "moba-decode": _print_moba_decode,
           "latent-decode": _print_latent_decode}[args.command]  # fmt: skip
    try:
        with common.report(args, args.command) as emit:
            return run(args, emit)
    except ConfigError as e:
        print(e, file=sys.stderr)
        return 2
    except DoesNotFit as e:
        print(f"memory error: {e}", file=sys.stderr)
        return 2


def _print_kv_cache(args, emit) -> int:
    r = kv_cache_report(load_config(args.config, args.overrides))
    emit(r)
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
        f"{r['params_embedding_gate']:,} embedding-gate, "
        + (f"{r['params_token_table']:,} token-table, " if r["params_token_table"] else "")
        + f"{r['params_non_embedding']:,} other"
    )
    return 0


def _print_decode_latency(args, emit) -> int:
    contexts = args.context
    print(
        "batch 1, one decode step at each context; "
        "the cache is filled synthetically (random entries), no prefill was run"
    )
    print("| model | " + " | ".join(f"{c:,} ctx ms/token" for c in contexts) + " |")
    print("|---|" + "---|" * len(contexts))
    if args.alternate:
        cfgs = {path: load_config(path, args.overrides) for path in args.config}
        by_context = {c: decode_latency_alternated(cfgs, c, rounds=args.repeats) for c in contexts}
        measured = ((path, {c: by_context[c][path] for c in contexts}) for path in cfgs)
    else:
        measured = (
            (
                label,
                decode_latency(load_config(path, overrides), contexts, absorb=absorb, repeats=args.repeats),
            )
            for label, path, overrides, absorb in _variants(args.config, args.overrides)
        )
    rows = []
    for model, ms in measured:  # each row as soon as it is measured
        print(f"| {model} | " + " | ".join(f"{ms[c]:.1f}" for c in contexts) + " |", flush=True)
        rows += [{"model": model, "context": c, "ms": ms[c]} for c in contexts]
    emit(rows)
    return 0


def _print_moba_decode(args, emit) -> int:
    cases = moba_decode_cases(args.context, args.batch, args.max_cache_gib)
    print(
        "12 layers, d 768, 12 heads, block 512, top_k 3, float32; synthetic cache; "
        f"median of {args.repeats} alternated steps"
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
        print(
            f"| {context:,} | {batch} | {r['moba_ms']:.1f} | {r['dense_ms']:.1f} | {r['ratio']:.3f} |",
            flush=True,
        )
    emit(rows)
    return 0


def _print_latent_decode(args, emit) -> int:
    bandwidth = copy_bandwidth()
    print(
        f"paper configs, float32, synthetic donated caches, median of {args.repeats} alternated steps; "
        f"copy bandwidth {bandwidth / 1e9:.2f} GB/s (read + written)"
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
                print(
                    f"| {r['model']} | {context:,} | {batch} | {r['ms']:.1f} | "
                    f"{r['cache_bytes_read'] / 1e6:,.0f} | {r['read_bytes_per_s'] / 1e9:.2f} | "
                    f"{r['of_copy_bandwidth']:.0%} |",
                    flush=True,
                )
    emit({"copy_bytes_per_s": bandwidth, "rows": rows})
    return 0


def _print_train_cost(args, emit) -> int:
    extra = args.overrides or ["data.batch_size=2", "data.seq_len=256", "model.remat=false"]
    configs = args.config or [
        os.path.join(PAPER, f) for f in ("mha_base.yaml", "mla_base.yaml", "eg_mla_kv64_emb256.yaml")
    ]
    print(f"overrides {' '.join(extra)}; synthetic batch")
    print("| config | step s | tokens/s | compiled memory GiB |")
    print("|---|---|---|---|")
    rows = []
    for path in configs:
        r = {"config": os.path.basename(path)} | train_cost(load_config(path, extra))
        rows.append(r)
        print(
            f"| {r['config']} | {r['step_s']:.2f} | {r['tokens_per_s']:,.0f} | {r['memory_gib']:.2f} |",
            flush=True,
        )
    emit(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
