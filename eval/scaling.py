"""Loss against training compute, with a power law L(C) = a * C^b fitted per attention kind
(the MoBA paper's scaling figure).

C is training compute in PFLOP/s-days (effattn_jax/flops.py): by default every matmul of
training, the output head and the attention at its real key count (MoBA's sparsity, MLA /
EG-MLA's head widths) included; `--compute 6nd` is the papers' 6 N D (N non-embedding
parameters, D tokens trained on), labelled as such. Each run contributes its newest checkpoint; the loss
is `--loss overall`, `trailing` or `bucket:A-B` (in-document positions A..B-1, eval/lm_loss.py),
computed once per checkpoint and cached. The fit is least squares on log L = log a + b log C;
uncertainties are standard errors from the residuals (none with two points).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

from effattn_jax.flops import COMPUTE_MEASURES
from eval.processes import output_dir, writes
from eval.runs import attention_label, expand_runs, model_param_counts


def fit_power_law(compute, loss) -> dict:
    """(a, b) of L = a * C^b by least squares in log space, with standard errors (nan for n < 3)."""
    x, y = np.log(np.asarray(compute, float)), np.log(np.asarray(loss, float))
    if len(x) < 2 or np.ptp(x) == 0:
        raise ValueError(f"a power-law fit needs at least two distinct compute values, got {len(x)} points")
    design = np.stack([np.ones_like(x), x], axis=1)
    coef, *_ = np.linalg.lstsq(design, y, rcond=None)
    dof = len(x) - 2
    if dof > 0:
        sigma2 = float(((y - design @ coef) ** 2).sum()) / dof
        cov = sigma2 * np.linalg.inv(design.T @ design)
        se_log_a, se_b = math.sqrt(cov[0, 0]), math.sqrt(cov[1, 1])
    else:
        se_log_a = se_b = float("nan")
    a = math.exp(coef[0])
    return {"a": a, "a_stderr": a * se_log_a, "b": float(coef[1]), "b_stderr": se_b, "points": len(x)}


def parse_loss(spec: str) -> tuple[str, int | None, int | None]:
    """'overall' | 'trailing' | 'bucket:A-B' -> (kind, A, B)."""
    if spec in ("overall", "trailing"):
        return spec, None, None
    if spec.startswith("bucket:"):
        try:
            a, b = (int(v) for v in spec[len("bucket:") :].split("-"))
            if 0 <= a < b:
                return "bucket", a, b
        except ValueError:
            pass
    raise ValueError(f"--loss={spec!r}: expected overall, trailing or bucket:A-B (e.g. bucket:0-2048)")


def pick_loss(report: dict, kind: str, a: int | None, b: int | None) -> float:
    if kind == "overall":
        return report["loss"]
    if kind == "trailing":
        return report["trailing"]["loss"]
    for bucket in report["buckets"]:
        if (bucket["start"], bucket["end"]) == (a, b):
            return bucket["loss"]
    raise ValueError(f"bucket {a}-{b} is not one of this evaluation's buckets (context {report['seq_len']})")


def run_point(run_dir: Path, *, loss: str, seq_len: int | None, bucket: int, compute: str) -> dict:
    """The scaling point of a run's newest checkpoint (cached lm-loss evaluation)."""
    from effattn_jax import checkpoint
    from effattn_jax.flops import run_pflops_days
    from eval.lm_loss import checkpoint_lm_loss

    kind, a, b = parse_loss(loss)
    step = checkpoint.kept_steps(run_dir)[-1]
    cfg = checkpoint.load_run_config(run_dir, step)
    bucket = (b - a) if kind == "bucket" else bucket
    report = checkpoint_lm_loss(run_dir, step, seq_len=seq_len or cfg.data.seq_len, bucket=bucket)
    n = model_param_counts(cfg)["non_embedding"]
    return {
        "run": str(run_dir),
        "label": attention_label(cfg),
        "step": step,
        "non_embedding_params": n,
        "tokens": step * cfg.data.batch_size * cfg.data.seq_len,
        "pflops_days": run_pflops_days(cfg, n, step, compute=compute),
        "loss": pick_loss(report, kind, a, b),
    }


