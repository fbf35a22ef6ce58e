"""Decoding tokens/s of our `Generator` beside Hugging Face transformers' `generate` on the same GPU,
for the same Llama-architecture model (random weights, bf16 weights, caches and compute), greedy.

    python -m eval.bench.gpu_transformers --side ours|transformers --shape llama_12l_d768 \
        --prompt 4096 --batch 1 [--new-tokens 64] [--repeats 3] [--trace DIR] [--json]

prints the platform line and a line per row; `--json` prints the list of rows (the suite reads it;
keys: side, shape, prompt, batch, new_tokens, dtype, impl, decode_tokens_per_s, step_ms,
generate_s, prefill_and_first_s; ours also jax, step_ops (the operations its compiled step
launches) and step_bytes_accessed; theirs torch_compile, transformers, torch; `skipped` where that
side cannot run here, `error` where a setting failed). Decode tokens/s = batch x (new_tokens - 1)
over the time of a `new_tokens` generation less that of a one-token one (prefill and first
token), each the median of alternated repeats after a warm-up that compiles: the prompt's prefill
is not counted. transformers runs with a static cache and SDPA attention, as `generate` does by
default with a static cache (recent versions compile the step with torch.compile: `torch_compile`
in the row says which), and again with compilation disabled where the version has that switch.

The GPU suite (eval/bench/gpu_suite.py, section `transformers`) runs each (shape, prompt, batch,
side) in a process of its own, so each starts with the GPU's memory free of the other's. torch and
transformers are imported only by `--side transformers`; they are not dependencies of this project,
and without them (or without a CUDA device for torch) the row says so and the suite goes on.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]

# (our config overrides, transformers config class and keyword arguments) of each shape
SHAPES = {
    "llama_12l_d768": dict(
        ours=["model.num_layers=12", "model.d_model=768", "model.num_heads=12", "model.head_dim=64",
              "model.mlp_dim=2048", "model.vocab_size=32000", "model.tie_embeddings=false",
              "model.rope_theta=10000", "model.norm_eps=1e-6"],
        hf=("LlamaConfig", "LlamaForCausalLM",
            dict(num_hidden_layers=12, hidden_size=768, num_attention_heads=12, num_key_value_heads=12,
                 head_dim=64, intermediate_size=2048, vocab_size=32000, tie_word_embeddings=False,
                 rope_theta=10000.0, rms_norm_eps=1e-6)),
    ),
    "qwen3_0.6b": dict(  # Qwen3-0.6B's shape: GQA 16/8 heads of 128, RMSNorm of q and k heads
        ours=["model.num_layers=28", "model.d_model=1024", "model.num_heads=16", "model.num_kv_heads=8",
              "model.head_dim=128", "model.mlp_dim=3072", "model.vocab_size=151936",
              "model.tie_embeddings=true", "model.qk_norm=true", "model.rope_theta=1000000",
              "model.norm_eps=1e-6"],
        hf=("Qwen3Config", "Qwen3ForCausalLM",
            dict(num_hidden_layers=28, hidden_size=1024, num_attention_heads=16, num_key_value_heads=8,
                 head_dim=128, intermediate_size=3072, vocab_size=151936, tie_word_embeddings=True,
                 rope_theta=1000000.0, rms_norm_eps=1e-6)),
    ),
    "tiny": dict(  # the CPU dry run's
        ours=["model.num_layers=2", "model.d_model=64", "model.num_heads=4", "model.mlp_dim=128",
              "model.vocab_size=256"],
        hf=("LlamaConfig", "LlamaForCausalLM",
            dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=4,
                 intermediate_size=128, vocab_size=256)),
    ),
}  # fmt: skip


def decode_rate(generate, batch: int, new_tokens: int, repeats: int) -> dict:
    """Decode tokens/s from `generate(n)` (a blocking call making n tokens per row): warmed up at
    both lengths, then `new_tokens` and 1 alternated `repeats` times (medians)."""
    from eval.timing import alternated

    def timed(n: int):
        def measure() -> float:
            t = time.perf_counter()
            generate(n)
            return time.perf_counter() - t

        return measure

    s = alternated({"all": timed(new_tokens), "first": timed(1)}, repeats)
    step_s = (s["all"] - s["first"]) / (new_tokens - 1)
    return {
        "generate_s": s["all"],
        "prefill_and_first_s": s["first"],
        "step_ms": step_s * 1e3,
        "decode_tokens_per_s": batch / step_s,
    }


NOT_LAUNCHED = {"parameter", "constant", "bitcast", "get-tuple-element", "tuple"}


def program_census(compiled) -> dict:
    """What one compiled decode step runs: the operations of its entry computation that launch work
    on the device (fusions, custom calls such as the Pallas kernels, copies; by opcode) and XLA's
    estimate of the bytes it accesses. A copy of a cache here would be a donation that failed."""
    import collections
    import re

    text = compiled.as_text()
    entry = text[text.index("\nENTRY") :]
    entry = entry[: entry.index("\n}")]
    ops = collections.Counter(op for op in re.findall(r"= \S+ ([\w-]+)\(", entry) if op not in NOT_LAUNCHED)
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    return {"step_ops": dict(ops), "step_bytes_accessed": (cost or {}).get("bytes accessed")}


def ours(
    shape: str, prompt: int, batch: int, new_tokens: int, repeats: int, dtype: str, trace: str = ""
) -> dict:
    """Our Generator: bf16 compute, weights cast to bf16 (as transformers holds them), a bf16 cache;
    with the census of its compiled step, and a profiler trace of one generation into `trace`."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from effattn_jax.config import load_config
    from effattn_jax.generate import Generator
    from effattn_jax.model import Transformer
    from effattn_jax.ops.cache import cache_length

    overrides = SHAPES[shape]["ours"] + [f"model.dtype={dtype}", f"data.seq_len={prompt + new_tokens}"]
    model = Transformer(load_config(None, overrides), rngs=nnx.Rngs(0))
    gen = Generator(model, cache_dtype=jnp.dtype(dtype))
    floating = lambda x: jnp.issubdtype(x.dtype, jnp.floating)
    gen.params = jax.tree.map(lambda x: x.astype(dtype) if floating(x) else x, gen.params)
    prompts = np.random.default_rng(0).integers(0, model.embed.shape[0], (batch, prompt)).tolist()
    rate = decode_rate(lambda n: gen.generate(prompts, n), batch, new_tokens, repeats)
    census = program_census(gen.compiled_step(batch, cache_length(prompt + new_tokens)))
    if trace:
        with jax.profiler.trace(trace):
            gen.generate(prompts, new_tokens)
    return {"impl": "effattn_jax Generator", "jax": jax.__version__} | rate | census


