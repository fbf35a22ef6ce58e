"""The DSA recipes: DSA against full attention and MoBA on another recipe's runs of the same
configs but the core, seeds 0-2. The report pairs each gap by seed (`eval.stats.paired_gap`:
t-based 95 % intervals), for the loss over every validation token and the trailing loss (the last
quarter of the rows' positions), and draws the loss by position.

- dsa-1k (`python -m eval.sweep --recipe dsa-1k`): the moba-scaling-1k sizes (53K and 107K, 1K rows;
  results/moba-scaling-1k/).
- dsa-ladder-1k: the moba-ladder-1k sizes (configs/dsa/cpu/ladder/), each on the learning rate the
  ladder tuned for it (eval/ladder.py LADDER_TUNED; results/moba-ladder-1k/), so the gaps are at one
  schedule per size; with three sizes or more the report also asks the ladder's questions of DSA
  (`across_sizes`: ordering, its law, its exponent against full attention's and MoBA's by seed).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from eval.ladder import COMPUTES, LADDER_SIZES, LADDER_TUNED, LOSSES, kind_fit, ordering, paired_slope_gap
from eval.stats import paired_gap

DSA_SEEDS = (0, 1, 2)
CORES = ("full", "moba", "dsa")


@dataclass(frozen=True)
class DsaSet:
    """One DSA comparison: its sizes, the recipe whose full and MoBA runs it pairs with, and the
    learning rate per size (None: every run of the config)."""

    sizes: tuple[str, ...]
    others: str | None  # results/<others>/: full_<size>... and moba_<size>... summaries (None: in its own)
    lrs: dict[str, str] | None
    about: str  # the report's first sentence


DSA_1K = DsaSet(
    ("53k", "107k"),
    "moba-scaling-1k",
    None,
    "DSA (top-192, sparse stage from step 0) against full attention and MoBA (block 64, top-3) at 1K "
    "rows; full and MoBA are results/moba-scaling-1k's runs.",
)
DSA_LADDER = DsaSet(
    tuple(size for size in LADDER_SIZES if size in LADDER_TUNED),
    "moba-ladder-1k",
    LADDER_TUNED,
    "DSA (top-192, 2 indexer heads of 16, sparse stage from step 0) against full attention and MoBA "
    "(block 64, top-3) at 1K rows, at each size on the learning rate the ladder tuned; full and MoBA "
    "are results/moba-ladder-1k's runs at that rate.",
)


def _run(core: str, size: str, seed: int, lr: str | None) -> str:
    """A run's name: seed 0 bare where the set has no learning rates (dsa-1k), else `.lr<x>.seed<k>`."""
    if lr is None:
        return f"{core}_{size}" + (f".seed{seed}" if seed else "")
    return f"{core}_{size}.lr{lr}.seed{seed}"


def dsa_runs(dsa_set: DsaSet = DSA_1K) -> tuple[str, ...]:
    """Seed 0 of every size first, then the further seeds."""
    lr = lambda size: dsa_set.lrs[size] if dsa_set.lrs else None
    return tuple(_run("dsa", size, seed, lr(size)) for seed in DSA_SEEDS for size in dsa_set.sizes)


def _runs_of(summaries: list[dict], core: str, size: str, lr: str | None) -> list[dict]:
    """The summaries of core_size's runs (at `lr` where given)."""
    name = f"{core}_{size}"
    return [s for s in summaries if s["run"].split(".")[0] == name and (lr is None or s["lr"] == float(lr))]


def _by_seed(summaries: list[dict], core: str, size: str, measure, lr: str | None) -> dict[int, float]:
    return {s["seed"]: measure(s) for s in _runs_of(summaries, core, size, lr)}


def comparison(summaries: list[dict], others: list[dict], dsa_set: DsaSet = DSA_1K) -> dict:
    """size -> measure -> 'dsa - full' / 'dsa - moba' -> paired_gap, over the seeds all have."""
    runs = [s for s in summaries + others if s["seed"] in DSA_SEEDS]
    measures = {
        "every token": lambda s: s["every_token"]["loss"],
        "trailing": lambda s: s["trailing"]["loss"],
    }
    out = {}
    for size in dsa_set.sizes:
        lr = dsa_set.lrs[size] if dsa_set.lrs else None
        for label, measure in measures.items():
            dsa = _by_seed(runs, "dsa", size, measure, lr)
            for other in ("full", "moba"):
                gap = paired_gap(dsa, _by_seed(runs, other, size, measure, lr))
                if gap:
                    out.setdefault(size, {}).setdefault(label, {})[f"dsa - {other}"] = gap
    return out


def across_sizes(summaries: list[dict], others: list[dict], dsa_set: DsaSet = DSA_LADDER) -> dict | None:
    """The ladder's questions asked of DSA: where its seed-mean loss (every token) fails to fall
    from one size to the next ("order_problems"), and per loss and compute axis its law on the
    per-size seed means (eval.ladder.kind_fit) with b_DSA - b_full and b_DSA - b_MoBA paired by
    seed ("fits"). None below 3 sizes with DSA runs (dsa-1k has 2)."""
    runs = [s for s in summaries + others if s["seed"] in DSA_SEEDS]
    lr = lambda size: dsa_set.lrs[size] if dsa_set.lrs else None
    sizes = [size for size in dsa_set.sizes if _runs_of(runs, "dsa", size, lr(size))]
    if len(sizes) < 3:
        return None
    of = {core: [s for size in sizes for s in _runs_of(runs, core, size, lr(size))] for core in CORES}
    fits = {
        loss: {
            compute: {
                "dsa": kind_fit(of["dsa"], measure, key),
                "dsa - full": paired_slope_gap(of["full"], of["dsa"], measure, key),
                "dsa - moba": paired_slope_gap(of["moba"], of["dsa"], measure, key),
            }
            for compute, key in COMPUTES.items()
        }
        for loss, measure in LOSSES.items()
    }
    return {"sizes": sizes, "order_problems": ordering(of["dsa"]), "fits": fits}


