"""Zero-shot multiple-choice accuracy on the downstream tasks, by log-likelihood.

For each question every choice's continuation is scored given its context (eval/scoring.py);
the prediction is the choice with the highest
- `acc`: sum of the continuation's token log-probs,
- `acc_norm`: that sum divided by the choice's length in characters, its leading space (the
  delimiter between context and choice) not counted: lm-evaluation-harness's per-character
  normalisation, so the two agree question for question,
each with its standard error sqrt(p (1 - p) / (n - 1)) (the harness's), and the task's chance
level: the mean over questions of 1 / its number of choices. The average is the EG-MLA paper's
"Avg. Accuracy" (AVERAGE_RULE). SciQ and LAMBADA are reported beside it; LAMBADA's figures are
last-word accuracy (every continuation token is the greedy choice) and perplexity
exp(-mean log-likelihood of the last word).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np

from effattn_jax import storage
from eval.processes import writes
from eval.scoring import encode_requests, score_requests
from eval.tasks import TASKS, Task, add_task_arguments, load_task

AVERAGE_RULE = (
    "avg_acc: mean of acc_norm (piqa, arc_easy, arc_challenge, hellaswag, siqa) and acc (winogrande, mmlu); "
    "sciq and lambada are not in it"
)


def stderr(correct: np.ndarray) -> float:
    n = len(correct)
    p = float(np.mean(correct)) if n else 0.0
    return math.sqrt(p * (1 - p) / (n - 1)) if n > 1 else 0.0


def choice_chars(continuation: str) -> int:
    """acc_norm's length of a choice: its characters without the leading delimiter space (the
    harness divides by the length of the choice text, which it joins to the context with " ")."""
    return len(continuation) - continuation.startswith(" ")


def choice_metrics(logprobs: list[np.ndarray], char_lengths: list[np.ndarray], gold: np.ndarray) -> dict:
    """acc / acc_norm, their standard errors and the chance level from each question's
    per-choice scores."""
    pred = np.array([int(np.argmax(lp)) for lp in logprobs])
    pred_norm = np.array(
        [int(np.argmax(lp / np.maximum(n, 1))) for lp, n in zip(logprobs, char_lengths, strict=True)]
    )
    acc, acc_norm = (pred == gold).astype(float), (pred_norm == gold).astype(float)
    return {
        "acc": float(acc.mean()),
        "acc_stderr": stderr(acc),
        "acc_norm": float(acc_norm.mean()),
        "acc_norm_stderr": stderr(acc_norm),
        "chance": float(np.mean([1 / len(lp) for lp in logprobs])),
    }


@dataclass
class TaskResult:
    name: str
    split: str
    questions: int
    continuations: int
    metrics: dict

    def row(self) -> dict:
        return {
            "task": self.name,
            "split": self.split,
            "questions": self.questions,
            "continuations": self.continuations,
            **self.metrics,
        }


def evaluate_task(
    model, tokenizer, eos: int, task: Task, *, max_len: int, progress: bool = True
) -> tuple[TaskResult, dict]:
    """(result, throughput figures) of one task."""
    pairs = [(c, x) for q in task.questions for c, x in zip(q.contexts, q.continuations, strict=True)]
    requests = encode_requests(tokenizer, eos, pairs)
    start = time.perf_counter()
    scores = score_requests(model, requests, max_len=max_len, desc=task.name, progress=progress)
    seconds = time.perf_counter() - start
    if task.name == "lambada":
        lp = scores.logprob
        metrics = {
            "acc": float(scores.greedy.mean()),
            "acc_stderr": stderr(scores.greedy.astype(float)),
            "perplexity": float(np.exp(-lp.mean())),
        }
    else:
        bounds = np.cumsum([0] + [len(q.continuations) for q in task.questions])
        logprobs = [scores.logprob[a:b] for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
        chars = [np.array([choice_chars(x) for x in q.continuations]) for q in task.questions]
        metrics = choice_metrics(logprobs, chars, np.array([q.gold for q in task.questions]))
    speed = {
        "seconds": seconds,
        "tokens": int(scores.context_tokens + scores.tokens.sum()),
        "continuations": len(requests),
        "truncated_contexts": scores.truncated,
    }
    return TaskResult(task.name, task.split, len(task.questions), len(requests), metrics), speed


def average_accuracy(results: dict[str, TaskResult]) -> float:
    """The paper's average (AVERAGE_RULE) over the evaluated tasks that belong to it (nan if none)."""
    picks = [r.metrics[TASKS[name][1]] for name, r in results.items() if TASKS[name][1]]
    return float(np.mean(picks)) if picks else float("nan")