def transformers_side(shape: str, prompt: int, batch: int, new_tokens: int, repeats: int, dtype: str) -> list:
    """transformers' generate (static cache, SDPA, greedy): a row per compile setting that runs."""
    try:
        import torch
        import transformers
    except ImportError as e:
        return [{"skipped": f"torch and transformers do not import here ({e})"}]
    if not torch.cuda.is_available():
        return [{"skipped": "torch sees no CUDA device"}]
    config_name, model_name, kw = SHAPES[shape]["hf"]
    config = getattr(transformers, config_name)(
        **kw, max_position_embeddings=prompt + new_tokens, attn_implementation="sdpa"
    )
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = getattr(transformers, model_name)(config).to(getattr(torch, dtype)).eval()
    ids = torch.randint(0, kw["vocab_size"], (batch, prompt), device="cuda")
    common = dict(do_sample=False, cache_implementation="static", pad_token_id=0,
                  attention_mask=torch.ones_like(ids))  # fmt: skip
    rows = []
    for name, extra in [("default", {}), ("disabled", {"disable_compile": True})]:

        def generate(n, extra=extra):
            with torch.inference_mode():
                out = model.generate(ids, max_new_tokens=n, min_new_tokens=n, **common, **extra)
            torch.cuda.synchronize()
            assert out.shape == (batch, prompt + n), out.shape
            return out

        row = {"impl": "transformers generate, static cache, SDPA", "torch_compile": name,
               "transformers": transformers.__version__, "torch": torch.__version__}  # fmt: skip
        try:
            rows.append(row | decode_rate(generate, batch, new_tokens, repeats))
        except Exception as e:  # noqa: BLE001 - a setting this version lacks, or out of memory: recorded
            rows.append(row | {"error": f"{type(e).__name__}: {e}".splitlines()[0][:300]})
    return rows


