"""The benchmark harness (eval/bench/common.py, eval/timing.py): the alternated timer and its
contenders over donated state, the output frame under --json, one parser for every script, and the
data benchmark's child processes."""

import argparse
import json
import re
import subprocess
import sys
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import pytest
from conftest import ROOT

from eval import timing
from eval.bench import attention, common
from eval.timing import Carry, alternated, carried

SCRIPTS = sorted(
    p for p in (ROOT / "eval" / "bench").glob("*.py") if re.search(r"^def main\(", p.read_text(), re.M)
)


def test_alternated_takes_turns_and_keeps_medians():
    """Catches: contenders timed one after another (the drift lands on one), warm-up rounds kept,
    a dict measurement not split into its own medians."""
    calls = []
    values = {"a": iter([100.0, 1.0, 3.0, 2.0]), "b": iter([100.0, 5.0, 4.0, 6.0])}

    def contender(name):
        return lambda: calls.append(name) or next(values[name])

    out = alternated({"a": contender("a"), "b": contender("b")}, 3)
    assert calls == ["a", "b"] * 4 and out == {"a": 2.0, "b": 5.0}
    rounds = iter([{"x": 1.0, "y": 9.0}, {"x": 3.0, "y": 7.0}, {"x": 2.0, "y": 8.0}])
    assert alternated({"save": lambda: next(rounds)}, 3, warmup=0) == {"x": 2.0, "y": 8.0}


def test_carried_contenders_take_turns_over_one_donated_state(monkeypatch):
    """Two contenders sharing one Carry, on a clock their calls advance: a's turn is one untimed call
    and two timed ones (each costing its state), b's one call of 10. Catches: a call given a state
    that an earlier call donated instead of the one it returned, a shared state not passed from
    contender to contender, the untimed call timed, a turn's total not divided by its calls,
    warm-up rounds kept."""
    clock = [0.0]
    monkeypatch.setattr(timing, "time", SimpleNamespace(perf_counter=lambda: clock[0]))
    seen = []

    def call(name, cost):
        def fn(state):
            seen.append((name, state))
            clock[0] += cost(state)
            return state + 1, None

        return fn

    shared = Carry(0)
    a = carried(call("a", lambda state: state), shared, calls=2, untimed=1)
    b = carried(call("b", lambda state: 10.0), shared)
    out = alternated({"a": a, "b": b}, 3)
    assert [name for name, _ in seen] == ["a", "a", "a", "b"] * 4
    assert [state for _, state in seen] == list(range(16)) and shared.value == 16
    assert out == {"a": 9.5, "b": 10.0}  # a's kept turns: (5 + 6) / 2, (9 + 10) / 2, (13 + 14) / 2


def test_carried_donates_and_keeps_what_each_call_returns():
    """A jitted step donating its input (gone after the call). Catches: a donated array passed again
    (jax raises on a deleted array), the state returned not kept."""
    step = jax.jit(lambda x: (x + 1, x.sum()), donate_argnums=0)
    first = jnp.zeros(3)
    carry = Carry(first)
    out = alternated({"step": carried(step, carry, calls=2)}, 2)
    assert first.is_deleted() and carry.value.tolist() == [6.0] * 3 and out["step"] > 0


def test_report_under_json_leaves_stdout_to_the_json(capsys):
    """Catches: the platform line or a table line mixed into the JSON a script's reader parses."""
    with common.report(argparse.Namespace(json=True), "what is measured") as emit:
        print("| a table line |")
        emit({"key": 1})
    out, err = capsys.readouterr()
    assert json.loads(out) == {"key": 1}
    assert err.startswith("jax ") and "; what is measured\n| a table line |" in err
    with common.report(argparse.Namespace(json=False)) as emit:
        print("| a table line |")
        emit({"key": 1})
    assert capsys.readouterr().out.endswith("processes)\n| a table line |\n")


def test_every_script_builds_the_one_parser_and_documents_its_json():
    """Catches: a script with its own argparse construction, without --json, or whose docstring does
    not say what --json prints."""
    assert len(SCRIPTS) >= 14, SCRIPTS
    for path in SCRIPTS:
        text = path.read_text()
        doc = text.split('"""')[1]
        assert "common.parser(__doc__, __file__" in text, path.name
        assert "ArgumentParser(" not in text and "import argparse" not in text, path.name
        assert "--json" in doc, f"{path.name}: its docstring does not say what --json prints"


def test_the_one_parser_names_the_script_and_errs_in_one_line(capsys):
    p = common.parser("doc", str(ROOT / "eval" / "bench" / "attention.py"))
    assert p.prog == "python -m eval.bench.attention" and p.parse_args(["--json"]).json
    with pytest.raises(SystemExit):
        p.parse_args(["--bogus"])
    assert capsys.readouterr().err.count("\n") == 1


def test_attention_json_has_the_documented_keys(capsys):
    argv = "--seqs 128 --heads 1 --head-dim 8 --block-size 32 --dsa-top-k 16 --repeats 1 --json"
    attention.main(argv.split())
    (row,) = json.loads(capsys.readouterr().out)
    times = {"dense_ms", "moba_ms", "dsa_ms", "speedup", "dsa_speedup"}
    assert set(row) == {"seq", *times, "dense_bytes", "moba_bytes", "dsa_bytes"}
    assert row["dense_bytes"] > 0 and row["moba_ms"] > 0 and row["dsa_ms"] > 0


CHATTY = "import sys; sys.stderr.write('x' * 200_000 + 'the end'); sys.exit({code})"


@pytest.mark.parametrize("code", [0, 1])
def test_data_bench_survives_a_child_that_writes_more_than_a_pipe_holds(code):
    """200 KB on stderr (a pipe holds 64 KiB), then exit 0 or 1. Catches: stderr piped and read only
    after waiting for the child, which then blocks on the full pipe for ever (bounded here by the
    timeout); a failure that loses the end of the child's stderr."""
    child = [sys.executable, "-c", CHATTY.format(code=code)]
    script = f"from eval.bench.data import peak_rss_gib; print(peak_rss_gib({child!r}))"
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    if code:
        assert done.returncode == 1 and done.stderr.rstrip().endswith("x" * 100 + "the end")
    else:
        assert done.returncode == 0 and 0 < float(done.stdout) < 1, done.stderr[-500:]
