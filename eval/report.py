"""The EG-MLA paper's four-panel figure from our own runs, and a Markdown table beside it:
(a) average accuracy vs training tokens (every kept checkpoint, as `curves`): one series per
configuration, seeds averaged with a band of ± 1 s.e. over seeds, only the configurations with
several seeds where there are any, chance drawn; (b) final validation loss (every token of the
validation documents) vs table parameters (EG-MLA per gate placement and MLA with a non-gating
table as curves, the others as flat lines), ± 1 s.e. over seeds; (c) KV-cache elements per token
(counted from the cache each model allocates); (d) decode ms/token at `--context` (batch 1,
synthetic cache, `eval.decoding.decode_latency`; the median of repeats with their range where a
caller measured repeats, as the egmla-cpu recipe does). Runs of one configuration with different
seeds share a label; one colour per configuration in every panel, the legend beside the panels.
"""

from __future__ import annotations

import json
from pathlib import Path

from effattn_jax import checkpoint
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


def _colours(groups: dict[str, list[dict]]) -> dict[str, tuple]:
    """One colour per configuration, the same in every panel: tab10's ten distinct ones first for
    the configurations with several seeds (the ones panel (a) draws), then for the rest, then
    tab20's lighter shades."""
    import matplotlib.pyplot as plt

    palette = list(plt.get_cmap("tab10").colors) + list(plt.get_cmap("tab20").colors[1::2])
    order = sorted(groups, key=lambda label: len(groups[label]) < 2)  # stable: seeded first
    return {label: palette[i % len(palette)] for i, label in enumerate(order)}


def plot_accuracy(ax, groups: dict[str, list[dict]], colour: dict) -> None:
    """(a): one series per configuration, the seeds' mean at each kept checkpoint with a band of
    ± 1 s.e. over seeds; only the configurations with >= 2 seeds where any has them (else every
    run, with its questions' s.e. as error bars); chance as a line."""
    import numpy as np

    seeded = [label for label, members in groups.items() if len(members) >= 2]
    for label in seeded or list(groups):
        members = groups[label]
        n = min(len(m["points"]) for m in members)
        tokens = [p["tokens"] for p in members[0]["points"][:n]]
        stats = [mean_and_stderr([100 * m["points"][i]["avg_acc"] for m in members]) for i in range(n)]
        mean, se = np.array([m for m, _ in stats]), np.array([e for _, e in stats])
        ax.plot(tokens, mean, "o-", color=colour[label], markersize=3, linewidth=1.2)
        if seeded:
            ax.fill_between(tokens, mean - se, mean + se, color=colour[label], alpha=0.15, linewidth=0)
        else:
            yerr = [100 * p["avg_acc_stderr"] for p in members[0]["points"][:n]]
            ax.errorbar(tokens, mean, yerr=yerr, fmt="none", ecolor=colour[label], capsize=2, alpha=0.6)
    chance = next(iter(groups.values()))[0]["points"][-1].get("avg_chance")
    if chance is not None:
        ax.axhline(100 * chance, color="0.3", linestyle=":", linewidth=1)
        ax.annotate(
            f"chance {100 * chance:.1f} %",
            (0.01, 100 * chance),
            xycoords=("axes fraction", "data"),
            xytext=(0, -10),
            textcoords="offset points",
            fontsize=7,
            color="0.3",
        )
    which = f"the {len(seeded)} configurations with >= 2 seeds" if seeded else "every run"
    band = "seed mean ± 1 s.e." if seeded else "± 1 s.e. over questions"
    ax.set(
        xlabel="training tokens", ylabel=f"avg. accuracy % ({band})", title=f"(a) accuracy vs tokens: {which}"
    )


def plot_loss_vs_table(ax, groups: dict[str, list[dict]], colour: dict) -> tuple[dict, dict]:
    """(b): final validation loss against table parameters: EG-MLA per gate placement and MLA
    with a non-gating table (`mla.token_table_dim`) as grey curves through the configurations'
    seed means, each point ± 1 s.e. over seeds (hollow: one seed); configurations without a
    table as flat lines with their s.e. band."""
    final = {label: mean_and_stderr([r["points"][-1]["val_loss"] for r in m]) for label, m in groups.items()}
    table = {
        label: m[0]["params"]["embedding_gate"] + m[0]["params"].get("token_table", 0)
        for label, m in groups.items()
    }
    curves: dict[str, list[str]] = {}
    for label, members in groups.items():
        if members[0]["params"]["embedding_gate"]:
            curves.setdefault(f"EG-MLA, gate_at={members[0].get('gate_at') or 'latent'}", []).append(label)
        elif table[label]:
            curves.setdefault("MLA + non-gating table", []).append(label)
    styles = {"EG-MLA, gate_at=latent": "-", "MLA + non-gating table": "-."}
    for name, labels in curves.items():
        labels = sorted(labels, key=table.get)
        ax.plot(
            [table[lb] for lb in labels], [final[lb][0] for lb in labels], styles.get(name, ":"), color="0.6"
        )
        for lb in labels:
            mean, se = final[lb]
            one = se != se
            ax.errorbar(
                [table[lb]],
                [mean],
                yerr=None if one else [se],
                fmt="o",
                color=colour[lb],
                mfc="white" if one else colour[lb],
                capsize=3,
            )
    if curves:
        ax.set_xscale("log")
    for label in groups:
        if not table[label]:
            mean, se = final[label]
            ax.axhline(mean, ls="--", color=colour[label], linewidth=1)
            if se == se:
                ax.axhspan(mean - se, mean + se, color=colour[label], alpha=0.12)
    ax.set(
        xlabel="table parameters (gate tables; non-gating token tables)",
        ylabel="val. loss, every token (± 1 s.e. over seeds)",
        title="(b) loss vs table size (hollow: one seed)",
    )
    return curves, styles


