"""The MoBA scaling recipes' figure and fits (`eval.sweep`, moba-scaling-*), drawn from the runs'
summaries alone: every kept checkpoint's loss against training compute on both axes (every
matmul, and the papers' 6ND), power laws per attention kind fitted both ways with bootstrap
intervals (eval/scaling_fits.py), MoBA - full gaps paired by seed, and the paper's laws.

fits.json:
- `fits[loss][compute][method][kind]`: loss `overall` (every validation token) or `trailing`;
  compute `full` (every matmul) or `6nd`; method `envelope` or `seed_means`; kind `full
  attention` or `MoBA`; each entry as `eval.scaling_fits` documents it (a, b, their standard
  errors, residual_se, points, compute_range, b_ci95, resamples, runs, configurations) or None.
- `bootstrap`: {resamples, rng_seed, level} of every fit's b_ci95.
- `seed_gaps[loss]`: per size where both kinds share at least two seeds: `non_embedding_params`,
  `seeds`, `full` and `moba` ([mean, s.e.] of the final loss over those seeds),
  `gap_moba_minus_full` ([mean, s.e.] of the seed-paired differences) and `gap_ci95` (its
  t-based 95 % interval, eval/stats.paired_gap).
- `tokens_per_param`: run -> training tokens per non-embedding parameter.
"""

from __future__ import annotations

import json
from pathlib import Path

from eval.scaling_fits import RESAMPLES, RNG_SEED, fit_label, fit_lines, fit_scaling, law_line, lower_envelope
from eval.stats import mean_and_stderr, paired_gap

KIND_NAMES = {"dense": "full attention", "moba": "MoBA"}
COLORS = {"full attention": "C3", "MoBA": "C0"}
LOSSES = {"overall": "loss", "trailing": "trailing_loss"}  # fits.json name -> summary point key
COMPUTES = {"full": "pflops_days", "6nd": "pflops_days_6nd"}
TITLES = {"full": "every-matmul compute", "6nd": "6ND compute"}
AXIS_LABELS = {
    "full": "training compute, every matmul (PFLOP/s-days)",
    "6nd": "6·N·D, N non-embedding (PFLOP/s-days)",
}

# The MoBA paper's fitted laws L = a * C^b (C in PFLOP/s-days, 6ND), drawn beside ours for shape.
PAPER_MOBA_LAWS = {
    "LM loss @8K": {"moba": (2.625, -0.063), "full": (2.622, -0.063)},
    "positions 0-2K": {"moba": (3.075, -0.078), "full": (3.068, -0.078)},
    "trailing (last 2K of 32K)": {"moba": (1.546, -0.108), "full": (1.464, -0.097)},
}


def fit_runs(summaries: list[dict]) -> list[dict]:
    """The summaries as eval.scaling_fits' runs: every kept checkpoint on both axes, both losses."""
    return [
        {
            "run": s["run"],
            "kind": KIND_NAMES[s["core"]],
            "size": s["non_embedding_params"],
            "seed": s["seed"],
            "points": [
                {"tokens": p["tokens"]}
                | {c: p[key] for c, key in COMPUTES.items()}
                | {loss: p[key] for loss, key in LOSSES.items()}
                for p in s["points"]
            ],
        }
        for s in summaries
    ]


def seed_gaps(summaries: list[dict], value) -> list[dict]:
    """Per size with several seeds: each kind's final value (mean ± s.e. over seeds) and the
    MoBA - full gap (mean ± s.e. of the seed-paired differences, and its t-based 95 % interval)."""
    by = {}
    for s in summaries:
        by.setdefault(s["non_embedding_params"], {}).setdefault(s["core"], {})[s["seed"]] = value(s)
    rows = []
    for n, cores in sorted(by.items()):
        if pair := paired_gap(cores.get("moba", {}), cores.get("dense", {})):
            rows.append(
                {
                    "non_embedding_params": n,
                    "seeds": pair["seeds"],
                    "full": pair["b"],
                    "moba": pair["a"],
                    "gap_moba_minus_full": pair["gap"],
                    "gap_ci95": pair["gap_ci95"],
                }
            )
    return rows


def gap_lines(gaps: dict) -> list[str]:
    lines = []
    for name, rows in gaps.items():
        for row in rows:
            mean, se = row["gap_moba_minus_full"]
            lo, hi = row["gap_ci95"]
            lines.append(
                f"{name} {row['non_embedding_params']:,} params: MoBA - full = {mean:+.4f} ± {se:.4f} "
                f"(95 % t interval [{lo:+.4f}, {hi:+.4f}], {len(row['seeds'])} seeds)"
            )
    return lines


