"""Loss against training compute, with power laws L(C) = a * C^b fitted per attention kind
(the MoBA paper's scaling figure).

C is training compute in PFLOP/s-days (effattn_jax/flops.py), reported on both axes: `full`,
every matmul of training, the output head and the attention at its real key count (MoBA's
sparsity, MLA / EG-MLA's head widths) included; and `6nd`, the papers' 6 N D (N non-embedding
parameters, D tokens trained on). Each run contributes its newest checkpoint; the loss is
`--loss overall`, `trailing` or `bucket:A-B` (in-document positions A..B-1, eval/lm_loss.py),
computed once per checkpoint and cached. Fits are eval/scaling_fits.py's, shared with the sweep's
MoBA figure: least squares on log L = log a + b log C over each kind's lower envelope of the runs
and over per-configuration seed means (runs of one kind, size and token count that differ in
`train.seed`), each with standard errors from the residuals and a bootstrap-over-seeds 95 %
interval for b. scaling.json: `loss`, `points` (one per run), `bootstrap` and
`fits[compute][method][kind]` (the entries eval/scaling_fits.py documents).
"""

from __future__ import annotations

import json
from pathlib import Path

from eval.processes import output_dir, writes
from eval.runs import attention_label, expand_runs, model_param_counts
from eval.scaling_fits import RESAMPLES, RNG_SEED, fit_label, fit_lines, fit_scaling, law_line


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


def run_point(run_dir: Path, *, loss: str, seq_len: int | None, bucket: int) -> dict:
    """The scaling point of a run's newest checkpoint (cached lm-loss evaluation), on both
    compute axes."""
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
        "seed": cfg.train.seed,
        "step": step,
        "non_embedding_params": n,
        "tokens": step * cfg.data.batch_size * cfg.data.seq_len,
        "pflops_days": run_pflops_days(cfg, n, step),
        "pflops_days_6nd": run_pflops_days(cfg, n, step, compute="6nd"),
        "loss": pick_loss(report, kind, a, b),
    }


COMPUTES = {"full": "pflops_days", "6nd": "pflops_days_6nd"}


def fit_points(points: list[dict], loss: str) -> dict:
    """fits[compute][method][label] of the runs' points (eval/scaling_fits.py)."""
    runs = [
        {
            "run": p["run"],
            "kind": p["label"],
            "size": p["non_embedding_params"],
            "seed": p["seed"],
            "points": [{"tokens": p["tokens"], loss: p["loss"]} | {c: p[k] for c, k in COMPUTES.items()}],
        }
        for p in points
    ]
    return fit_scaling(runs, (loss,), tuple(COMPUTES))[loss]


def plot(points: list[dict], fits: dict, loss: str, path: Path) -> None:
    """One panel per compute axis: each run's point, and per label the envelope (dashed) and
    seed-mean (dotted) laws, drawn over the compute range each was fitted on."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from eval.scaling_figure import AXIS_LABELS

    fig, axes = plt.subplots(1, len(COMPUTES), figsize=(13, 6.4))
    labels = list(dict.fromkeys(p["label"] for p in points))
    for ax, (compute, key) in zip(axes, COMPUTES.items(), strict=True):
        for i, label in enumerate(labels):
            color = f"C{i}"
            pts = [p for p in points if p["label"] == label]
            ax.scatter([p[key] for p in pts], [p["loss"] for p in pts], color=color, s=14)
            drawn = False
            for method, style in (("envelope", "--"), ("seed_means", ":")):
                if fit := fits[compute][method].get(label):
                    ax.plot(
                        *law_line(fit),
                        style,
                        color=color,
                        label=f"{label}, {method.replace('_', ' ')}: {fit_label(fit, method)}",
                    )
                    drawn = True
            if not drawn:
                ax.plot([], [], "o", color=color, label=f"{label} (one compute value, no fit)")
        ax.set(xscale="log", yscale="log", xlabel=AXIS_LABELS[compute], ylabel=f"LM loss ({loss})")
        ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.14), frameon=False)
    n = [p["non_embedding_params"] for p in points]
    d = [p["tokens"] for p in points]
    fig.suptitle(
        f"scale: {min(n):,}-{max(n):,} non-embedding params, {min(d):,}-{max(d):,} tokens; "
        f"{len(points)} runs; laws drawn only over the compute they were fitted on",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def add_arguments(p) -> None:
    p.add_argument("--runs", required=True, help="glob(s) of run directories, comma-separated")
    p.add_argument("--loss", default="overall", help="overall, trailing or bucket:A-B")
    p.add_argument("--seq-len", type=int, default=None, help="evaluation context (default: each run's)")
    p.add_argument("--bucket", type=int, default=2048, help="positions of the trailing bucket")
    p.add_argument("--out", default="eval_out/scaling", help="directory for scaling.png/.json/.csv")


def command(args) -> int:
    from tqdm import tqdm

    parse_loss(args.loss)
    runs = expand_runs(args.runs)
    points = [
        run_point(r, loss=args.loss, seq_len=args.seq_len, bucket=args.bucket)
        for r in tqdm(runs, desc="runs", disable=not writes())
    ]
    if not writes():
        return 0
    fits = fit_points(points, args.loss)
    record = {
        "loss": args.loss,
        "points": points,
        "bootstrap": {"resamples": RESAMPLES, "rng_seed": RNG_SEED, "level": 0.95},
        "fits": fits,
    }
    with output_dir(args.out) as out:
        (out / "scaling.json").write_text(json.dumps(record, indent=1))
        with open(out / "scaling.csv", "w") as f:
            f.write("label,run,seed,step,non_embedding_params,tokens,pflops_days,pflops_days_6nd,loss\n")
            for p in points:
                f.write(
                    f"{p['label']},{p['run']},{p['seed']},{p['step']},{p['non_embedding_params']},{p['tokens']},"
                    f"{p['pflops_days']:.6g},{p['pflops_days_6nd']:.6g},{p['loss']:.6f}\n"
                )
        plot(points, fits, args.loss, out / "scaling.png")
    for line in fit_lines({args.loss: fits}):
        print(line)
    print("wrote " + " ".join(f"{args.out.rstrip('/')}/scaling.{ext}" for ext in ("png", "json", "csv")))
    return 0
