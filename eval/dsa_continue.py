"""dsa-continue-1k (`python -m eval.sweep --recipe dsa-continue-1k`; configs/dsa/cpu/continue/): the
V3.2 report's recipe for DSA at CPU scale, against the same continuation with full attention. From
each of moba-ladder-1k's full-attention runs at CONTINUE_SIZES (seeds 0-2, the learning rate the
ladder tuned), in this order per seed:
1. warmup_<size>: the dense warm-up stage (`dsa.stage=warmup`): fresh indexers trained by their KL
   loss to the dense attention, everything else frozen, for an eighth of the base's steps;
2. dsa_<size>: the sparse stage from that warm-up (`dsa.stage=sparse`), every parameter trained,
   for a quarter of the base's steps;
3. full_<size>: the base continued as long with full attention, on the same schedule and batches.
Each run starts from its parent's last checkpoint (`train.init_from`, set by the sweep; a parent
whose run directory is gone is trained again first). The report pairs dsa - full by seed (every
token and trailing; eval.stats.paired_gap) beside the base's loss, and gives the indexer's KL at
the start and end of each stage.
"""

from __future__ import annotations

import statistics
from pathlib import Path

from eval.dsa_report import DSA_SEEDS, DsaSet, draw_dsa_comparison
from eval.ladder import LADDER_TUNED

RECIPE = "dsa-continue-1k"
CONTINUE_SIZES = ("60k", "107k", "250k")
STAGES = ("warmup", "dsa", "full")  # training order per size and seed
CONTINUE_SET = DsaSet(
    CONTINUE_SIZES,
    None,
    None,
    "DSA by the V3.2 report's recipe (a dense warm-up of fresh indexers on a trained full-attention "
    "model, then the sparse stage, top-192 of 1K rows) against the same model continued as long with "
    "full attention; the bases are results/moba-ladder-1k's full-attention runs.",
)


def continue_runs() -> tuple[str, ...]:
    return tuple(f"{stage}_{size}.seed{k}" for size in CONTINUE_SIZES for k in DSA_SEEDS for stage in STAGES)


def continue_parent(run: str) -> tuple[str, str]:
    """(recipe, run) whose last checkpoint `run` starts from."""
    stem, seed = run.split(".seed")
    stage, size = stem.split("_")
    if stage == "dsa":
        return RECIPE, f"warmup_{size}.seed{seed}"
    return "moba-ladder-1k", f"full_{size}.lr{LADDER_TUNED[size]}.seed{seed}"


def _of(summaries: list[dict], stage: str, size: str) -> list[dict]:
    return [s for s in summaries if s["run"].startswith(f"{stage}_{size}.")]


def _mean(runs: list[dict], value) -> str:
    values = [value(s) for s in runs]
    return f"{statistics.fmean(values):.4f}" if values else "—"


def _kl(runs: list[dict], end: str) -> str:
    return _mean([s for s in runs if "indexer_kl" in s], lambda s: s["indexer_kl"][end][1])


def _loss(s: dict) -> float:
    return s["every_token"]["loss"]


def draw_dsa_continue(summaries: list[dict], out: Path) -> None:
    """report.md: the seed-paired dsa - full gaps (and loss_by_position.png, as the other DSA
    recipes), then per size the base's loss and each stage's indexer KL, seed means."""
    import json

    draw_dsa_comparison(summaries, out, CONTINUE_SET)
    bases = {
        s["run"]: s
        for s in map(json.loads, map(Path.read_text, (out.parent / "moba-ladder-1k").glob("full_*.json")))
    }
    lines = [
        "",
        "Seed means: the base (moba-ladder-1k's final loss), each continuation's final loss, and the "
        "indexer's KL per token (first and last logged step of each DSA stage).",
        "",
        "| size | seeds | base | full continued | DSA continued | warm-up KL, first → last | "
        "sparse KL, first → last |",
        "|---|---|---|---|---|---|---|",
    ]
    for size in CONTINUE_SIZES:
        dsa, full, warmup = (_of(summaries, stage, size) for stage in ("dsa", "full", "warmup"))
        if not dsa:
            continue
        base = [bases[r] for r in (continue_parent(s["run"])[1] for s in full) if r in bases]
        lines.append(
            f"| {size} | {len(dsa)} | {_mean(base, _loss)} | {_mean(full, _loss)} | {_mean(dsa, _loss)} | "
            f"{_kl(warmup, 'first')} → {_kl(warmup, 'last')} | {_kl(dsa, 'first')} → {_kl(dsa, 'last')} |"
        )
    text = "\n".join(lines) + "\n"
    with (out / "report.md").open("a") as f:
        f.write(text)
    print(text, flush=True)
