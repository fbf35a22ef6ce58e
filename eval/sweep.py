"""CPU-scale reproductions, one command each: train a recipe's runs, evaluate each once, keep a
small summary per run under `results/<recipe>/`, and draw the recipe's figure from those
summaries alone.

    python -m eval.sweep --recipe moba-scaling-cpu [--root DIR] [--results results]
                         [--only full_s1,moba_s1] [--override train.steps=2 ...] [--redraw]

A run whose summary exists is skipped (even on a fresh clone, where its run directory is gone),
so rerunning a finished recipe only redraws. Run directories live under `--root` (default
$EFFATTN_SWEEP_ROOT or ~/.cache/effattn_jax/sweeps), outside the checkout; an interrupted
training resumes from its run directory. Recipes:

- moba-scaling-cpu: 4 sizes x {full, moba} (configs/moba/cpu/scaling/), then the MoBA paper's
  scaling figure: LM loss (overall and trailing) against training compute, log-log, a power
  law fitted per attention kind, the paper's fitted laws drawn beside for shape.
- egmla-cpu: MHA, MLA and EG-MLA with 4 gate-table widths (configs/egmla/cpu/), then the EG-MLA
  paper's four panels (`eval report`): accuracy vs tokens at every kept checkpoint (50 seeded
  questions per task, standard errors), loss vs gate-table size, KV cache, decode latency.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


@dataclasses.dataclass(frozen=True)
class Recipe:
    config_dir: str  # relative to the repository
    runs: tuple[str, ...]  # config file stems, in training order
    summarize: str  # names of functions in this module: a run's summary, (run_dir) -> dict,
    draw: str  # and the figure from all summaries, (summaries, out_dir) -> None


RECIPES = {
    "moba-scaling-cpu": Recipe(
        "configs/moba/cpu/scaling",
        tuple(f"{core}_s{i}" for i in (1, 2, 3, 4) for core in ("full", "moba")),
        "summarize_losses",
        "draw_moba_scaling",
    ),
    "egmla-cpu": Recipe(
        "configs/egmla/cpu",
        ("mha", "mla", "eg_mla_emb16", "eg_mla_emb32", "eg_mla_emb64", "eg_mla_emb128"),
        "summarize_report",
        "draw_egmla_report",
    ),
}
EGMLA_LIMIT = 50  # seeded questions per task at every kept checkpoint
EGMLA_DECODE_CONTEXT = 2048

# The MoBA paper's fitted laws L = a * C^b (C in PFLOP/s-days), drawn beside ours for shape.
PAPER_MOBA_LAWS = {
    "LM loss @8K": {"moba": (2.625, -0.063), "full": (2.622, -0.063)},
    "positions 0-2K": {"moba": (3.075, -0.078), "full": (3.068, -0.078)},
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


def summarize_losses(run_dir: Path) -> dict:
    """Sizes, tokens, compute, and the losses (overall, by position, trailing) of the final checkpoint."""
    from effattn_jax import checkpoint
    from effattn_jax.flops import run_pflops_days
    from eval.lm_loss import checkpoint_lm_loss
    from eval.runs import attention_label, model_param_counts

    step = checkpoint.kept_steps(run_dir)[-1]
    cfg = checkpoint.load_run_config(run_dir, step)
    report = checkpoint_lm_loss(run_dir, step, seq_len=cfg.data.seq_len, bucket=cfg.data.seq_len // 4)
    n = model_param_counts(cfg)["non_embedding"]
    return {
        "label": attention_label(cfg),
        "step": step,
        "non_embedding_params": n,
        "tokens": step * cfg.data.batch_size * cfg.data.seq_len,
        "pflops_days": run_pflops_days(cfg, n, step),
        "pflops_days_with_attention": run_pflops_days(cfg, n, step, attention=True),
        "loss": report["loss"],
        "trailing": report["trailing"],
        "buckets": report["buckets"],
        "eval_context": cfg.data.seq_len,
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
    }


def measure_decode(summaries: list[dict], out: Path) -> dict:
    """run -> decode ms/token at EGMLA_DECODE_CONTEXT (batch 1, synthetic cache: it depends on the
    config only), every run measured in one process so the ratios compare like with like; kept
    in decode_latency.json and remeasured only when the set of runs changes."""
    import datetime

    import jax

    path = out / "decode_latency.json"
    runs = [s["run"] for s in summaries]
    if path.exists() and sorted(json.loads(path.read_text())["ms_per_token"]) == sorted(runs):
        return json.loads(path.read_text())["ms_per_token"]
    from effattn_jax.config import load_config
    from eval.decoding import decode_latency

    ms = {}
    for s in summaries:
        cfg = load_config(REPO / s["config"], s["overrides"])
        ms[s["run"]] = decode_latency(cfg, [EGMLA_DECODE_CONTEXT], absorb=True)[EGMLA_DECODE_CONTEXT]
    record = {
        "context": EGMLA_DECODE_CONTEXT,
        "batch": 1,
        "date": datetime.date.today().isoformat(),
        "jax": jax.__version__,
        "backend": jax.default_backend(),
        "ms_per_token": ms,
    }
    path.write_text(json.dumps(record, indent=1) + "\n")
    return ms


def run_recipe(name: str, *, root: Path, results: Path, only=None, overrides=(), redraw=False) -> list[dict]:
    """Trains and summarizes every run of a recipe that has no summary yet; returns all summaries."""
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
        config = REPO / recipe.config_dir / f"{run}.yaml"
        run_dir = root / name / run
        seconds = train_run(config, run_dir, list(overrides))
        start = time.perf_counter()
        summary = globals()[recipe.summarize](run_dir) | {  # "run": the name, not the directory
            "recipe": name,
            "run": run,
            "config": str(config.relative_to(REPO)),
            "overrides": list(overrides),
            "train_seconds": round(seconds, 1),
        }
        summary["eval_seconds"] = round(time.perf_counter() - start, 1)
        tmp = summary_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(summary, indent=1) + "\n")
        tmp.rename(summary_path)
        print(f"{run}: summary written, {summary['train_seconds']} s training", flush=True)
    summaries = [json.loads((out / f"{r}.json").read_text()) for r in runs if (out / f"{r}.json").exists()]
    if summaries:
        globals()[recipe.draw](summaries, out)
    return summaries


def draw_moba_scaling(summaries: list[dict], out: Path) -> None:
    """scaling.png: overall and trailing loss vs compute with fits, and the paper's laws;
    fits.json: the fitted (a, b) per attention kind and loss."""
    import matplotlib

    from eval.scaling import draw_fits, fits_per_label

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    losses = {"overall": lambda p: p["loss"], "trailing": lambda p: p["trailing"]["loss"]}
    fits = {name: fits_per_label(summaries, key) for name, key in losses.items()}
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.6))
    for ax, (name, key) in zip(axes, losses.items(), strict=False):
        draw_fits(ax, summaries, fits[name], key)
        trailing = summaries[0]["trailing"]
        what = (
            "all positions" if name == "overall" else f"last {trailing['end'] - trailing['start']} positions"
        )
        ax.set(
            xlabel="training compute (PFLOP/s-days, 6ND)",
            ylabel=f"LM loss ({what})",
            title=f"ours: {name} loss",
        )
        ax.legend(fontsize=7)
    ax = axes[2]
    grid = np.geomspace(0.1, 10, 50)
    for (loss, laws), style in zip(PAPER_MOBA_LAWS.items(), ("-", ":"), strict=True):
        for i, (kind, (a, b)) in enumerate(laws.items()):
            ax.plot(grid, a * grid**b, style, color=f"C{1 - i}", label=f"paper {kind}, {loss}: {a}·C^{b}")
    ax.set(
        xscale="log",
        yscale="log",
        xlabel="PFLOP/s-days",
        ylabel="LM loss",
        title="the paper's fitted laws (545M-2.1B, for shape)",
    )
    ax.legend(fontsize=7)
    n = [p["non_embedding_params"] for p in summaries]
    d = sorted({p["tokens"] for p in summaries})
    tokens = ", ".join(f"{t:,}" for t in d)
    fig.suptitle(
        f"CPU scale: {min(n):,}-{max(n):,} non-embedding params, {tokens} tokens per run "
        "(fixed budget, not compute-optimal)",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(out / "scaling.png", dpi=100)
    plt.close(fig)
    (out / "fits.json").write_text(json.dumps(fits, indent=1) + "\n")
    for name, per_label in fits.items():
        for label, fit in per_label.items():
            if fit:
                print(f"{name} {label}: L = {fit['a']:.4g} * C^{fit['b']:.4f} (±{fit['b_stderr']:.2g})")
    print(f"wrote {out / 'scaling.png'} {out / 'fits.json'}")


def draw_egmla_report(summaries: list[dict], out: Path) -> None:
    """report.png (the four panels) and report.md (the table), as `eval report` draws them."""
    from eval.curves import scale_note
    from eval.report import markdown, plot

    ms = measure_decode(summaries, out)
    summaries = [s | {"decode_ms_per_token": ms[s["run"]]} for s in summaries]
    note = scale_note(summaries) + f", {EGMLA_LIMIT} questions/task (fixed budget, not compute-optimal)"
    (out / "report.md").write_text(markdown(summaries, EGMLA_DECODE_CONTEXT, note))
    plot(summaries, out / "report.png", EGMLA_DECODE_CONTEXT, note)
    print(markdown(summaries, EGMLA_DECODE_CONTEXT, note), end="")
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