def average_chance(results: dict[str, TaskResult]) -> float:
    """The average's chance level: the mean of its tasks' (nan if none)."""
    picks = [r.metrics["chance"] for name, r in results.items() if TASKS[name][1]]
    return float(np.mean(picks)) if picks else float("nan")


def average_stderr(results: dict[str, TaskResult]) -> float:
    """Standard error of that average, the tasks' questions being independent samples."""
    picks = [r.metrics[TASKS[name][1] + "_stderr"] for name, r in results.items() if TASKS[name][1]]
    return math.sqrt(sum(s * s for s in picks)) / len(picks) if picks else float("nan")


def run_downstream(model, cfg, names: list[str], *, limit: int | None, progress: bool = True) -> dict:
    """Every figure of one checkpoint on the named tasks, as a JSON-ready dict."""
    from effattn_jax.data.tokenizer import load_tokenizer

    start = time.perf_counter()
    tokenizer, eos, _ = load_tokenizer(cfg.data.tokenizer, cfg.data.eos_ids)
    results, speed = {}, {}
    for name in names:
        task = load_task(name, limit=limit)
        results[name], speed[name] = evaluate_task(
            model, tokenizer, eos, task, max_len=cfg.data.seq_len, progress=progress
        )
    scoring = sum(s["seconds"] for s in speed.values())
    tokens = sum(s["tokens"] for s in speed.values())
    continuations = sum(r.continuations for r in results.values())
    return {
        "avg_acc": average_accuracy(results),
        "avg_acc_stderr": average_stderr(results),
        "avg_chance": average_chance(results),
        "average_rule": AVERAGE_RULE,
        "tasks": [results[n].row() for n in names],
        "limit": limit,
        "continuations": continuations,
        "seconds": time.perf_counter() - start,  # reading, tokenizing and scoring
        "scoring_seconds": scoring,
        "tokens_per_sec": tokens / scoring if scoring else float("nan"),
        "continuations_per_sec": continuations / scoring if scoring else float("nan"),
        "speed": speed,
    }


def format_report(report: dict) -> str:
    """The table, the averaging rule, and the last line scripts parse."""
    head = f"{'task':<14} {'split':<10} {'questions':>9} {'contin.':>8} {'acc':>15} {'acc_norm':>15}"
    lines = [f"{head} {'chance':>7}"]
    for r in report["tasks"]:
        norm = (
            f"{r['acc_norm']:.4f}±{r['acc_norm_stderr']:.4f}"
            if "acc_norm" in r
            else f"ppl {r['perplexity']:.2f}"
        )
        chance = f"{r['chance']:.4f}" if "chance" in r else "-"
        lines.append(
            f"{r['task']:<14} {r['split']:<10} {r['questions']:>9} {r['continuations']:>8} "
            f"{r['acc']:.4f}±{r['acc_stderr']:.4f} {norm:>15} {chance:>7}"
        )
    lines.append(report["average_rule"])
    lines.append(
        f"avg_acc={report['avg_acc']:.4f} tasks={len(report['tasks'])} "
        f"continuations={report['continuations']} seconds={report['seconds']:.1f} "
        f"avg_chance={report['avg_chance']:.4f}"
    )
    return "\n".join(lines)


def add_arguments(p) -> None:
    p.add_argument("--run", required=True, help="run directory")
    p.add_argument("--step", default="latest", help="N, latest or all (kept checkpoints)")
    add_task_arguments(p)
    p.add_argument("--json", default=None, help="write every figure to this file")


def command(args) -> int:
    import json

    from flax import nnx

    from effattn_jax import checkpoint
    from eval.tasks import parse_tasks

    names = parse_tasks(args.tasks)
    reports = []
    for step in checkpoint.select_steps(args.run, args.step):
        cfg, graphdef, params = checkpoint.load_params(args.run, step)
        model = nnx.merge(graphdef, params)
        report = run_downstream(model, cfg, names, limit=args.limit, progress=writes()) | {"step": step}
        reports.append(report)
        print(format_report(report))
    if args.json and writes():
        storage.write_atomic(
            storage.path(args.json), json.dumps(reports if len(reports) > 1 else reports[0], indent=1)
        )
    return 0