def plot(runs: list[dict], path: Path, context: int, note: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    fig, ((a, b), (c, d)) = plt.subplots(2, 2, figsize=(15, 9))
    groups = by_label(runs)
    labels = list(groups)
    colour = _colours(groups)
    plot_accuracy(a, groups, colour)
    curves, styles = plot_loss_vs_table(b, groups, colour)
    x = range(len(labels))
    c.bar(x, [groups[lb][0]["kv_elements_per_token"] for lb in labels], color=[colour[lb] for lb in labels])
    c.set(ylabel="KV-cache elements / token", title="(c) KV cache")
    ms = [groups[lb][0]["decode_ms_per_token"] for lb in labels]
    ranges = [groups[lb][0].get("decode_ms_range") or (m, m) for lb, m in zip(labels, ms, strict=True)]
    repeated = any(groups[lb][0].get("decode_ms_range") for lb in labels)
    yerr = [
        [m - lo for m, (lo, _) in zip(ms, ranges, strict=True)],
        [hi - m for m, (_, hi) in zip(ms, ranges, strict=True)],
    ]
    d.bar(x, ms, color=[colour[lb] for lb in labels], yerr=yerr if repeated else None, capsize=3)
    what = "median of repeats, bars min-max" if repeated else "one measurement"
    d.set(ylabel="ms / token", title=f"(d) decode latency, context {context}, batch 1 ({what})")
    for ax in (c, d):
        ax.set_xticks(list(x), labels, rotation=35, ha="right", fontsize=6)
    handles = [
        Line2D(
            [],
            [],
            color=colour[lb],
            marker="o",
            linestyle="-",
            label=f"{lb} ({len(groups[lb])} seed{'s' if len(groups[lb]) > 1 else ''})",
        )
        for lb in labels
    ]
    handles += [
        Line2D([], [], color="0.6", linestyle=styles.get(name, ":"), label=f"(b) {name}") for name in curves
    ]
    fig.legend(handles=handles, loc="center right", fontsize=7, title="configuration", title_fontsize=8)
    fig.suptitle(note, fontsize=9)
    fig.tight_layout(rect=(0, 0, 0.83, 0.97))
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _with_stderr(value: float, se: float, fmt: str) -> str:
    """'value ± se' in `fmt`, or the value alone for a single run."""
    return format(value, fmt) + ("" if se != se else " ± " + format(se, fmt))


def markdown(runs: list[dict], context: int, note: str) -> str:
    lines = [
        f"{note}; decode at context {context}, batch 1; over seeds: mean ± standard error",
        "",
        "| attention | seeds | params | gate-table params | token-table params | tokens | val loss (every "
        "token) | avg acc % (chance) | KV elements/token | decode ms/token |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for label, members in by_label(runs).items():
        r, last = members[0], members[0]["points"][-1]
        loss = _with_stderr(*mean_and_stderr([m["points"][-1]["val_loss"] for m in members]), ".4f")
        acc = _with_stderr(*mean_and_stderr([100 * m["points"][-1]["avg_acc"] for m in members]), ".2f")
        chance = f" ({100 * last['avg_chance']:.1f})" if "avg_chance" in last else ""
        decode = f"{r['decode_ms_per_token']:.2f}"
        if r.get("decode_ms_range"):  # the median of repeats, and their range
            decode += " ({:.2f}-{:.2f})".format(*r["decode_ms_range"])
        if r["decode_ms_per_token"] != r["decode_ms_per_token"]:  # nan: a caller had no figure yet
            decode = "not measured"
        lines.append(
            f"| {label} | {len(members)} | {r['params']['total']:,} | {r['params']['embedding_gate']:,} "
            f"| {r['params'].get('token_table', 0):,} | {last['tokens']:,} | {loss} | {acc}{chance} "
            f"| {r['kv_elements_per_token']:,} | {decode} |"
        )
    if any(r.get("decode_ms_range") for r in runs):
        lines += ["", "decode ms/token: the median of the repeated measurements (their range)"]
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
