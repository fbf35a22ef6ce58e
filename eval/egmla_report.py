"""The egmla-cpu recipe (`python -m eval.sweep --recipe egmla-cpu`): its runs, each run's summary,
decode latency measured in repeats with their provenance, the seed-paired gaps (to MLA, and what
the gate itself buys over its parameter-matched controls) and the four-panel figure
(`eval.report.plot`). Runs are named by config stem (configs/egmla/cpu/), `<stem>.seed<k>` for
seed k; figures and tables label each configuration by its stem."""

from __future__ import annotations

import json
from pathlib import Path

from eval.stats import paired_gap

REPO = Path(__file__).resolve().parent.parent

EGMLA_WIDTHS = (16, 32, 64, 128)
# the parameter-matched controls (docs/eg_mla.md, "The control")
EGMLA_CONTROLS = ("mla_table16", "mla_dc16", "mla_table128", "mla_dc16_table16")
# every configuration a sentence compares, trained at seeds 0 ... 4
EGMLA_SEEDED = ("mla", "eg_mla_emb16", "eg_mla_proj_emb128", *EGMLA_CONTROLS)
EGMLA_SEEDS = (1, 2, 3, 4)  # beside the plain name's seed 0
# (a, b): a - b says what the gate itself buys (the same table parameters added, not gating; the
# same latent width without a gate)
GATE_GAPS = (
    ("eg_mla_emb16", "mla_table16"),
    ("eg_mla_emb16", "mla_dc16"),
    ("eg_mla_emb16", "mla_dc16_table16"),  # cache- and table-matched: the decisive control
    ("eg_mla_proj_emb128", "mla_table128"),
)
EGMLA_LIMIT = 50  # seeded questions per task at every kept checkpoint
EGMLA_DECODE_CONTEXT = 16384  # long enough that the cache, not dispatch, sets a step's time
EGMLA_DECODE_ROUNDS = 30
EGMLA_DECODE_REPEATS = 3  # alternated measurements, each of EGMLA_DECODE_ROUNDS rounds


def egmla_runs() -> tuple[str, ...]:
    """Every configuration at seed 0, then the seeded ones' further seeds, seed by seed (so a run
    stopped midway leaves whole seeds)."""
    plain = (
        "mha",
        "mla",
        *(f"eg_mla_emb{w}" for w in EGMLA_WIDTHS),
        *(f"eg_mla_proj_emb{w}" for w in EGMLA_WIDTHS),
        *EGMLA_CONTROLS,
    )
    return plain + tuple(f"{stem}.seed{k}" for k in EGMLA_SEEDS for stem in EGMLA_SEEDED)


def config_name(summary: dict) -> str:
    """A run's configuration: its config file's stem, with the recipe's `--override`s if any
    (a configuration's seeds share it)."""
    return " ".join([Path(summary["config"]).stem, *summary.get("overrides", [])])


def summarize_report(run_dir: Path) -> dict:
    """`eval report`'s entry of one run: every kept checkpoint's accuracy (EGMLA_LIMIT questions per
    task) and validation loss, parameter counts, KV-cache elements per token. Decode latency is
    measured for all configurations together when drawing (`measure_decode`)."""
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


def measure_decode(
    summaries: list[dict],
    out: Path,
    *,
    remeasure: bool = False,
    require: tuple[str, ...] | None = None,
    context: int = EGMLA_DECODE_CONTEXT,
    rounds: int = EGMLA_DECODE_ROUNDS,
    repeats: int = EGMLA_DECODE_REPEATS,
) -> dict[str, dict]:
    """configuration -> decode ms/token at `context` (batch 1, synthetic cache: it depends on the
    config only, so a configuration's seeds are measured once): {"median", "min", "max" over the
    repeats, "repeats": each repeat's figure}. A repeat steps every configuration in turn in one
    process (`decode_latency_alternated`, `rounds` rounds) so the ratios compare like with like.
    Every repeat is kept in decode_latency.json with the date, the jax version and the git commit.
    Measured again only when a configuration is not in the record, or when asked (`remeasure`),
    and then only once every config stem of `require` (the recipe's, when drawing) has a summary:
    a recipe trained in pieces (`--only`) is measured once, whole; until then configurations
    without a figure get none. Must run alone on the machine: anything else shifts the figures."""
    import datetime

    import jax

    from effattn_jax.train.provenance import git_commit

    path = out / "decode_latency.json"
    names = {config_name(s): s for s in summaries}
    recorded = json.loads(path.read_text()).get("configs", {}) if path.exists() else {}
    if not remeasure and set(names) <= set(recorded):
        return {name: recorded[name] for name in names}
    if missing := sorted(set(require or ()) - {name.split(" ")[0] for name in names}):
        print(f"decode latency not measured: no summary yet for {', '.join(missing)}", flush=True)
        return {name: recorded[name] for name in names if name in recorded}
    from effattn_jax.config import load_config
    from eval.decoding import decode_latency_alternated

    cfgs = {name: load_config(REPO / s["config"], s["overrides"]) for name, s in names.items()}
    runs = []
    for _ in range(repeats):
        started = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
        runs.append(
            {"started": started, "ms_per_token": decode_latency_alternated(cfgs, context, rounds=rounds)}
        )
    record = {
        "context": context,
        "batch": 1,
        "rounds": rounds,
        "date": datetime.datetime.now(datetime.UTC).date().isoformat(),
        "jax": jax.__version__,
        "backend": jax.default_backend(),
        "git_commit": git_commit(),
        "repeats": runs,
        "configs": {name: _over_repeats([r["ms_per_token"][name] for r in runs]) for name in names},
    }
    path.write_text(json.dumps(record, indent=1) + "\n")
    return record["configs"]


