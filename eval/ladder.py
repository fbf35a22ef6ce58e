"""The moba-ladder-1k recipe (`python -m eval.sweep --recipe moba-ladder-1k`): five sizes that grow
width and depth together (configs/moba/cpu/ladder/), each on about 20 tokens per non-embedding
parameter, its learning rate tuned on full attention, then full attention and MoBA at 3 seeds on
that schedule, and the fits a statistician would report, only once the sizes order.

Stages, one recipe (a finished run is skipped, so rerunning after a stage only adds the next):
1. Tuning: full attention at every learning rate of LADDER_LRS, seeds 0 and 1, at every size.
   `tuning.md` gives each (size, lr)'s mean final loss; the lowest mean is the size's choice.
2. The ladder: at each size in LADDER_TUNED (the choices, committed once tuning has run) full
   attention's seed 2 and MoBA's seeds 0-2, at the tuned lr; full attention's seeds 0 and 1 are the
   tuning runs at that lr. A LADDER_TUNED entry the tuning data does not choose is reported.
3. The ordering check: per kind, the seed-mean final loss must fall at every step up the ladder.
   If it does not, `ladder.md` says where, and nothing is fitted.
4. Fits (ladder.json, ladder.md), per kind, loss (every token; trailing) and compute axis (every
   matmul; 6ND): L = a·C^b on the per-size seed means, b with its t interval on n − 2 degrees of
   freedom (n sizes) and the range of b leaving one size out; b_MoBA − b_full paired by seed (each
   seed's runs fitted alone, the differences' t interval); MoBA − full per size, paired by seed,
   beside the paper's 0.003 (its laws' intercepts at matched compute). The figure is the MoBA
   scaling figure (eval/scaling_figure.py) of the ladder's runs.

moba-ladder-4k (configs/moba/cpu/ladder_4k/) runs the same stages on the three smallest sizes at
4,096-token rows (LADDER_4K_TUNED), for the trailing-loss comparison at longer rows.
"""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

from eval.stats import t_interval

LADDER_SIZES = ("13k", "30k", "60k", "107k", "250k")
LADDER_4K_SIZES = LADDER_SIZES[:3]  # moba-ladder-4k: the three smallest at 4,096-token rows
LADDER_LRS = ("3e-3", "1e-2", "3e-2")
TUNING_SEEDS = (0, 1)
LADDER_SEEDS = (0, 1, 2)
# size -> the learning rate the tuning runs chose (tuning.md): filled in once they have run
LADDER_TUNED: dict[str, str] = {"13k": "1e-2", "30k": "1e-2", "60k": "1e-2", "107k": "1e-2", "250k": "1e-2"}
LADDER_4K_TUNED: dict[str, str] = {"13k": "1e-2", "30k": "3e-2", "60k": "1e-2"}  # the same for moba-ladder-4k
PAPER_GAP = 0.003  # MoBA - full at matched compute: the paper's two laws' intercepts (2.625 - 2.622)
# a summary's core -> its kind (dsa: eval/dsa_report.py)
CORES = {"dense": "full", "moba": "moba", "dsa": "dsa"}
LOSSES = {"overall": lambda s: s["every_token"]["loss"], "trailing": lambda s: s["trailing"]["loss"]}
COMPUTES = {"full": "pflops_days", "6nd": "pflops_days_6nd"}


def ladder_runs(tuned: dict[str, str] | None = None, sizes=LADDER_SIZES) -> tuple[str, ...]:
    """The tuning runs, smallest size first, then the ladder's further runs at each tuned size."""
    tuned = LADDER_TUNED if tuned is None else tuned
    tuning = [f"full_{size}.lr{lr}.seed{k}" for size in sizes for lr in LADDER_LRS for k in TUNING_SEEDS]
    rest = [
        name
        for size in sizes
        if size in tuned
        for name in (
            f"full_{size}.lr{tuned[size]}.seed{max(TUNING_SEEDS) + 1}",
            *(f"moba_{size}.lr{tuned[size]}.seed{k}" for k in LADDER_SEEDS),
        )
    ]
    return tuple(tuning + rest)


def _size(s: dict) -> str:
    return s["run"].split(".")[0].split("_")[1]


def tuning_table(summaries: list[dict]) -> dict[str, list[dict]]:
    """size -> one row per learning rate of its full-attention tuning runs: lr, seeds, final
    losses, mean; `chosen` marks the lowest mean among the rows with every tuning seed."""
    rows: dict[str, dict[float, dict[int, float]]] = {}
    for s in summaries:
        if s["core"] == "dense" and s["seed"] in TUNING_SEEDS:
            rows.setdefault(_size(s), {}).setdefault(s["lr"], {})[s["seed"]] = s["every_token"]["loss"]
    table = {}
    for size in [z for z in LADDER_SIZES if z in rows]:
        entries = [
            {
                "lr": lr,
                "seeds": sorted(by),
                "losses": [by[k] for k in sorted(by)],
                "mean": statistics.fmean(by.values()),
            }
            for lr, by in sorted(rows[size].items())
        ]
        complete = [e for e in entries if e["seeds"] == list(TUNING_SEEDS)]
        best = min(complete, key=lambda e: e["mean"]) if len(complete) == len(LADDER_LRS) else None
        for e in entries:
            e["chosen"] = e is best
        table[size] = entries
    return table


