"""CPU-scale reproductions, one command each: train a recipe's runs, evaluate each once, keep a
small summary per run under `results/<recipe>/`, and draw the recipe's figure from those
summaries alone.

    python -m eval.sweep --recipe moba-scaling-1k [--root DIR] [--results results]
                         [--only full_53k,moba_53k] [--override train.steps=2 ...] [--redraw]
                         [--remeasure-decode]

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
  geometry; configs/moba/cpu/scaling_4k/), seeds 0-4 of each: the trailing loss over the last
  1,024 positions. Superseded by moba-ladder-4k (its two sizes end inverted).
- moba-ladder-1k (eval/ladder.py): five sizes growing width and depth together, 13K-250K
  non-embedding parameters at about 20 tokens each (configs/moba/cpu/ladder/); the learning rate
  tuned per size on full attention (3 rates x 2 seeds), then full attention and MoBA at 3 seeds on
  it; the ordering check, then fits with t intervals, leave-one-size-out ranges and seed-paired
  slope and loss gaps.
- moba-ladder-4k: the same on moba-ladder-1k's three smallest sizes at 4,096-token rows, MoBA
  blocks of 256 (configs/moba/cpu/ladder_4k/), each size tuned again: the trailing loss at
  longer rows on sizes that order.
- lr-sweep-1k: the 1K set's 53K model (full attention) at a few (lr, warm-up) settings, 3 seeds
  each (eval/lr_sweep.py): the schedule of the MoBA sets, chosen for seeds that agree.
- dsa-1k (eval/dsa_report.py): DSA against moba-scaling-1k's full attention and MoBA at 53K and
  107K, 3 seeds
- dsa-ladder-1k (eval/dsa_report.py, configs/dsa/cpu/ladder/): DSA against moba-ladder-1k's full
  attention and MoBA at each tuned size of that ladder, on its tuned learning rate, 3 seeds
- dsa-continue-1k (eval/dsa_continue.py, configs/dsa/cpu/continue/): the V3.2 report's recipe (a
  dense warm-up of fresh indexers, then the sparse stage) from moba-ladder-1k's full-attention runs
  at 60K, 107K and 250K, 3 seeds, against the same runs continued as long with full attention;
  each run starts from its parent's last checkpoint (a parent whose run directory is gone is
  trained again first)
- egmla-cpu (eval/egmla_report.py): MHA, MLA and EG-MLA with 4 gate-table widths
  (configs/egmla/cpu/), the projected gate at the same widths (docs/eg_mla.md), the
  parameter-matched controls (MLA plus a non-gating table matched to emb16 and to the projected
  emb128; MLA at EG-MLA's latent width 16, alone and with emb16's table added), and seeds 1-4 of
  MLA, EG-MLA emb16, the projected emb128 and the four controls; the EG-MLA paper's four panels
  (`eval report`): accuracy vs tokens at every kept checkpoint (50 seeded questions per task,
  per-task figures and chance levels kept), validation loss over every token vs table size, KV
  cache, decode latency at 16K context (3 repeats, each kept with its commit; `--remeasure-decode`
  measures again); report.md adds the seed-paired loss gaps to MLA and what the gate buys over its
  controls, with t-based 95 % intervals.
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

from eval.dsa_continue import continue_parent, continue_runs, draw_dsa_continue  # noqa: F401
from eval.dsa_report import DSA_LADDER, draw_dsa_comparison, draw_dsa_ladder, dsa_runs  # noqa: F401
from eval.egmla_report import draw_egmla_report, egmla_runs, summarize_report  # noqa: F401 (recipes name them)
from eval.ladder import draw_ladder, draw_ladder_4k, ladder_4k_runs, ladder_runs  # noqa: F401 (recipes name them)
from eval.lr_sweep import draw_lr_sweep, summarize_final_loss  # noqa: F401 (recipes name them)
from eval.scaling_figure import draw_moba_scaling, lower_envelope, seed_gaps  # noqa: F401 (recipes name them)

REPO = Path(__file__).resolve().parent.parent


@dataclasses.dataclass(frozen=True)
class Recipe:
    config_dir: str  # relative to the repository
    runs: tuple[str, ...]  # config file stems, in training order
    summarize: str  # names of functions in this module: a run's summary, (run_dir) -> dict,
    draw: str  # the figure from all summaries, (summaries, out_dir) -> None,
    parent: str = ""  # and, for continued runs, run -> (recipe, run) it starts from (train.init_from)


def _seeded(stems: list[str], seeds=(1, 2)) -> tuple[str, ...]:
    return tuple(f"{stem}.seed{k}" for stem in stems for k in seeds)


# (peak lr, warm-up steps) tried on the 1K set's 53K model, full attention, 320 steps
LR_SWEEP_SETTINGS = (
    ("1e-3", 32),
    ("3e-3", 32),
    ("1e-2", 32),
    ("3e-2", 32),
    ("1e-2", 8),
    ("1e-2", 96),
    ("1e-2", 160),
    ("3e-3", 96),
)
MOBA_SIZES = ("13k", "53k", "107k", "240k")
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
        tuple(f"{core}_{size}" for size in ("53k", "107k") for core in ("full", "moba"))
        + _seeded([f"{c}_{size}" for size in ("53k", "107k") for c in ("full", "moba")], seeds=(1, 2, 3, 4)),
        "summarize_losses",
        "draw_moba_scaling",
    ),
    "moba-ladder-1k": Recipe("configs/moba/cpu/ladder", ladder_runs(), "summarize_losses", "draw_ladder"),
    "moba-ladder-4k": Recipe(
        "configs/moba/cpu/ladder_4k", ladder_4k_runs(), "summarize_losses", "draw_ladder_4k"
    ),
    "egmla-cpu": Recipe(
        "configs/egmla/cpu",
        egmla_runs(),
        "summarize_report",
        "draw_egmla_report",
    ),
    "dsa-1k": Recipe("configs/moba/cpu/scaling", dsa_runs(), "summarize_losses", "draw_dsa_comparison"),
    "dsa-ladder-1k": Recipe(
        "configs/dsa/cpu/ladder", dsa_runs(DSA_LADDER), "summarize_losses", "draw_dsa_ladder"
    ),
    "dsa-continue-1k": Recipe(
        "configs/dsa/cpu/continue",
        continue_runs(),
        "summarize_losses_and_kl",
        "draw_dsa_continue",
        parent="continue_parent",
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


def default_root() -> Path:
    from effattn_jax.data.fetch import cache_root

    return Path(os.environ.get("EFFATTN_SWEEP_ROOT", cache_root() / "sweeps"))


def train_run(config: Path, run_dir: Path, overrides: list[str]) -> float:
    """Trains (or resumes) one run in a child process, as a user would; returns its wall seconds."""
    start = time.perf_counter()
    cmd = [sys.executable, str(REPO / "train.py"), "--config", str(config), f"train.run_dir={run_dir}"]
    subprocess.run(cmd + overrides, check=True, cwd=REPO)
    return time.perf_counter() - start


def _launch(name: str, run: str, root: Path, overrides) -> tuple[Path, Path, list[str]]:
    """(config, run directory, overrides) of recipe `name`'s `run`; a continued run starts from its
    parent's last checkpoint, which is trained first where it is not."""
    recipe = RECIPES[name]
    stem, seed = _config_and_seed(run)
    start = (
        [f"train.init_from={trained(*globals()[recipe.parent](run), root, overrides)}"]
        if recipe.parent
        else []
    )
    return REPO / recipe.config_dir / f"{stem}.yaml", root / name / run, [*seed, *overrides, *start]