def _run_case(case: dict, p: dict, seconds: float, trace: Path | None) -> list[dict]:
    """One side of one case in a process of its own (JAX in it does not preallocate): its rows."""
    env = os.environ | {"PYTHONPATH": str(ROOT), "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
    flags = dict(case, new_tokens=p["new_tokens"], repeats=p["repeats"], dtype=p["dtype"])
    if trace and case["side"] == "ours":
        flags["trace"] = trace / "{shape}_{prompt}_b{batch}".format(**case)
    cmd = [sys.executable, "-m", "eval.bench.gpu_transformers", "--json"]
    cmd += [arg for key, value in flags.items() for arg in (f"--{key.replace('_', '-')}", str(value))]
    try:
        done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=seconds)
    except subprocess.TimeoutExpired:
        return [case | {"skipped": "time budget (ran out mid-case)"}]
    if done.returncode:
        return [case | {"exit": done.returncode, "stderr_tail": done.stderr.strip().splitlines()[-3:]}]
    return json.loads(done.stdout)


def section(suite, rows: list, p: dict, trace: Path | None = None) -> None:
    """The GPU suite's section: every (shape, prompt, batch) for both sides, then ours over theirs
    (their fastest setting); our side's profiler traces under `trace`. Once transformers is found
    missing, its later cases are not started."""
    missing = False
    cases = [
        dict(shape=s, prompt=n, batch=b) for s in p["shapes"] for n in p["prompts"] for b in p["batches"]
    ]
    for case in cases:
        rates = {}
        for side in ("ours", "transformers")[: 1 if missing else 2]:
            left = suite.deadline - time.perf_counter()
            got = (
                _run_case(case | {"side": side}, p, left, trace)
                if left > 0
                else [case | {"side": side, "skipped": "time budget"}]
            )
            for row in got:
                missing = missing or (
                    side == "transformers" and "skipped" in row and "budget" not in row["skipped"]
                )
                if row.get("decode_tokens_per_s"):
                    rates.setdefault(side, []).append(row["decode_tokens_per_s"])
                suite.add(rows, row)
        if len(rates) == 2:
            suite.add(rows, case | {"ours_over_transformers": rates["ours"][0] / max(rates["transformers"])})


def main(argv=None) -> int:
    from eval.bench import common

    p = common.parser(__doc__, __file__)
    p.add_argument("--side", choices=("ours", "transformers"), required=True)
    p.add_argument("--shape", choices=sorted(SHAPES), required=True)
    p.add_argument("--prompt", type=int, required=True, help="prompt tokens per row")
    p.add_argument("--batch", type=int, required=True)
    p.add_argument("--new-tokens", type=int, default=64, help="tokens generated per row (at least 2)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--trace", default="", help="ours: a jax.profiler trace of one generation into this dir")
    args = p.parse_args(argv)
    if args.new_tokens < 2:
        p.error(f"--new-tokens={args.new_tokens}: at least 2 (the decode rate is the steps after the first)")
    case = dict(side=args.side, shape=args.shape, prompt=args.prompt, batch=args.batch,
                new_tokens=args.new_tokens, dtype=args.dtype)  # fmt: skip
    shared = (args.shape, args.prompt, args.batch, args.new_tokens, args.repeats, args.dtype)
    about = f"{args.side}: {args.shape}, prompt {args.prompt}, batch {args.batch}, {args.dtype}"
    with common.report(args, about) as emit:
        rows = [ours(*shared, trace=args.trace)] if args.side == "ours" else transformers_side(*shared)
        rows = [case | row for row in rows]
        for row in rows:
            print(_line(row), flush=True)
        emit(rows)
    return 0


def _line(row: dict) -> str:
    """A row as the line printed without --json."""
    what = f"{row['side']}" + (f" (torch_compile {row['torch_compile']})" if "torch_compile" in row else "")
    if "decode_tokens_per_s" in row:
        return f"{what}: {row['decode_tokens_per_s']:,.0f} decode tokens/s, a step {row['step_ms']:.3f} ms"
    return f"{what}: {row.get('skipped') or row.get('error')}"


if __name__ == "__main__":
    raise SystemExit(main())
