"""The EG-MLA paper's four-panel figure from our own runs, and a Markdown table beside it:
(a) average accuracy vs training tokens (every kept checkpoint, as `curves`); (b) final
validation loss vs gate-table parameters (EG-MLA runs as a curve, the others as flat lines);
(c) KV-cache elements per token (counted from the cache each model allocates); (d) decode
ms/token at `--context` (batch 1, synthetic cache, `eval.decoding.decode_latency`).
"""

from __future__ import annotations

import json
from pathlib import Path

from effattn_jax import checkpoint
from eval.curves import draw_chance
from eval.processes import output_dir, writes
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


def plot(runs: list[dict], path: Path, context: int, note: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ((a, b), (c, d)) = plt.subplots(2, 2, figsize=(11, 8))
    labels = [r["label"] for r in runs]
    for r in runs:
        a.errorbar(
            [p["tokens"] for p in r["points"]],
            [100 * p["avg_acc"] for p in r["points"]],
            yerr=[100 * p["avg_acc_stderr"] for p in r["points"]],
            fmt="o-",
            capsize=2,
            label=r["label"],
        )
    draw_chance(a, runs)
    a.set(xlabel="training tokens", ylabel="avg. accuracy (%, ± 1 s.e.)", title="(a) accuracy vs tokens")
    a.legend(fontsize=7)
    colour = {id(r): f"C{i}" for i, r in enumerate(runs)}  # one colour per run in every panel
    gated = sorted(
        (r for r in runs if r["params"]["embedding_gate"]), key=lambda r: r["params"]["embedding_gate"]
    )
    if gated:
        sizes, losses = (
            [r["params"]["embedding_gate"] for r in gated],
            [r["points"][-1]["val_loss"] for r in gated],
        )
        b.plot(sizes, losses, "-", color="0.6", label="EG-MLA")
        b.scatter(sizes, losses, c=[colour[id(r)] for r in gated], zorder=3)
        b.set_xscale("log")
    for r in runs:
        if not r["params"]["embedding_gate"]:
            b.axhline(r["points"][-1]["val_loss"], ls="--", color=colour[id(r)], label=r["label"])
    b.set(xlabel="gate-table parameters", ylabel="validation loss", title="(b) loss vs gate-table size")
    b.legend(fontsize=7)
    c.bar(labels, [r["kv_elements_per_token"] for r in runs], color=[colour[id(r)] for r in runs])
    c.set(ylabel="KV-cache elements / token", title="(c) KV cache")
    d.bar(labels, [r["decode_ms_per_token"] for r in runs], color=[colour[id(r)] for r in runs])
    d.set(ylabel="ms / token", title=f"(d) decode latency, context {context}, batch 1")
    for ax in (c, d):
        ax.tick_params(axis="x", labelrotation=20, labelsize=7)
    fig.suptitle(note, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def markdown(runs: list[dict], context: int, note: str) -> str:
    lines = [
        f"{note}; decode at context {context}, batch 1",
        "",
        "| attention | params | gate-table params | tokens | val loss | avg acc | KV elements/token "
        "| decode ms/token |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in runs:
        last = r["points"][-1]
        lines.append(
            f"| {r['label']} | {r['params']['total']:,} | {r['params']['embedding_gate']:,} "
            f"| {last['tokens']:,} | "
            f"{last['val_loss']:.4f} | {100 * last['avg_acc']:.2f} % | {r['kv_elements_per_token']:,} | "
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