def trained(name: str, run: str, root: Path, overrides=()) -> Path:
    """The run directory of recipe `name`'s `run` with its last step trained: trained (or resumed)
    here where it is not (a fresh clone keeps the summaries, not the runs)."""
    from effattn_jax import checkpoint
    from effattn_jax.config import load_config

    config, run_dir, args = _launch(name, run, root, overrides)
    try:
        done = load_config(config, args).train.steps in checkpoint.kept_steps(run_dir)
    except checkpoint.CheckpointError:  # no run directory, or no checkpoint yet
        done = False
    if not done:
        print(f"{name}/{run}: training it first (a later run starts from it)", flush=True)
        train_run(config, run_dir, args)
    return run_dir


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
        "lr": cfg.train.lr,
        "warmup_steps": cfg.train.warmup_steps,
        "non_embedding_params": n,
        "tokens_per_param": last["tokens"] / n,
        **{k: last[k] for k in ("step", "tokens", "pflops_days", "pflops_days_6nd", "loss")},
        "every_token": report["every_token"],
        "first_window_loss": report["loss"],
        "trailing": report["trailing"],
        "buckets": report["buckets"],
        "points": points,
    }


def summarize_losses_and_kl(run_dir: Path) -> dict:
    """`summarize_losses`, and where the run logged a DSA indexer's KL (train/step.py: per token)
    its first and last logged (step, value)."""
    from effattn_jax.train.metrics import read_scalars

    kl = read_scalars(run_dir).get("indexer_kl")
    return summarize_losses(run_dir) | (
        {"indexer_kl": {"first": list(kl[0]), "last": list(kl[-1])}} if kl else {}
    )