def _over_repeats(values: list[float]) -> dict:
    import statistics

    return {"median": statistics.median(values), "min": min(values), "max": max(values), "repeats": values}


def final_losses(summaries: list[dict]) -> dict[str, dict[int, float]]:
    """configuration -> seed -> final validation loss (every token)."""
    by: dict[str, dict[int, float]] = {}
    for s in summaries:
        by.setdefault(config_name(s), {})[s["seed"]] = s["points"][-1]["val_loss"]
    return by


def gaps_to_mla(summaries: list[dict]) -> dict[str, dict]:
    """configuration -> its final validation loss minus MLA's (`paired_gap`: paired by seed, with
    the t-based 95 % interval), for every configuration sharing at least two seeds with MLA."""
    by = final_losses(summaries)
    mla = next((name for name in by if name.split(" ")[0] == "mla"), None)
    pairs = {name: paired_gap(values, by[mla]) for name, values in by.items() if mla and name != mla}
    return {name: pair for name, pair in pairs.items() if pair}


def gate_gaps(summaries: list[dict]) -> dict[str, dict]:
    """'a - b' -> `paired_gap` for each GATE_GAPS pair both of whose configurations share at least
    two seeds: what the gate itself buys over its parameter-matched controls."""
    by = {name.split(" ")[0]: values for name, values in final_losses(summaries).items()}
    pairs = {f"{a} - {b}": paired_gap(by.get(a, {}), by.get(b, {})) for a, b in GATE_GAPS}
    return {name: pair for name, pair in pairs.items() if pair}


def gap_line(name: str, pair: dict) -> str:
    mean, se = pair["gap"]
    low, high = pair["gap_ci95"]
    seeds = pair["seeds"]
    return (
        f"- {name}: {mean:+.4f} ± {se:.4f} (95 % CI {low:+.4f} to {high:+.4f}; "
        f"{len(seeds)} seeds: {', '.join(map(str, seeds))})\n"
    )


def gaps_markdown(summaries: list[dict]) -> str:
    text = ""
    if gaps := gaps_to_mla(summaries):
        text += (
            "\nFinal validation loss minus MLA's, paired by seed (mean ± standard error of the "
            "differences; t-based 95 % interval):\n\n"
        )
        text += "".join(gap_line(name, pair) for name, pair in gaps.items())
    if gaps := gate_gaps(summaries):
        text += (
            "\nWhat the gate itself buys: EG-MLA minus its parameter-matched controls (MLA plus a "
            "non-gating table of the same size; MLA at EG-MLA's latent width), paired by seed:\n\n"
        )
        text += "".join(gap_line(name, pair) for name, pair in gaps.items())
    return text


def draw_egmla_report(summaries: list[dict], out: Path, *, remeasure_decode: bool = False) -> None:
    """report.png (the four panels) and report.md (the table and the gaps), as `eval report` draws
    them, each configuration labelled by its config stem."""
    from eval.curves import scale_note
    from eval.report import markdown, plot

    stems = tuple(run for run in egmla_runs() if "." not in run)
    ms = measure_decode(summaries, out, remeasure=remeasure_decode, require=stems)

    def decode(s):  # the median of repeats and their range; nan and none before a measurement
        figures = ms.get(config_name(s))
        if figures is None:
            return {"decode_ms_per_token": float("nan"), "decode_ms_range": None}
        return {"decode_ms_per_token": figures["median"], "decode_ms_range": (figures["min"], figures["max"])}

    summaries = [s | {"label": config_name(s)} | decode(s) for s in summaries]
    note = scale_note(summaries) + f", {EGMLA_LIMIT} questions/task (fixed budget, not compute-optimal)"
    table = markdown(summaries, EGMLA_DECODE_CONTEXT, note) + gaps_markdown(summaries)
    (out / "report.md").write_text(table)
    plot(summaries, out / "report.png", EGMLA_DECODE_CONTEXT, note)
    print(table, end="")
    print(f"wrote {out / 'report.png'} {out / 'report.md'}")
