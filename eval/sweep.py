"""CPU-scale reproductions, one command each: train a recipe's runs, evaluate each once, keep a
small summary per run under `results/<recipe>/`, and draw the recipe's figure from those
summaries alone.

    python -m eval.sweep --recipe moba-scaling-1k [--root DIR] [--results results]
                         [--only full_53k,moba_53k] [--override train.steps=2 ...] [--redraw]

A run whose summary exists is skipped (even on a fresh clone, where its run directory is gone),
so rerunning a finished recipe only redraws; `--only` runs a recipe in pieces. Run directories
live under `--root` (default $EFFATTN_SWEEP_ROOT or ~/.cache/effattn_jax/sweeps), outside the
checkout; an interrupted training resumes from its run directory. A run named `<config>.seed<k>`
is that config with `train.seed=k` (the repeats that give gaps their intervals); `.lr<x>` and
`.warmup<n>` before it set `train.lr` and `train.warmup_steps`. Recipes:

- moba-scaling-1k: 4 sizes x {full, MoBA} at 1,024-token rows (configs/moba/cpu/scaling/), each
  at >= 10 tokens per parameter, plus four more seeds of both at two sizes; the MoBA paper's
  scaling figure (eval/scaling_figure.py): each run's loss at every kept checkpoint against
  training compute, every matmul and 6ND, power laws per kind fitted to the lower envelope and
  to per-size seed means, each with a bootstrap-over-seeds interval for b; the paper's laws.
- moba-scaling-4k: 2 sizes x {full, MoBA} at 4,096-token rows, block 256, top-3 (the paper's
  geometry; configs/moba/cpu/scaling_4k/): the trailing loss over the last 1,024 positions.
- lr-sweep-1k: the 1K set's 53K model (full attention) at a few (lr, warm-up) settings, 3 seeds
  each (eval/lr_sweep.py): the schedule of the MoBA sets, chosen for seeds that agree.
- egmla-cpu: MHA, MLA and EG-MLA with 4 gate-table widths (configs/egmla/cpu/), the projected
  gate at the same widths (docs/eg_mla.md), and two more seeds of MLA, EG-MLA emb16 and the
  projected emb128; the EG-MLA paper's four panels (`eval report`): accuracy vs tokens at every
  kept checkpoint (50 seeded questions per task, per-task figures and chance levels kept),
  validation loss over every token vs gate-table size, KV cache, decode latency at 16K context;
  report.md adds each seeded configuration's loss gap to MLA, paired by seed.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

from eval.lr_sweep import draw_lr_sweep, summarize_final_loss  # noqa: F401 (recipes name them)
from eval.scaling_figure import draw_moba_scaling, lower_envelope, seed_gaps  # noqa: F401 (recipes name them)
from eval.stats import paired_gap

REPO = Path(__file__).resolve().parent.parent


@dataclasses.dataclass(frozen=True)
class Recipe:
    config_dir: str  # relative to the repository
    runs: tuple[str, ...]  # config file stems, in training order
    summarize: str  # names of functions in this module: a run's summary, (run_dir) -> dict,
    draw: str  # and the figure from all summaries, (summaries, out_dir) -> None


def _seeded(stems: list[str], seeds=(1, 2)) -> tuple[str, ...]:
    return tuple(f"{stem}.seed{k}" for stem in stems for k in seeds)


# (peak lr, warm-up steps) tried on the 1K set's 53K model, full attention, 320 steps
LR_SWEEP_SETTINGS = (("1e-3", 32), ("3e-3", 32), ("1e-2", 32), ("3e-2", 32), ("1e-2", 8), ("1e-2", 96), ("1e-2", 160), ("3e-3", 96))
MOBA_SIZES = ("13k", "53k", "107k", "240k")
EGMLA_WIDTHS = (16, 32, 64, 128)
RECIPES = {
    "moba-scaling-1k": Recipe(
        "configs/moba/cpu/scaling",
        tuple(f"{core}_{size}" for size in MOBA_SIZES for core in ("full", "moba"))
        + _seeded([f"{c}_{size}" for size in ("53k", "107k") for c in ("full", "moba")], seeds=(1, 2, 3, 4)),
        "summarize_losses",
        "draw_moba_scaling",
    ),
    "moba-scaling-4k": Recipe(
        "configs/moba/cpu/scaling_4k",
        tuple(f"{core}_{size}" for size in ("53k", "107k") for core in ("full", "moba")),
        "summarize_losses",
        "draw_moba_scaling",
    ),
    "egmla-cpu": Recipe(
        "configs/egmla/cpu",
        ("mha", "mla", *(f"eg_mla_emb{w}" for w in EGMLA_WIDTHS))
        + tuple(f"eg_mla_proj_emb{w}" for w in EGMLA_WIDTHS)
        + _seeded(["mla", "eg_mla_emb16", "eg_mla_proj_emb128"]),
        "summarize_report",
        "draw_egmla_report",
    ),
    "lr-sweep-1k": Recipe(
        "configs/moba/cpu/scaling",
        tuple(
            f"full_53k.lr{lr}.warmup{warmup}.seed{seed}"
            for lr, warmup in LR_SWEEP_SETTINGS
            for seed in (0, 1, 2)
        ),
        "summarize_final_loss",
        "draw_lr_sweep",
    ),
}
EGMLA_LIMIT = 50  # seeded questions per task at every kept checkpoint
EGMLA_DECODE_CONTEXT = 16384  # long enough that the cache, not dispatch, sets a step's time
EGMLA_DECODE_ROUNDS = 30


def default_root() -> Path:
    from effattn_jax.data.fetch import cache_root

    return Path(os.environ.get("EFFATTN_SWEEP_ROOT", cache_root() / "sweeps"))


def train_run(config: Path, run_dir: Path, overrides: list[str]) -> float:
    """Trains (or resumes) one run in a child process, as a user would; returns its wall seconds."""
    start = time.perf_counter()
    cmd = [sys.executable, str(REPO / "train.py"), "--config", str(config), f"train.run_dir={run_dir}"]
    subprocess.run(cmd + overrides, check=True, cwd=REPO)
    return time.perf_counter() - start


def summarize_losses(run_dir: Path) -> dict:
    """Sizes, tokens per parameter, the attention geometry and, at every kept checkpoint, the
    training compute (every matmul, and 6ND) with the validation loss over every token and the
    trailing loss; the final checkpoint's losses by position."""
    from effattn_jax import checkpoint
    from effattn_jax.flops import run_pflops_days
    from eval.lm_loss import checkpoint_lm_loss
    from eval.runs import attention_label, model_param_counts

    steps = checkpoint.kept_steps(run_dir)
    cfg = checkpoint.load_run_config(run_dir, steps[-1])
    n = model_param_counts(cfg)["non_embedding"]
    points, report = [], None
    for step in steps:
        report = checkpoint_lm_loss(run_dir, step, seq_len=cfg.data.seq_len, bucket=cfg.data.seq_len // 4)
        points.append(
            {
                "step": step,
                "tokens": step * cfg.data.batch_size * cfg.data.seq_len,
                "pflops_days": run_pflops_days(cfg, n, step),
                "pflops_days_6nd": run_pflops_days(cfg, n, step, compute="6nd"),
                "loss": report["every_token"]["loss"],
                "trailing_loss": report["trailing"]["loss"],
            }
        )
    last = points[-1]
    return {
        "label": attention_label(cfg),
        "core": cfg.attention.core,
        "context": cfg.data.seq_len,
        "block_size": cfg.moba.block_size,
        "top_k": cfg.moba.top_k,
        "seed": cfg.train.seed,
        "non_embedding_params": n,
        "tokens_per_param": last["tokens"] / n,
        **{k: last[k] for k in ("step", "tokens", "pflops_days", "pflops_days_6nd", "loss")},
        "every_token": report["every_token"],
        "first_window_loss": report["loss"],
        "trailing": report["trailing"],
        "buckets": report["buckets"],
        "points": points,
    }


def summarize_report(run_dir: Path) -> dict:
    """`eval report`'s entry of one run: every kept checkpoint's accuracy (EGMLA_LIMIT questions per
    task) and validation loss, parameter counts, KV-cache elements per token. Decode latency is
    measured for all runs together when drawing (`measure_decode`)."""
    from effattn_jax import checkpoint
    from eval.curves import collect
    from eval.decoding import kv_cache_report
    from eval.tasks import parse_tasks

    cfg = checkpoint.load_run_config(run_dir, checkpoint.kept_steps(run_dir)[-1])
    return collect([run_dir], parse_tasks(None), EGMLA_LIMIT)[0] | {
        "kv_elements_per_token": kv_cache_report(cfg)["kv_elements_per_token"],
        "kind": cfg.attention.kind,
        "gate_at": cfg.eg_mla.gate_at if cfg.attention.kind == "eg_mla" else None,
        "seed": cfg.train.seed,
    }


def measure_decode(summaries: list[dict], out: Path) -> dict:
    """run -> decode ms/token at EGMLA_DECODE_CONTEXT (batch 1, synthetic cache: it depends on the
    config only, so a config's seeds are measured once), every config stepped in turn in one
    process (`decode_latency_alternated`) so the ratios compare like with like; kept in
    decode_latency.json and remeasured only when the set of runs changes."""
    import datetime

    import jax

    path = out / "decode_latency.json"
    runs = [s["run"] for s in summaries]
    if path.exists() and sorted(json.loads(path.read_text())["ms_per_token"]) == sorted(runs):
        return json.loads(path.read_text())["ms_per_token"]
    from effattn_jax.config import load_config
    from eval.decoding import decode_latency_alternated

    key = lambda s: json.dumps([s["config"], s["overrides"]])  # a config's seeds decode alike
    cfgs = {key(s): load_config(REPO / s["config"], s["overrides"]) for s in summaries}
    by_config = decode_latency_alternated(cfgs, EGMLA_DECODE_CONTEXT, rounds=EGMLA_DECODE_ROUNDS)
    record = {
        "context": EGMLA_DECODE_CONTEXT,
        "batch": 1,
        "rounds": EGMLA_DECODE_ROUNDS,
        "date": datetime.date.today().isoformat(),
        "jax": jax.__version__,
        "backend": jax.default_backend(),
        "ms_per_token": {s["run"]: by_config[key(s)] for s in summaries},
    }
    path.write_text(json.dumps(record, indent=1) + "\n")
    return record["ms_per_token"]


def summarize_in_child(function: str, run_dir: Path) -> dict:
    """A run's summary computed in a fresh process, as its training is: evaluating every run of a
    recipe in one long-lived process piles up compiled programs until the JIT cannot map more
    memory (a segfault after 8 egmla-cpu runs)."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(globals()[function], run_dir).result()


RUN_SUFFIXES = {"lr": ("train.lr", float), "warmup": ("train.warmup_steps", int), "seed": ("train.seed", int)}
_SUFFIX = re.compile(r"\.(lr|warmup|seed)([0-9][0-9e.+-]*?)(?=\.(?:lr|warmup|seed)|$)")


def _config_and_seed(run: str) -> tuple[str, list[str]]:
    """`<config>[.lr<x>][.warmup<n>][.seed<k>]` -> (config stem, [train.lr=x, train.warmup_steps=n,
    train.seed=k]); a plain name is its own config."""
    stem = run.split(".")[0]
    overrides = []
    for name, value in _SUFFIX.findall(run[len(stem) :]):
        key, kind = RUN_SUFFIXES[name]
        overrides.append(f"{key}={kind(value)}")
    if "".join(f".{n}{v}" for n, v in _SUFFIX.findall(run[len(stem) :])) != run[len(stem) :]:
        raise ValueError(f"run name {run!r}: expected <config>[.lr<x>][.warmup<n>][.seed<k>]")
    return stem, overrides


def run_recipe(name: str, *, root: Path, results: Path, only=None, overrides=(), redraw=False) -> list[dict]:
    """Trains and summarizes every run of a recipe that has no summary yet; returns all summaries."""
    from effattn_jax import storage

    recipe = RECIPES[name]
    out = results / name
    out.mkdir(parents=True, exist_ok=True)
    runs = [r for r in recipe.runs if only is None or r in only]
    if only is not None and (unknown := sorted(set(only) - set(recipe.runs))):
        raise SystemExit(f"--only: {', '.join(unknown)} not in {name} (runs: {', '.join(recipe.runs)})")
    for run in [] if redraw else runs:
        summary_path = out / f"{run}.json"
        if summary_path.exists():
            print(f"{run}: summary exists, skipped", flush=True)
            continue
        stem, seed = _config_and_seed(run)
        config = REPO / recipe.config_dir / f"{stem}.yaml"
        run_dir = root / name / run
        seconds = train_run(config, run_dir, [*seed, *overrides])
        start = time.perf_counter()
        summary = summarize_in_child(recipe.summarize, run_dir) | {  # "run": the name, not the directory
            "recipe": name,
            "run": run,
            "config": str(config.relative_to(REPO)),
            "overrides": list(overrides),
            "train_seconds": round(seconds, 1),
        }
        summary["eval_seconds"] = round(time.perf_counter() - start, 1)
        storage.write_atomic(summary_path, json.dumps(summary, indent=1) + "\n")
        print(f"{run}: summary written, {summary['train_seconds']} s training", flush=True)
    summaries = [json.loads((out / f"{r}.json").read_text()) for r in runs if (out / f"{r}.json").exists()]
    if summaries:
        globals()[recipe.draw](summaries, out)
    return summaries


def gaps_to_mla(summaries: list[dict]) -> dict[str, dict]:
    """label -> its final validation loss minus MLA's, paired by seed, for every configuration
    that shares at least two seeds with MLA."""
    by: dict[str, dict[int, float]] = {}
    for s in summaries:
        by.setdefault(s["label"], {})[s["seed"]] = s["points"][-1]["val_loss"]
    mla = next((s["label"] for s in summaries if s["kind"] == "mla"), None)
    pairs = {label: paired_gap(values, by[mla]) for label, values in by.items() if mla and label != mla}
    return {label: pair for label, pair in pairs.items() if pair}


def draw_egmla_report(summaries: list[dict], out: Path) -> None:
    """report.png (the four panels) and report.md (the table), as `eval report` draws them."""
    from eval.curves import scale_note
    from eval.report import markdown, plot

    ms = measure_decode(summaries, out)
    summaries = [s | {"decode_ms_per_token": ms[s["run"]]} for s in summaries]
    note = scale_note(summaries) + f", {EGMLA_LIMIT} questions/task (fixed budget, not compute-optimal)"
    table = markdown(summaries, EGMLA_DECODE_CONTEXT, note)
    if gaps := gaps_to_mla(summaries):
        table += "\nFinal validation loss minus MLA's, paired by seed (mean ± standard error):\n\n"
        for label, pair in gaps.items():
            mean, se = pair["gap"]
            table += f"- {label}: {mean:+.4f} ± {se:.4f} ({len(pair['seeds'])} seeds)\n"
    (out / "report.md").write_text(table)
    plot(summaries, out / "report.png", EGMLA_DECODE_CONTEXT, note)
    print(table, end="")
    print(f"wrote {out / 'report.png'} {out / 'report.md'}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m eval.sweep", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--recipe", required=True, choices=sorted(RECIPES))
    p.add_argument("--root", type=Path, default=None, help="run directories (default: see above)")
    p.add_argument("--results", type=Path, default=REPO / "results", help="summaries and figures")
    p.add_argument("--only", default=None, help="comma-separated run names of the recipe")
    p.add_argument("--override", nargs="*", default=[], help="key=value added to every run's config")
    p.add_argument("--redraw", action="store_true", help="train nothing; draw from the summaries")
    args = p.parse_args(argv)
    only = None if args.only is None else args.only.split(",")
    run_recipe(
        args.recipe,
        root=args.root or default_root(),
        results=args.results,
        only=only,
        overrides=args.override,
        redraw=args.redraw,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