def fits_per_label(points: list[dict], value=lambda p: p["loss"]) -> dict:
    """label -> fit_power_law of value(point) against pflops_days (None for one compute value)."""
    fits = {}
    for label in sorted({p["label"] for p in points}):
        pts = [p for p in points if p["label"] == label]
        cs = [p["pflops_days"] for p in pts]
        fits[label] = fit_power_law(cs, [value(p) for p in pts]) if len(set(cs)) > 1 else None
    return fits


def draw_fits(ax, points: list[dict], fits: dict, value=lambda p: p["loss"]) -> None:
    """Each label's points and fitted line (dashed, over its compute range) on a log-log axis."""
    for i, (label, fit) in enumerate(sorted(fits.items())):
        pts = [p for p in points if p["label"] == label]
        color = f"C{i}"
        cs = np.array([p["pflops_days"] for p in pts])
        ax.scatter(cs, [value(p) for p in pts], color=color)
        if fit:
            grid = np.geomspace(cs.min() / 2, cs.max() * 2, 50)
            se = (
                "" if fit["b_stderr"] != fit["b_stderr"] else f" (b ± {fit['b_stderr']:.3f})"
            )  # nan: 2 points
            ax.plot(
                grid,
                fit["a"] * grid ** fit["b"],
                "--",
                color=color,
                label=f"{label}: {fit['a']:.3g}·C^{fit['b']:.3f}{se}",
            )
        else:
            ax.plot([], [], "o", color=color, label=f"{label} (too few points to fit)")
    ax.set_xscale("log")
    ax.set_yscale("log")


COMPUTE_LABELS = {
    "full": "training compute, every matmul (PFLOP/s-days)",
    "6nd": "6·N·D, N non-embedding (PFLOP/s-days)",
}


def plot(points: list[dict], fits: dict, loss: str, path: Path, compute: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.8))
    draw_fits(ax, points, fits)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel(COMPUTE_LABELS[compute])
    ax.set_ylabel(f"LM loss ({loss})")
    n = [p["non_embedding_params"] for p in points]
    d = [p["tokens"] for p in points]
    ax.set_title(
        f"scale: {min(n):,}-{max(n):,} non-embedding params, {min(d):,}-{max(d):,} tokens", fontsize=9
    )
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def add_arguments(p) -> None:
    p.add_argument("--runs", required=True, help="glob(s) of run directories, comma-separated")
    p.add_argument("--loss", default="overall", help="overall, trailing or bucket:A-B")
    p.add_argument(
        "--compute",
        choices=COMPUTE_MEASURES,
        default="full",
        help="full: every matmul of training (default); 6nd: 6 x non-embedding params x tokens",
    )
    p.add_argument("--seq-len", type=int, default=None, help="evaluation context (default: each run's)")
    p.add_argument("--bucket", type=int, default=2048, help="positions of the trailing bucket")
    p.add_argument("--out", default="eval_out/scaling", help="directory for scaling.png/.json/.csv")


def command(args) -> int:
    from tqdm import tqdm

    parse_loss(args.loss)
    runs = expand_runs(args.runs)
    points = [
        run_point(r, loss=args.loss, seq_len=args.seq_len, bucket=args.bucket, compute=args.compute)
        for r in tqdm(runs, desc="runs", disable=not writes())
    ]
    if not writes():
        return 0
    fits = fits_per_label(points)
    with output_dir(args.out) as out:
        (out / "scaling.json").write_text(
            json.dumps({"loss": args.loss, "compute": args.compute, "points": points, "fits": fits}, indent=1)
        )
        with open(out / "scaling.csv", "w") as f:
            f.write("label,run,step,non_embedding_params,tokens,pflops_days,loss\n")
            for p in points:
                f.write(
                    f"{p['label']},{p['run']},{p['step']},{p['non_embedding_params']},{p['tokens']},{p['pflops_days']:.6g},{p['loss']:.6f}\n"
                )
        plot(points, fits, args.loss, out / "scaling.png", args.compute)
    for label, fit in fits.items():
        if fit:
            print(
                f"{label}: L = {fit['a']:.4g} (±{fit['a_stderr']:.2g}) * C^{fit['b']:.4f} "
                f"(±{fit['b_stderr']:.2g}), {fit['points']} runs"
            )
        else:
            print(f"{label}: one compute value, no fit")
    print("wrote " + " ".join(f"{args.out.rstrip('/')}/scaling.{ext}" for ext in ("png", "json", "csv")))
    return 0
