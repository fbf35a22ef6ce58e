"""The learning-rate and warm-up sweep behind the CPU sets' shared schedule (`eval.sweep --recipe
lr-sweep-1k`): one size trained at a few (lr, warm-up) settings and several seeds each, scored by
the final checkpoint's loss over every validation token. The setting is chosen for seeds that
agree (a small spread across seeds of one config) as much as for a low mean."""

from __future__ import annotations

import json
import statistics
from pathlib import Path


def summarize_final_loss(run_dir: Path) -> dict:
    """The run's schedule, seed and final validation loss over every token (no curve: a sweep
    compares end points)."""
    from effattn_jax import checkpoint
    from eval.lm_loss import checkpoint_lm_loss
    from eval.runs import attention_label, model_param_counts

    step = checkpoint.kept_steps(run_dir)[-1]
    cfg = checkpoint.load_run_config(run_dir, step)
    report = checkpoint_lm_loss(run_dir, step, seq_len=cfg.data.seq_len, bucket=cfg.data.seq_len // 4)
    return {
        "label": attention_label(cfg),
        "core": cfg.attention.core,
        "non_embedding_params": model_param_counts(cfg)["non_embedding"],
        "lr": cfg.train.lr,
        "warmup_steps": cfg.train.warmup_steps,
        "seed": cfg.train.seed,
        "step": step,
        "tokens": step * cfg.data.batch_size * cfg.data.seq_len,
        "loss": report["every_token"]["loss"],
        "every_token": report["every_token"],
    }


def settings_table(summaries: list[dict]) -> list[dict]:
    """(lr, warm-up) -> its seeds' final losses, mean, standard deviation and range."""
    by: dict[tuple[float, int], dict[int, float]] = {}
    for s in summaries:
        by.setdefault((s["lr"], s["warmup_steps"]), {})[s["seed"]] = s["loss"]
    rows = []
    for (lr, warmup), losses in sorted(by.items()):
        values = [losses[k] for k in sorted(losses)]
        rows.append(
            {
                "lr": lr,
                "warmup_steps": warmup,
                "seeds": sorted(losses),
                "losses": values,
                "mean": statistics.fmean(values),
                "sd": statistics.stdev(values) if len(values) > 1 else float("nan"),
                "range": max(values) - min(values),
            }
        )
    return rows


def draw_lr_sweep(summaries: list[dict], out: Path) -> None:
    """lr_sweep.md (the table) and lr_sweep.png (each seed's final loss against the learning rate,
    one line per warm-up)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = settings_table(summaries)
    s0 = summaries[0]
    head = (
        f"{s0['label']}, {s0['non_embedding_params']:,} non-embedding parameters, {s0['tokens']:,} tokens; "
        "final validation loss over every token"
    )
    lines = [
        head,
        "",
        "| lr | warm-up steps | seeds | loss per seed | mean | sd | range |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        per_seed = ", ".join(f"{v:.3f}" for v in r["losses"])
        seeds = ", ".join(map(str, r["seeds"]))
        lines.append(
            f"| {r['lr']:g} | {r['warmup_steps']} | {seeds} | {per_seed} | {r['mean']:.3f} | "
            f"{r['sd']:.3f} | {r['range']:.3f} |"
        )
    (out / "lr_sweep.md").write_text("\n".join(lines) + "\n")
    (out / "lr_sweep.json").write_text(json.dumps({"settings": rows}, indent=1) + "\n")
    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    for i, warmup in enumerate(sorted({r["warmup_steps"] for r in rows})):
        mine = [r for r in rows if r["warmup_steps"] == warmup]
        for r in mine:
            ax.scatter([r["lr"]] * len(r["losses"]), r["losses"], color=f"C{i}", s=14, alpha=0.6)
        ax.plot(
            [r["lr"] for r in mine], [r["mean"] for r in mine], "-o", color=f"C{i}", label=f"warm-up {warmup}"
        )
    ax.set(xscale="log", xlabel="peak learning rate", ylabel="final validation loss (nats/token)")
    ax.set_title(head, fontsize=8)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "lr_sweep.png", dpi=100)
    plt.close(fig)
    print("\n".join(lines))
    print(f"wrote {out / 'lr_sweep.md'} {out / 'lr_sweep.png'}")
