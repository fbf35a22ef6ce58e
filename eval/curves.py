"""Average downstream accuracy and validation loss against training tokens, every kept
checkpoint of each run, one line per run labelled by its attention (the EG-MLA paper's
accuracy-vs-tokens panel). Keep milestones with `checkpoint.keep_every`. Each checkpoint's
results are cached in <run>/eval/, so a rerun (or `report`) only evaluates new checkpoints.
"""

from __future__ import annotations

import json
from pathlib import Path

from effattn_jax import checkpoint
from eval.processes import output_dir, writes
from eval.runs import attention_label, cached, expand_runs, model_param_counts
from eval.tasks import add_task_arguments


def _step_point(run_dir: Path, step: int, names: list[str], limit: int | None, bucket: int) -> dict:
    """Tokens seen, average accuracy and validation loss of one kept step (each cached)."""
    from flax import nnx

    from eval.downstream import run_downstream
    from eval.lm_loss import checkpoint_lm_loss

    def downstream():
        cfg, graphdef, params = checkpoint.load_params(run_dir, step)
        return run_downstream(nnx.merge(graphdef, params), cfg, names, limit=limit, progress=False)

    cfg = checkpoint.load_run_config(run_dir, step)
    # "acc_norm": the rule the cached figures were computed with (older caches are recomputed)
    key = {"tasks": names, "limit": limit, "acc_norm": "harness"}
    acc = cached(run_dir, step, "downstream", key, downstream)
    val = checkpoint_lm_loss(run_dir, step, seq_len=cfg.data.seq_len, bucket=bucket)
    tokens = step * cfg.data.batch_size * cfg.data.seq_len
    return {
        "step": step,
        "tokens": tokens,
        "avg_acc": acc["avg_acc"],
        "avg_acc_stderr": acc["avg_acc_stderr"],
        "avg_chance": acc["avg_chance"],
        "tasks": {t.pop("task"): t for t in acc["tasks"]},  # per task: acc, stderr, chance, ...
        "val_loss": val["every_token"]["loss"],  # every token of the validation documents
        "val_tokens": val["every_token"]["tokens"],
    }


def checkpoint_points(
    run_dir: Path, names: list[str], limit: int | None, *, bucket: int = 2048
) -> list[dict]:
    """One point per kept step of a run."""
    return [_step_point(run_dir, step, names, limit, bucket) for step in checkpoint.kept_steps(run_dir)]


def collect(runs: list[Path], names: list[str], limit: int | None) -> list[dict]:
    """Per run: its label, scale and checkpoint points."""
    from tqdm import tqdm

    out = []
    for run in tqdm(runs, desc="runs", disable=not writes()):
        steps = checkpoint.kept_steps(run)
        cfg = checkpoint.load_run_config(run, steps[-1])
        counts = model_param_counts(cfg)
        out.append(
            {
                "run": str(run),
                "label": attention_label(cfg),
                "params": counts,
                "points": checkpoint_points(run, names, limit),
            }
        )
    return out


def scale_note(runs: list[dict]) -> str:
    params = [r["params"]["total"] for r in runs]
    tokens = [p["tokens"] for r in runs for p in r["points"]]
    return f"scale: {min(params):,}-{max(params):,} params, up to {max(tokens):,} tokens"


def draw_chance(ax, runs: list[dict]) -> None:
    """The average's chance level (the same tasks and questions for every point) as a line;
    summaries written before it was recorded have none to draw."""
    chance = runs[0]["points"][-1].get("avg_chance")
    if chance is None:
        return
    ax.axhline(100 * chance, color="0.5", linestyle=":", linewidth=1, label=f"chance ({100 * chance:.1f} %)")


def plot(runs: list[dict], path: Path, limit: int | None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (acc_ax, loss_ax) = plt.subplots(1, 2, figsize=(11, 4.2))
    for r in runs:
        tokens = [p["tokens"] for p in r["points"]]
        acc_ax.plot(tokens, [100 * p["avg_acc"] for p in r["points"]], "o-", label=r["label"])
        loss_ax.plot(tokens, [p["val_loss"] for p in r["points"]], "o-", label=r["label"])
    draw_chance(acc_ax, runs)
    acc_ax.set_xlabel("training tokens")
    acc_ax.set_ylabel("avg. accuracy (%)" + (f", {limit} questions/task" if limit else ""))
    loss_ax.set_xlabel("training tokens")
    loss_ax.set_ylabel("validation loss (nats/token)")
    acc_ax.legend(fontsize=8)
    fig.suptitle(scale_note(runs), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_table(runs: list[dict], out: Path, stem: str) -> None:
    (out / f"{stem}.json").write_text(json.dumps(runs, indent=1))
    with open(out / f"{stem}.csv", "w") as f:
        f.write("label,run,step,tokens,avg_acc,val_loss\n")
        for r in runs:
            for p in r["points"]:
                f.write(
                    f"{r['label']},{r['run']},{p['step']},{p['tokens']},{p['avg_acc']:.6f},{p['val_loss']:.6f}\n"
                )


def add_arguments(p) -> None:
    p.add_argument("--runs", required=True, help="run directories (globs), comma-separated")
    add_task_arguments(p)
    p.add_argument("--out", default="eval_out/curves", help="directory for curves.png/.json/.csv")


def command(args) -> int:
    from eval.tasks import parse_tasks

    names = parse_tasks(args.tasks)
    runs = collect(expand_runs(args.runs), names, args.limit)
    if not writes():
        return 0
    with output_dir(args.out) as out:
        write_table(runs, out, "curves")
        plot(runs, out / "curves.png", args.limit)
    for r in runs:
        last = r["points"][-1]
        print(
            f"{r['label']}: {len(r['points'])} checkpoints, last step {last['step']}: "
            f"avg_acc={last['avg_acc']:.4f} val_loss={last['val_loss']:.4f}"
        )
    print("wrote " + " ".join(f"{args.out.rstrip('/')}/curves.{ext}" for ext in ("png", "json", "csv")))
    return 0
