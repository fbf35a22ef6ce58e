"""The suite's cached task data as JSON documents for the harness's `json` dataset loader, so
harness tasks run offline on exactly the questions `python -m eval downstream` scores (the task
YAMLs under tests/harness_tasks/ read these files from the working directory).

A multiple-choice document is {"context", "choices", "gold"}: the context as the suite's request
file has it, and each choice without the leading space the harness puts back as its
`target_delimiter`.
"""

from __future__ import annotations

import json
from pathlib import Path

from eval.tasks import load_task


def write_choice_docs(name: str, path: Path, *, limit: int | None = None) -> int:
    """Writes task `name`'s questions to `path` (JSON lines); returns how many."""
    task = load_task(name, limit=limit)
    with open(path, "w") as f:
        for q in task.questions:
            if len(set(q.contexts)) != 1 or not all(c.startswith(" ") for c in q.continuations):
                raise ValueError(
                    f"task {name}: its questions are not one context with space-led choices "
                    "(WinoGrande-style partial scoring has no JSON form here)"
                )
            doc = {"context": q.contexts[0], "choices": [c[1:] for c in q.continuations], "gold": q.gold}
            f.write(json.dumps(doc) + "\n")
    return len(task.questions)