def across_sizes_lines(record: dict) -> list[str]:
    interval = lambda lo_hi: f"{lo_hi[0]:+.4f} to {lo_hi[1]:+.4f}"
    lines = [f"- {problem}" for problem in record["order_problems"]] or [
        f"- DSA's seed-mean loss (every token) falls at every step of {len(record['sizes'])} sizes"
    ]
    for loss, by_compute in record["fits"].items():
        for compute, f in by_compute.items():
            k, loo = f["dsa"], f["dsa"].get("b_leave_one_size_out")
            lines.append(
                f"- {loss}, {compute}, dsa: L = {k['a']:.4g}·C^{k['b']:.4f}, b t95 {interval(k['b_t95'])}"
                + (f", leaving one size out {interval(loo)}" if loo else "")
            )
            for name in ("dsa - full", "dsa - moba"):
                gap = f[name]
                b_gap = f"b_{name.replace(' - ', ' − b_')}"
                lines.append(
                    f"- {loss}, {compute}, {b_gap}: "
                    + (
                        "no seed has every size of both"
                        if gap is None
                        else f"{gap['mean']:+.4f} (t95 {interval(gap['t95'])}, seeds {gap['seeds']})"
                    )
                )
    return lines


def _line(name: str, gap: dict) -> str:
    (a, a_se), (b, b_se), (mean, se) = gap["a"], gap["b"], gap["gap"]
    low, high = gap["gap_ci95"]
    return (
        f"| {name} | {len(gap['seeds'])} | {a:.4f} ± {a_se:.4f} | {b:.4f} ± {b_se:.4f} | "
        f"{mean:+.4f} ± {se:.4f} | {low:+.4f} to {high:+.4f} |\n"
    )


def _others(out: Path, dsa_set: DsaSet) -> list[dict]:
    """The summaries of results/<dsa_set.others>/ (none where the set has no other recipe)."""
    if not dsa_set.others:
        return []
    names = ("fits.json", "ladder.json")
    paths = sorted((out.parent / dsa_set.others).glob("*.json"))
    return [json.loads(p.read_text()) for p in paths if p.name not in names]


def draw_dsa_comparison(
    summaries: list[dict], out: Path, dsa_set: DsaSet = DSA_1K, others: list[dict] | None = None
) -> None:
    """report.md (the paired gaps) and loss_by_position.png (each core's seed-mean loss per
    position bucket, per size); `others`: the set's other summaries where already read."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    others = _others(out, dsa_set) if others is None else others
    gaps = comparison(summaries, others, dsa_set)
    text = (
        f"{dsa_set.about} Loss over every validation token and the trailing loss (the last quarter of "
        "the rows' positions), paired by seed (mean ± standard error; t-based 95 % interval of the "
        "gap).\n\n"
        "| size, measure, gap | seeds | DSA | other | gap | 95 % interval |\n|---|---|---|---|---|---|\n"
    )
    for size, measures in gaps.items():
        for label, pairs in measures.items():
            text += "".join(_line(f"{size}, {label}, {name}", gap) for name, gap in pairs.items())
    (out / "report.md").write_text(text)
    print(text, flush=True)

    runs = [s for s in summaries + others if s["seed"] in DSA_SEEDS]
    sizes = [size for size in dsa_set.sizes if _runs_of(runs, "dsa", size, None)]
    if not sizes:
        return
    fig, axes = plt.subplots(1, len(sizes), figsize=(5 * len(sizes), 3.6), sharey=True, squeeze=False)
    for ax, size in zip(axes[0], sizes, strict=True):
        lr = dsa_set.lrs[size] if dsa_set.lrs else None
        for core in CORES:
            chosen = _runs_of(runs, core, size, lr)
            if not chosen:
                continue
            starts = [b["start"] for b in chosen[0]["buckets"]]
            means = [sum(s["buckets"][i]["loss"] for s in chosen) / len(chosen) for i in range(len(starts))]
            ax.plot(starts, means, marker="o", label=f"{core} ({len(chosen)} seeds)")
        ax.set_title(f"{size} non-embedding (without the indexers)")
        ax.set_xlabel("position in the row (bucket start)")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("validation loss, seed mean")
    axes[0][0].legend()
    fig.tight_layout()
    fig.savefig(out / "loss_by_position.png", dpi=120)
    plt.close(fig)


def draw_dsa_ladder(summaries: list[dict], out: Path) -> None:
    """dsa-ladder-1k's report and figure (against results/moba-ladder-1k), then, from three sizes,
    the ladder's questions asked of DSA (across_sizes.json and the report's last section)."""
    others = _others(out, DSA_LADDER)
    draw_dsa_comparison(summaries, out, DSA_LADDER, others)
    scaling = across_sizes(summaries, others, DSA_LADDER)
    if scaling:
        (out / "across_sizes.json").write_text(json.dumps(scaling, indent=1) + "\n")
        text = "\n## Across sizes (seed means; b with its t interval on sizes − 2 degrees of freedom)\n\n"
        text += "\n".join(across_sizes_lines(scaling)) + "\n"
        with open(out / "report.md", "a") as report:
            report.write(text)
        print(text, flush=True)