def ladder_set(summaries: list[dict], tuned: dict[str, str]) -> list[dict]:
    """The runs at each tuned size's learning rate: full attention's and MoBA's seeds."""
    return [
        s
        for s in summaries
        if (size := _size(s)) in tuned
        and math.isclose(s["lr"], float(tuned[size]))
        and s["seed"] in LADDER_SEEDS
    ]


def seed_means(runs: list[dict], measure) -> dict[str, dict[int, float]]:
    """kind -> non-embedding parameters -> the mean of measure over that size's seeds."""
    by: dict[str, dict[int, list[float]]] = {}
    for s in runs:
        by.setdefault(CORES[s["core"]], {}).setdefault(s["non_embedding_params"], []).append(measure(s))
    return {kind: {n: statistics.fmean(v) for n, v in sorted(sizes.items())} for kind, sizes in by.items()}


def ordering(runs: list[dict]) -> list[str]:
    """Where a kind's seed-mean final loss (every token) fails to fall from one size to the next:
    one line each; empty when the ladder orders."""
    problems = []
    for kind, by_size in seed_means(runs, LOSSES["overall"]).items():
        sizes = list(by_size)
        for small, large in zip(sizes, sizes[1:], strict=False):
            if by_size[large] >= by_size[small]:
                problems.append(
                    f"{kind}: {large:,} params ends at {by_size[large]:.4f}, "
                    f"not below {small:,} params' {by_size[small]:.4f}"
                )
    return problems


def _fit(compute: list[float], loss: list[float]) -> dict:
    """b of L = a·C^b on these points, with its t interval on n - 2 degrees of freedom."""
    from scipy.stats import t

    from eval.scaling_fits import fit_power_law

    fit = fit_power_law(compute, loss)
    dof = fit["points"] - 2
    half = float(t.ppf(0.975, dof)) * fit["b_stderr"] if dof > 0 else float("nan")
    return {
        "a": fit["a"],
        "b": fit["b"],
        "b_stderr": fit["b_stderr"],
        "b_t95": [fit["b"] - half, fit["b"] + half],
    }


def kind_fit(runs: list[dict], measure, compute_key: str) -> dict:
    """One kind's law on its per-size seed means, its t interval and the leave-one-size-out range."""
    by: dict[int, list[dict]] = {}
    for s in runs:
        by.setdefault(s["non_embedding_params"], []).append(s)
    sizes = sorted(by)
    c = [statistics.fmean(s[compute_key] for s in by[n]) for n in sizes]
    y = [statistics.fmean(measure(s) for s in by[n]) for n in sizes]
    fit = _fit(c, y) | {"sizes": sizes, "seeds": [len(by[n]) for n in sizes]}
    if len(sizes) >= 4:
        left_out = [_fit(c[:i] + c[i + 1 :], y[:i] + y[i + 1 :])["b"] for i in range(len(sizes))]
        fit["b_leave_one_size_out"] = [min(left_out), max(left_out)]
    return fit


def paired_slope_gap(base: list[dict], other: list[dict], measure, compute_key: str) -> dict | None:
    """b_other - b_base paired by seed (b_MoBA - b_full on the ladder): each seed's runs of each
    kind fitted alone (the seeds that both kinds have at every size, a size named by its run),
    then the differences' mean and t interval."""
    sizes = {_size(s) for s in base + other}
    seeds = [
        k
        for k in LADDER_SEEDS
        if all(any(s["seed"] == k and _size(s) == n for s in runs) for runs in (base, other) for n in sizes)
    ]
    if len(seeds) < 2 or len(sizes) < 3:
        return None

    def slope(runs, k):
        mine = sorted((s for s in runs if s["seed"] == k), key=lambda s: s["non_embedding_params"])
        return _fit([s[compute_key] for s in mine], [measure(s) for s in mine])["b"]

    diffs = [slope(other, k) - slope(base, k) for k in seeds]
    return {"seeds": seeds, "diffs": diffs, "mean": statistics.fmean(diffs), "t95": list(t_interval(diffs))}


def ladder_fits(runs: list[dict]) -> dict:
    """fits[loss][compute]: {full, moba (kind_fit), slope_gap (paired_slope_gap)}; gaps[loss]: the
    seed-paired MoBA - full gap per size (eval.scaling_figure.seed_gaps)."""
    from eval.scaling_figure import seed_gaps

    full = [s for s in runs if s["core"] == "dense"]
    moba = [s for s in runs if s["core"] == "moba"]
    fits = {
        loss: {
            compute: {
                "full": kind_fit(full, measure, key),
                "moba": kind_fit(moba, measure, key),
                "slope_gap": paired_slope_gap(full, moba, measure, key),
            }
            for compute, key in COMPUTES.items()
        }
        for loss, measure in LOSSES.items()
    }
    return {"fits": fits, "gaps": {loss: seed_gaps(runs, measure) for loss, measure in LOSSES.items()}}


