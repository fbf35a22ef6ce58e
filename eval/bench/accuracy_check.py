"""Why a small model's downstream accuracy can sit below chance: the model, or the scoring?

    JAX_PLATFORMS=cpu python -m eval.bench.accuracy_check --run runs/cpu_default [--limit 50] [--json]
        [--out results/<name>/accuracy_check.json]

Per task (the questions `eval downstream --limit K` scores): chance, acc and acc_norm, and what
two model-free rules score on the same questions, always the shortest or always the longest
choice (characters, as acc_norm counts them): a model that mostly prefers short continuations
(acc: a sum of log-probs) or long ones (acc_norm) scores what that rule scores, below chance
wherever the gold answers lean the other way. Also how often the model's pick is the
shortest / longest choice. Then the scoring itself: one task's questions scored again one
request at a time by a plain forward pass (`eval.scoring.direct_loglikelihood`), compared
choice for choice with the batched, prefix-shared scores.

`--json` prints {run, step, tasks: [{task, questions, chance, acc, acc_norm, shortest_choice_acc,
longest_choice_acc, acc_picks_shortest, acc_norm_picks_longest, gold_is_first, acc_picks_first}],
cross_check: {task, requests, max_abs_diff, same_pick}}.

`--out FILE` also writes that value to FILE, with what a reader needs to recompute and place it:
command, commit (of this checkout, "+dirty" when its tracked files differ), date,
questions_per_task, and average {metrics (task -> the metric the paper's average takes),
accuracy, chance}: the file `results/` keeps for RESULTS.md's "Why small models score below
chance".
"""

from __future__ import annotations

import datetime
import json
import subprocess
import sys
from pathlib import Path

import numpy as np

from effattn_jax.cli import positive_int
from eval.bench import common


def _rule(lengths: list[np.ndarray], pick) -> np.ndarray:
    return np.array([int(pick(n)) for n in lengths])


