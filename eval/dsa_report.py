"""The dsa-1k recipe (`python -m eval.sweep --recipe dsa-1k`): DSA against full attention and MoBA
at the moba-scaling-1k sizes (53K and 107K, 1K rows), seeds 0-2. Full attention's and MoBA's runs
are the moba-scaling-1k recipe's (results/moba-scaling-1k/), the same configs but the core. The
report pairs each gap by seed (`eval.stats.paired_gap`: t-based 95 % intervals), for the loss over
every validation token and the trailing loss (the last quarter of the rows' positions), and draws
the loss by position."""

from __future__ import annotations

import json
from pathlib import Path

from eval.stats import paired_gap

DSA_SIZES = ("53k", "107k")
DSA_SEEDS = (0, 1, 2)
CORES = ("full", "moba", "dsa")


def dsa_runs() -> tuple[str, ...]:
    """Seed 0 of both sizes first, then the further seeds."""
    name = lambda size, seed: f"dsa_{size}" + (f".seed{seed}" if seed else "")
    return tuple(name(size, seed) for seed in DSA_SEEDS for size in DSA_SIZES)


def _by_seed(summaries: list[dict], core: str, size: str, measure) -> dict[int, float]:
    return {s["seed"]: measure(s) for s in summaries if s["run"].split(".")[0] == f"{core}_{size}"}


def comparison(summaries: list[dict], scaling: list[dict]) -> dict:
    """size -> measure -> 'dsa - full' / 'dsa - moba' -> paired_gap, over the seeds all have."""
    runs = [s for s in summaries + scaling if s["seed"] in DSA_SEEDS]
    measures = {
        "every token": lambda s: s["every_token"]["loss"],
        "trailing": lambda s: s["trailing"]["loss"],
    }
    out = {}
    for size in DSA_SIZES:
        for label, measure in measures.items():
            dsa = _by_seed(runs, "dsa", size, measure)
            for other in ("full", "moba"):
                gap = paired_gap(dsa, _by_seed(runs, other, size, measure))
                if gap:
                    out.setdefault(size, {}).setdefault(label, {})[f"dsa - {other}"] = gap
    return out


def _line(name: str, gap: dict) -> str:
    (a, a_se), (b, b_se), (mean, se) = gap["a"], gap["b"], gap["gap"]
    low, high = gap["gap_ci95"]
    return (
        f"| {name} | {len(gap['seeds'])} | {a:.4f} ± {a_se:.4f} | {b:.4f} ± {b_se:.4f} | "
        f"{mean:+.4f} ± {se:.4f} | {low:+.4f} to {high:+.4f} |\n"
    )


def draw_dsa_comparison(summaries: list[dict], out: Path) -> None:
    """report.md (the paired gaps) and loss_by_position.png (each core's seed-mean loss per
    position bucket, per size)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    scaling_dir = out.parent / "moba-scaling-1k"
    scaling = [json.loads(p.read_text()) for p in sorted(scaling_dir.glob("*.json")) if p.name != "fits.json"]
    gaps = comparison(summaries, scaling)
    text = (
        "DSA (top-192, sparse stage from step 0) against full attention and MoBA (block 64, top-3) "
        "at 1K rows; full and MoBA are results/moba-scaling-1k's runs. Loss over every validation "
        "token and the trailing loss (positions 768-1023), paired by seed (mean ± standard error; "
        "t-based 95 % interval of the gap).\n\n"
        "| size, measure, gap | seeds | DSA | other | gap | 95 % interval |\n|---|---|---|---|---|---|\n"
    )
    for size, measures in gaps.items():
        for label, pairs in measures.items():
            text += "".join(_line(f"{size}, {label}, {name}", gap) for name, gap in pairs.items())
    (out / "report.md").write_text(text)
    print(text, flush=True)

    runs = [s for s in summaries + scaling if s["seed"] in DSA_SEEDS]
    fig, axes = plt.subplots(1, len(DSA_SIZES), figsize=(5 * len(DSA_SIZES), 3.6), sharey=True)
    for ax, size in zip(axes, DSA_SIZES, strict=True):
        for core in CORES:
            chosen = [s for s in runs if s["run"].split(".")[0] == f"{core}_{size}"]
            if not chosen:
                continue
            starts = [b["start"] for b in chosen[0]["buckets"]]
            means = [sum(s["buckets"][i]["loss"] for s in chosen) / len(chosen) for i in range(len(starts))]
            ax.plot(starts, means, marker="o", label=f"{core} ({len(chosen)} seeds)")
        ax.set_title(f"{size} non-embedding (without the indexers)")
        ax.set_xlabel("position in the row (bucket start)")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("validation loss, seed mean")
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(out / "loss_by_position.png", dpi=120)
    plt.close(fig)