def summarize_in_child(function: str, run_dir: Path) -> dict:
    """A run's summary computed in a fresh process, as its training is: evaluating every run of a
    recipe in one long-lived process piles up compiled programs until the JIT cannot map more
    memory (a segfault after 8 egmla-cpu runs)."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(globals()[function], run_dir).result()


RUN_SUFFIXES = {"lr": "train.lr", "warmup": "train.warmup_steps", "seed": "train.seed"}
_RUN_NAME = re.compile(r"([^.]+)((?:\.lr[0-9.e+-]+?)?)((?:\.warmup[0-9]+)?)((?:\.seed[0-9]+)?)")


def _config_and_seed(run: str) -> tuple[str, list[str]]:
    """`<config>[.lr<x>][.warmup<n>][.seed<k>]` -> (config stem, [train.lr=x, train.warmup_steps=n,
    train.seed=k]); a plain name is its own config."""
    match = _RUN_NAME.fullmatch(run)
    if match is None:
        raise ValueError(f"run name {run!r}: expected <config>[.lr<x>][.warmup<n>][.seed<k>]")
    stem, *suffixes = match.groups()
    overrides = []
    for suffix, (name, key) in zip(suffixes, RUN_SUFFIXES.items(), strict=True):
        if suffix:
            value = suffix[len(name) + 1 :]
            overrides.append(f"{key}={float(value) if name == 'lr' else int(value)}")
    return stem, overrides


def run_recipe(
    name: str, *, root: Path, results: Path, only=None, overrides=(), redraw=False, draw_options=None
) -> list[dict]:
    """Trains and summarizes every run of a recipe that has no summary yet; returns all summaries.
    `draw_options`: keyword arguments of the recipe's draw function (egmla-cpu: remeasure_decode)."""
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
        config, run_dir, args = _launch(name, run, root, overrides)
        seconds = train_run(config, run_dir, args)
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
        globals()[recipe.draw](summaries, out, **(draw_options or {}))
    return summaries


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
    p.add_argument(
        "--remeasure-decode",
        action="store_true",
        help="egmla-cpu: measure decode latency again (alone on the machine), configs unchanged or not",
    )
    args = p.parse_args(argv)
    only = None if args.only is None else args.only.split(",")
    if args.remeasure_decode and args.recipe != "egmla-cpu":
        raise SystemExit(f"--remeasure-decode: only egmla-cpu measures decoding, not {args.recipe}")
    run_recipe(
        args.recipe,
        root=args.root or default_root(),
        results=args.results,
        only=only,
        overrides=args.override,
        redraw=args.redraw,
        draw_options={"remeasure_decode": True} if args.remeasure_decode else None,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