def task_check(model, tokenizer, eos: int, name: str, limit: int | None, max_len: int) -> dict:
    from eval.downstream import choice_chars
    from eval.scoring import encode_requests, score_requests
    from eval.tasks import load_task

    task = load_task(name, limit=limit)
    pairs = [(c, x) for q in task.questions for c, x in zip(q.contexts, q.continuations, strict=True)]
    scores = score_requests(model, encode_requests(tokenizer, eos, pairs), max_len=max_len, progress=False)
    bounds = np.cumsum([0] + [len(q.continuations) for q in task.questions])
    logprobs = [scores.logprob[a:b] for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
    chars = [np.array([choice_chars(x) for x in q.continuations]) for q in task.questions]
    gold = np.array([q.gold for q in task.questions])
    pick = _rule(logprobs, np.argmax)
    pick_norm = np.array(
        [int(np.argmax(lp / np.maximum(n, 1))) for lp, n in zip(logprobs, chars, strict=True)]
    )
    shortest, longest = _rule(chars, np.argmin), _rule(chars, np.argmax)
    mean = lambda x: float(np.mean(x))
    return {
        "task": name,
        "questions": len(gold),
        "chance": mean([1 / len(n) for n in chars]),
        "acc": mean(pick == gold),
        "acc_norm": mean(pick_norm == gold),
        "shortest_choice_acc": mean(shortest == gold),
        "longest_choice_acc": mean(longest == gold),
        "acc_picks_shortest": mean(pick == shortest),
        "acc_norm_picks_longest": mean(pick_norm == longest),
        "gold_is_first": mean(gold == 0),
        "acc_picks_first": mean(pick == 0),
    }


def scoring_cross_check(model, tokenizer, eos: int, name: str, limit: int, max_len: int) -> dict:
    """The batched scores against one-request-at-a-time plain forward passes."""
    from eval.scoring import direct_loglikelihood, encode_requests, score_requests
    from eval.tasks import load_task

    task = load_task(name, limit=limit)
    pairs = [(c, x) for q in task.questions for c, x in zip(q.contexts, q.continuations, strict=True)]
    requests = encode_requests(tokenizer, eos, pairs)
    batched = score_requests(model, requests, max_len=max_len, progress=False).logprob
    plain = []
    for ctx, cont in requests:
        ctx = ctx[-(max_len - len(cont)) :]  # cut from the left as the batched path does
        plain.append(direct_loglikelihood(model, ctx, cont, length=max_len)[0])
    plain = np.array(plain)
    bounds = np.cumsum([0] + [len(q.continuations) for q in task.questions])
    same_pick = [
        int(np.argmax(batched[a:b])) == int(np.argmax(plain[a:b]))
        for a, b in zip(bounds[:-1], bounds[1:], strict=True)
    ]
    return {
        "task": name,
        "requests": len(requests),
        "max_abs_diff": float(np.abs(batched - plain).max()),
        "same_pick": f"{sum(same_pick)}/{len(same_pick)}",
    }


def main(argv=None) -> int:
    p = common.parser(__doc__, __file__)
    p.add_argument("--run", required=True)
    p.add_argument("--limit", type=positive_int, default=50, help="seeded questions per task (as the sweeps)")
    p.add_argument("--cross-check", default="arc_easy", help="the task scored again request by request")
    p.add_argument("--out", type=Path, default=None, help="also write the figures and their provenance here")
    args = p.parse_args(argv)
    if args.out is not None and not args.out.parent.is_dir():
        p.error(f"--out: the directory {args.out.parent} does not exist")
    with common.report(args, f"{args.limit} questions per task") as emit:
        return check(args, emit, argv if argv is not None else sys.argv[1:])


def measure(args) -> dict:
    """{run, step, tasks, cross_check} of the run's last kept checkpoint (what --json prints)."""
    from flax import nnx

    from effattn_jax import checkpoint
    from effattn_jax.data.tokenizer import load_tokenizer
    from eval.tasks import AVERAGE_TASKS

    step = checkpoint.kept_steps(args.run)[-1]
    cfg, graphdef, params = checkpoint.load_params(args.run, step)
    model = nnx.merge(graphdef, params)
    tokenizer, eos, _ = load_tokenizer(cfg.data.tokenizer, cfg.data.eos_ids)
    rows = [task_check(model, tokenizer, eos, t, args.limit, cfg.data.seq_len) for t in AVERAGE_TASKS]
    cross = scoring_cross_check(model, tokenizer, eos, args.cross_check, args.limit, cfg.data.seq_len)
    return {"run": args.run, "step": step, "tasks": rows, "cross_check": cross}


def average(rows: list[dict]) -> dict:
    """The paper's average over these rows as `eval downstream` takes it (each task's metric from
    eval.tasks.TASKS), and its chance level."""
    from eval.tasks import TASKS

    metrics = {r["task"]: TASKS[r["task"]][1] for r in rows if TASKS[r["task"]][1]}
    picked = [r for r in rows if r["task"] in metrics]
    return {
        "metrics": metrics,
        "accuracy": float(np.mean([r[metrics[r["task"]]] for r in picked])) if picked else float("nan"),
        "chance": float(np.mean([r["chance"] for r in picked])) if picked else float("nan"),
    }


def checkout_commit() -> str:
    """HEAD of the checkout this script runs from, "+dirty" when tracked files differ from it;
    "unknown" outside a git checkout."""
    try:
        git = lambda *a: subprocess.run(
            ["git", *a], cwd=common.ROOT, capture_output=True, text=True, timeout=30
        )
        head = git("rev-parse", "HEAD")
        if head.returncode:
            return "unknown"
        dirty = git("status", "--porcelain", "--untracked-files=no").stdout.strip()
        return head.stdout.strip() + ("+dirty" if dirty else "")
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"


def document(value: dict, limit: int, argv: list[str]) -> dict:
    """What --out writes: the measured value with its command, commit, date and average."""
    return {
        "command": " ".join(["python -m eval.bench.accuracy_check", *argv]),
        "commit": checkout_commit(),
        "date": datetime.date.today().isoformat(),
        "questions_per_task": limit,
        **value,
        "average": average(value["tasks"]),
    }


def check(args, emit, argv: list[str]) -> int:
    value = measure(args)
    emit(value)
    if args.out is not None:
        args.out.write_text(json.dumps(document(value, args.limit, argv), indent=1) + "\n")
    step, rows, cross = value["step"], value["tasks"], value["cross_check"]
    cols = ["chance", "acc", "acc_norm", "shortest_choice_acc", "longest_choice_acc"]
    cols += ["acc_picks_shortest", "acc_norm_picks_longest", "gold_is_first", "acc_picks_first"]
    print(f"{args.run} step {step}, {args.limit} questions per task")
    print(f"{'task':<14}" + "".join(f"{c[:16]:>17}" for c in cols))
    for r in rows:
        print(f"{r['task']:<14}" + "".join(f"{r[c]:>17.3f}" for c in cols))
    print(
        f"cross-check {cross['task']}: {cross['requests']} requests, batched vs plain max |diff| "
        f"{cross['max_abs_diff']:.2e} nats, same pick on {cross['same_pick']} questions"
    )
    if args.out is not None:
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