def _interval(lo_hi) -> str:
    lo, hi = lo_hi
    return f"{lo:+.4f} to {hi:+.4f}"


def tuning_lines(table: dict[str, list[dict]]) -> list[str]:
    lines = ["| size | lr | loss per seed | mean | chosen |", "|---|---|---|---|---|"]
    for size, rows in table.items():
        for r in rows:
            edge = r["chosen"] and r["lr"] in (float(LADDER_LRS[0]), float(LADDER_LRS[-1]))
            mark = "**yes** (at the grid's edge)" if edge else "**yes**" if r["chosen"] else ""
            losses = ", ".join(f"{v:.3f}" for v in r["losses"])
            lines.append(f"| {size} | {r['lr']:g} | {losses} | {r['mean']:.3f} | {mark} |")
    return lines


def fit_report_lines(record: dict) -> list[str]:
    lines = []
    for loss, by_compute in record["fits"].items():
        for compute, f in by_compute.items():
            for kind in ("full", "moba"):
                k = f[kind]
                loo = k.get("b_leave_one_size_out")
                lines.append(
                    f"- {loss}, {compute}, {kind}: L = {k['a']:.4g}·C^{k['b']:.4f}, "
                    f"b t95 {_interval(k['b_t95'])}"
                    + (f", leaving one size out {_interval(loo)}" if loo else "")
                )
            gap = f["slope_gap"]
            lines.append(
                f"- {loss}, {compute}, b_MoBA − b_full: "
                + (
                    "no seed has every size of both kinds"
                    if gap is None
                    else f"{gap['mean']:+.4f} (t95 {_interval(gap['t95'])}, seeds {gap['seeds']})"
                )
            )
    for loss, rows in record["gaps"].items():
        for r in rows:
            mean, se = r["gap_moba_minus_full"]
            lines.append(
                f"- {loss}, {r['non_embedding_params']:,} params: MoBA − full {mean:+.4f} ± {se:.4f} "
                f"(t95 {_interval(r['gap_ci95'])}, seeds {r['seeds']}; the paper {PAPER_GAP:+.3f})"
            )
    return lines


def ladder_4k_runs() -> tuple[str, ...]:
    return ladder_runs(LADDER_4K_TUNED, LADDER_4K_SIZES)


def draw_ladder_4k(summaries: list[dict], out: Path) -> dict:
    return draw_ladder(summaries, out, LADDER_4K_TUNED, recipe="moba-ladder-4k")


def draw_ladder(
    summaries: list[dict], out: Path, tuned: dict[str, str] | None = None, recipe: str = "moba-ladder-1k"
) -> dict:
    """tuning.md always; once sizes are tuned, the ordering check, and when the ladder orders with
    at least three sizes of both kinds, ladder.json, ladder.md's fits and the scaling figure."""
    tuned = LADDER_TUNED if tuned is None else tuned
    table = tuning_table(summaries)
    chosen = {size: next((r["lr"] for r in rows if r["chosen"]), None) for size, rows in table.items()}
    report = [
        f"# {recipe}",
        "",
        "## Tuning (full attention, final loss over every validation token)",
        "",
    ]
    report += tuning_lines(table)
    mismatch = [  # sizes whose tuning runs are among the summaries (`--only` may leave them out)
        f"{size}: the committed choice is {lr}, the tuning runs choose {chosen[size]}"
        for size, lr in tuned.items()
        if size in chosen and (chosen[size] is None or not math.isclose(chosen[size], float(lr)))
    ]
    record: dict = {"tuning": table, "chosen": chosen, "mismatch": mismatch}
    runs = ladder_set(summaries, tuned)
    kinds_sizes = {(CORES[s["core"]], s["non_embedding_params"]) for s in runs}
    complete = sorted(
        {n for _, n in kinds_sizes if ("full", n) in kinds_sizes and ("moba", n) in kinds_sizes}
    )
    runs = [s for s in runs if s["non_embedding_params"] in complete]
    record["sizes"] = complete
    record["order_problems"] = problems = ordering(runs)
    report += ["", "## The ladder", ""] + [f"- mismatch: {m}" for m in mismatch]
    if len(complete) < 3:
        report.append(f"- {len(complete)} size(s) with both kinds: nothing to fit yet")
    elif problems:
        report += ["- **the sizes do not order; nothing is fitted:**"] + [f"  - {p}" for p in problems]
    else:
        from eval.scaling_figure import draw_moba_scaling

        record |= ladder_fits(runs)
        report += [f"- the seed-mean loss falls at every step of {len(complete)} sizes, both kinds", ""]
        report += fit_report_lines(record)
        draw_moba_scaling(runs, out)
    (out / "ladder.json").write_text(json.dumps(record, indent=1) + "\n")
    (out / "ladder.md").write_text("\n".join(report) + "\n")
    print("\n".join(report))
    return record
