"""eval.bench.accuracy_check: the per-task figures of RESULTS.md's below-chance table, computed from
made-up scores, and the `--out` file that keeps them with their provenance (no model runs here)."""

import datetime
import json
import re
from types import SimpleNamespace

import numpy as np
import pytest

from eval.bench import accuracy_check
from eval.tasks import Question, Task

# RESULTS.md's "Why small models score below chance" table (results/accuracy-check/cpu_default.json,
# 2026-12-05, commit 814c90f): chance, acc,
# acc_norm, always shortest, always longest, acc picks the shortest, acc_norm picks the longest
RESULTS_ROWS = {
    "piqa": (0.50, 0.50, 0.44, 0.52, 0.46, 0.74, 0.62),
    "arc_easy": (0.25, 0.20, 0.16, 0.38, 0.12, 0.52, 0.54),
    "arc_challenge": (0.25, 0.36, 0.30, 0.28, 0.24, 0.46, 0.52),
    "hellaswag": (0.25, 0.26, 0.12, 0.20, 0.20, 0.78, 0.32),
    "winogrande": (0.50, 0.52, 0.52, 0.50, 0.50, 0.54, 0.54),
    "siqa": (1 / 3, 0.40, 0.42, 0.36, 0.26, 0.74, 0.50),
    "mmlu": (0.25, 0.24, 0.34, 0.16, 0.38, 0.54, 0.54),
}
COLUMNS = ("chance", "acc", "acc_norm", "shortest_choice_acc", "longest_choice_acc")
COLUMNS += ("acc_picks_shortest", "acc_norm_picks_longest")


def test_task_check_figures_follow_the_scores_and_the_choice_lengths(monkeypatch):
    """Catches: acc_norm dividing by tokens or by the leading space, the length rules picking the
    wrong end, chance taken from the first question only, picks compared with the wrong rule."""
    task = Task(
        "made_up",
        "test",
        "none",
        [
            Question(("q1",) * 2, (" a", " bbbb"), gold=1),
            Question(("q2",) * 3, (" cc", " d", " eeeeee"), gold=0),
        ],
    )
    logprob = np.array([-1.0, -3.0, -2.0, -5.0, -4.0])  # acc picks 0, 0; acc_norm picks 1, 2
    monkeypatch.setattr("eval.tasks.load_task", lambda name, limit=None: task)
    monkeypatch.setattr("eval.scoring.encode_requests", lambda tokenizer, eos, pairs: pairs)
    monkeypatch.setattr(
        "eval.scoring.score_requests",
        lambda model, requests, max_len, progress: SimpleNamespace(logprob=logprob),
    )
    row = accuracy_check.task_check(None, None, 0, "made_up", 2, 64)
    assert row == pytest.approx(
        {
            "task": "made_up",
            "questions": 2,
            "chance": (1 / 2 + 1 / 3) / 2,
            "acc": 0.5,
            "acc_norm": 0.5,
            "shortest_choice_acc": 0.0,
            "longest_choice_acc": 0.5,
            "acc_picks_shortest": 0.5,
            "acc_norm_picks_longest": 1.0,
            "gold_is_first": 0.5,
            "acc_picks_first": 1.0,
        }
    )


def _value():
    made_up = {"gold_is_first": 0.3, "acc_picks_first": 0.4}  # the two columns RESULTS does not show
    rows = [
        {"task": t, "questions": 50, **dict(zip(COLUMNS, v, strict=True)), **made_up}
        for t, v in RESULTS_ROWS.items()
    ]
    cross = {"task": "arc_easy", "requests": 199, "max_abs_diff": 1.1e-5, "same_pick": "50/50"}
    return {"run": "runs/cpu_default", "step": 180, "tasks": rows, "cross_check": cross}


def test_out_keeps_the_table_with_run_commit_date_and_the_average(tmp_path, monkeypatch, capsys):
    """Catches: --out missing the provenance a reader needs (command, commit, date, questions per
    task), an average that takes acc where the paper takes acc_norm (RESULTS' 31.4 % against
    33.3 % chance), --json no longer printing the value alone."""
    monkeypatch.setattr(accuracy_check, "measure", lambda args: _value())
    out = tmp_path / "accuracy_check.json"
    argv = ["--run", "runs/cpu_default", "--limit", "50", "--out", str(out), "--json"]
    assert accuracy_check.main(argv) == 0
    assert json.loads(capsys.readouterr().out) == _value()
    doc = json.loads(out.read_text())
    assert doc["command"] == "python -m eval.bench.accuracy_check " + " ".join(argv)
    assert re.fullmatch(r"[0-9a-f]{40}(\+dirty)?|unknown", doc["commit"])
    assert doc["date"] == datetime.date.today().isoformat()
    assert doc["questions_per_task"] == 50
    assert {k: doc[k] for k in ("run", "step", "tasks", "cross_check")} == _value()
    assert doc["average"]["metrics"] == {
        **{t: "acc_norm" for t in ("piqa", "arc_easy", "arc_challenge", "hellaswag", "siqa")},
        "winogrande": "acc",
        "mmlu": "acc",
    }
    assert round(doc["average"]["accuracy"], 3) == 0.314 and round(doc["average"]["chance"], 3) == 0.333


def test_out_into_a_missing_directory_fails_in_one_line_before_any_work(tmp_path, monkeypatch, capsys):
    """Catches: a many-minute scoring run whose figures are then lost to a bad --out path."""
    monkeypatch.setattr(
        accuracy_check, "measure", lambda args: pytest.fail("measured before --out was checked")
    )
    with pytest.raises(SystemExit) as exit_:
        accuracy_check.main(["--run", "r", "--out", str(tmp_path / "absent" / "a.json")])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--out" in err and "does not exist" in err