def _draw_panel(ax, summaries: list[dict], fits: dict, compute: str, loss: str) -> None:
    """One (compute axis, loss) panel: each run's curve, each kind's envelope and seed means and
    both laws, each drawn over the compute range it was fitted on."""
    import numpy as np

    ckey, lkey = COMPUTES[compute], LOSSES[loss]
    for core, kind in KIND_NAMES.items():
        color = COLORS[kind]
        runs = [s for s in summaries if s["core"] == core]
        for s in runs:
            xs, ys = [p[ckey] for p in s["points"]], [p[lkey] for p in s["points"]]
            ax.plot(xs, ys, "-", color=color, alpha=0.25, linewidth=1)
        by_size: dict[int, list[dict]] = {}
        for s in runs:
            by_size.setdefault(s["non_embedding_params"], []).append(s)
        for group in by_size.values():
            c = np.mean([s["points"][-1][ckey] for s in group])
            mean, se = mean_and_stderr([s["points"][-1][lkey] for s in group])
            ax.errorbar(
                [c], [mean], yerr=[0 if len(group) < 2 else se], fmt="s", color=color, capsize=3, ms=4
            )
        envelope = fits[loss][compute]["envelope"].get(kind)
        if envelope:
            pts = lower_envelope([(p[ckey], p[lkey]) for s in runs for p in s["points"]])
            ax.scatter(*zip(*pts, strict=True), color=color, s=10)
            ax.plot(
                *law_line(envelope),
                "--",
                color=color,
                label=f"{kind}, envelope: {fit_label(envelope, 'envelope')}",
            )
        means = fits[loss][compute]["seed_means"].get(kind)
        if means:
            ax.plot(
                *law_line(means),
                ":",
                color=color,
                lw=2,
                label=f"{kind}, seed means: {fit_label(means, 'seed_means')}",
            )
    ax.set(xscale="log", yscale="log", xlabel=AXIS_LABELS[compute], title=f"{loss} loss, {TITLES[compute]}")
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.16), frameon=False)


def _draw_paper_laws(ax) -> None:
    import numpy as np

    grid = np.geomspace(0.1, 10, 50)
    for (loss, laws), style in zip(PAPER_MOBA_LAWS.items(), ("-", ":", "-."), strict=True):
        for core, (a, b) in laws.items():
            kind = KIND_NAMES["moba" if core == "moba" else "dense"]
            ax.plot(grid, a * grid**b, style, color=COLORS[kind], label=f"paper {kind}, {loss}: {a}·C^{b}")
    ax.set(
        xscale="log",
        yscale="log",
        xlabel="PFLOP/s-days (the paper's 6ND)",
        ylabel="LM loss",
        title="the paper's fitted laws (545M-2.1B, for shape)",
    )
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.16), frameon=False)


def draw_moba_scaling(summaries: list[dict], out: Path) -> dict:
    """scaling.png: overall and trailing loss (rows) against every-matmul and 6ND compute
    (columns), the laws fitted both ways per kind (dashed: envelope, with its points; dotted:
    seed means, squares ± s.e. over seeds), the paper's laws for shape and the seed gaps; fits.json
    (module docstring); one printed line per fit and per gap. Returns the fits.json record."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fits = fit_scaling(fit_runs(summaries), tuple(LOSSES), tuple(COMPUTES))
    gaps = {
        name: seed_gaps(summaries, lambda s, key=key: s["points"][-1][key]) for name, key in LOSSES.items()
    }
    fig, axes = plt.subplots(2, 3, figsize=(19, 12))
    trailing = summaries[0]["trailing"]
    for row, loss in enumerate(LOSSES):
        for col, compute in enumerate(COMPUTES):
            _draw_panel(axes[row, col], summaries, fits, compute, loss)
        what = (
            "every validation token"
            if loss == "overall"
            else f"last {trailing['end'] - trailing['start']} positions, {trailing['documents']} documents "
            f"of >= {trailing['end'] + 1} tokens"
        )
        axes[row, 0].set_ylabel(f"LM loss ({what})")
    _draw_paper_laws(axes[0, 2])
    axes[1, 2].axis("off")
    note = gap_lines(gaps) or ["no size has two seeds of both kinds: no paired gaps"]
    axes[1, 2].text(
        0,
        1,
        "MoBA - full, final loss, paired by seed\n(mean ± s.e., t-based 95 % interval):\n\n"
        + "\n".join(note)
        + f"\n\nb intervals: {RESAMPLES} bootstrap resamples of each size's seeds\n"
        "(envelope: a resample can only leave runs out of it, never\n"
        "add one, so its interval is lopsided and may end at b)",
        va="top",
        fontsize=8,
        family="monospace",
        transform=axes[1, 2].transAxes,
    )
    s0 = summaries[0]
    n = [s["non_embedding_params"] for s in summaries]
    tpp = [s["tokens_per_param"] for s in summaries]
    fig.suptitle(
        f"CPU scale: context {s0['context']:,}, MoBA block {s0['block_size']}, top-{s0['top_k']}; "
        f"{min(n):,}-{max(n):,} non-embedding params, {min(tpp):.3g}-{max(tpp):.3g} tokens per parameter; "
        f"{len(summaries)} runs. Laws drawn only over the compute they were fitted on.",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(out / "scaling.png", dpi=100)
    plt.close(fig)
    record = {
        "fits": fits,
        "bootstrap": {"resamples": RESAMPLES, "rng_seed": RNG_SEED, "level": 0.95},
        "seed_gaps": gaps,
        "tokens_per_param": {s["run"]: round(s["tokens_per_param"], 2) for s in summaries},
    }
    (out / "fits.json").write_text(json.dumps(record, indent=1) + "\n")
    for line in fit_lines(fits) + gap_lines(gaps):
        print(line)
    print(f"wrote {out / 'scaling.png'} {out / 'fits.json'}")
    return record
