"""The EG-MLA paper's four-panel figure from our own runs, and a Markdown table beside it:
(a) average accuracy vs training tokens (every kept checkpoint, as `curves`); (b) final
validation loss (every token of the validation documents) vs gate-table parameters (EG-MLA runs
as a curve per gate placement, the others as flat lines); (c) KV-cache elements per token
(counted from the cache each model allocates); (d) decode ms/token at `--context` (batch 1,
synthetic cache, `eval.decoding.decode_latency`). Runs of one configuration with different
seeds share a label: (b) and the table give their mean ± standard error.
"""

from __future__ import annotations

import json
from pathlib import Path

from effattn_jax import checkpoint
from eval.curves import draw_chance
from eval.processes import output_dir, writes
from eval.stats import mean_and_stderr
from eval.tasks import add_task_arguments


def efficiency(run: str, context: int) -> dict:
    from eval.decoding import decode_latency, kv_cache_report

    cfg = checkpoint.load_run_config(run, checkpoint.kept_steps(run)[-1])
    kv = kv_cache_report(cfg)
    ms = decode_latency(cfg, [context], absorb=True)[context]
    return {
        "kv_elements_per_token": kv["kv_elements_per_token"],
        "decode_ms_per_token": ms,
        "kind": cfg.attention.kind,
    }


def by_label(runs: list[dict]) -> dict[str, list[dict]]:
    """Runs grouped by label (one configuration, its seeds), in order of first appearance."""
    groups: dict[str, list[dict]] = {}
    for r in runs:
        groups.setdefault(r["label"], []).append(r)
    return groups


def plot(runs: list[dict], path: Path, context: int, note: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ((a, b), (c, d)) = plt.subplots(2, 2, figsize=(11, 8))
    groups = by_label(runs)
    colour = {label: f"C{i}" for i, label in enumerate(groups)}  # one colour per configuration
    for label, members in groups.items():
        for i, r in enumerate(members):
            a.errorbar(
                [p["tokens"] for p in r["points"]],
                [100 * p["avg_acc"] for p in r["points"]],
                yerr=[100 * p["avg_acc_stderr"] for p in r["points"]],
                fmt="o-",
                capsize=2,
                color=colour[label],
                alpha=1.0 if i == 0 else 0.4,
                label=label if i == 0 else None,
            )
    draw_chance(a, runs)
    a.set(xlabel="training tokens", ylabel="avg. accuracy (%, ± 1 s.e.)", title="(a) accuracy vs tokens")
    a.legend(fontsize=7)
    final = {label: mean_and_stderr([r["points"][-1]["val_loss"] for r in m]) for label, m in groups.items()}
    placements: dict[str, list[str]] = {}
    for label, members in groups.items():
        if members[0]["params"]["embedding_gate"]:
            placements.setdefault(members[0].get("gate_at", "latent"), []).append(label)
    for placement, labels in placements.items():
        labels = sorted(labels, key=lambda lb: groups[lb][0]["params"]["embedding_gate"])
        sizes = [groups[lb][0]["params"]["embedding_gate"] for lb in labels]
        means = [final[lb][0] for lb in labels]
        style = "-" if placement == "latent" else ":"
        b.plot(sizes, means, style, color="0.6", label=f"EG-MLA, gate_at={placement}")
        for size, lb in zip(sizes, labels, strict=True):
            mean, se = final[lb]
            b.errorbar([size], [mean], yerr=[0 if se != se else se], fmt="o", color=colour[lb], capsize=3)
        b.set_xscale("log")
    for label, members in groups.items():
        if not members[0]["params"]["embedding_gate"]:
            mean, se = final[label]
            b.axhline(mean, ls="--", color=colour[label], label=label)
            if se == se:
                b.axhspan(mean - se, mean + se, color=colour[label], alpha=0.15)
    b.set(
        xlabel="gate-table parameters",
        ylabel="validation loss, every token (± 1 s.e. over seeds)",
        title="(b) loss vs gate-table size",
    )
    b.legend(fontsize=7)
    labels = list(groups)
    c.bar(
        labels, [groups[lb][0]["kv_elements_per_token"] for lb in labels], color=[colour[lb] for lb in labels]
    )
    c.set(ylabel="KV-cache elements / token", title="(c) KV cache")
    d.bar(
        labels, [groups[lb][0]["decode_ms_per_token"] for lb in labels], color=[colour[lb] for lb in labels]
    )
    d.set(ylabel="ms / token", title=f"(d) decode latency, context {context}, batch 1")
    for ax in (c, d):
        ax.tick_params(axis="x", labelrotation=30, labelsize=6)
    fig.suptitle(note, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _with_stderr(value: float, se: float, fmt: str) -> str:
    """'value ± se' in `fmt`, or the value alone for a single run."""
    return format(value, fmt) + ("" if se != se else " ± " + format(se, fmt))


def markdown(runs: list[dict], context: int, note: str) -> str:
    lines = [
        f"{note}; decode at context {context}, batch 1; over seeds: mean ± standard error",
        "",
        "| attention | seeds | params | gate-table params | tokens | val loss (every token) | avg acc % "
        "(chance) | KV elements/token | decode ms/token |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for label, members in by_label(runs).items():
        r, last = members[0], members[0]["points"][-1]
        loss = _with_stderr(*mean_and_stderr([m["points"][-1]["val_loss"] for m in members]), ".4f")
        acc = _with_stderr(*mean_and_stderr([100 * m["points"][-1]["avg_acc"] for m in members]), ".2f")
        chance = f" ({100 * last['avg_chance']:.1f})" if "avg_chance" in last else ""
        lines.append(
            f"| {label} | {len(members)} | {r['params']['total']:,} | {r['params']['embedding_gate']:,} "
            f"| {last['tokens']:,} | {loss} | {acc}{chance} | {r['kv_elements_per_token']:,} | "
            f"{r['decode_ms_per_token']:.2f} |"
        )
    return "\n".join(lines) + "\n"


def add_arguments(p) -> None:
    p.add_argument("--runs", required=True, help="run directories (globs), comma-separated")
    add_task_arguments(p)
    p.add_argument("--context", type=int, default=2048, help="context length of the decode-latency panel")
    p.add_argument("--out", default="eval_out/report", help="directory for report.png/.md/.json")


def command(args) -> int:
    from eval.curves import collect, scale_note
    from eval.runs import expand_runs
    from eval.tasks import parse_tasks

    if args.context <= 0:
        raise ValueError(f"--context={args.context}: must be positive")
    runs = collect(expand_runs(args.runs), parse_tasks(args.tasks), args.limit)
    if not writes():
        return 0
    for r in runs:
        r.update(efficiency(r["run"], args.context))
    note = scale_note(runs) + (f", {args.limit} questions/task" if args.limit else "")
    with output_dir(args.out) as out:
        (out / "report.json").write_text(json.dumps(runs, indent=1))
        (out / "report.md").write_text(markdown(runs, args.context, note))
        plot(runs, out / "report.png", args.context, note)
    print(markdown(runs, args.context, note), end="")
    print("wrote " + " ".join(f"{args.out.rstrip('/')}/report.{ext}" for ext in ("png", "md", "json")))
    return 0
