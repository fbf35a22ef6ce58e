"""End to end through the CLI: SIGTERM -> checkpoint, exit 143, resume; kill -9 -> resume."""

import os
import signal
import subprocess
import sys
import time

import pytest
from conftest import ROOT, tiny_overrides

from effattn_jax import checksums

pytestmark = pytest.mark.slow  # signals to a training process


def launch(corpus_dir, run_dir, log):
    cmd = [
        sys.executable,
        str(ROOT / "train.py"),
        "--config",
        str(ROOT / "configs/cpu/default.yaml"),
        *tiny_overrides(
            corpus_dir,
            run_dir,
            **{"train.steps": 100000, "checkpoint.every_steps": 3, "eval.every_steps": 100000},
        ),
    ]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=open(log, "w"), text=True, cwd=ROOT)


def wait_for(pred, proc, timeout=120):
    end = time.time() + timeout
    while time.time() < end:
        if pred():
            return
        assert proc.poll() is None, "training exited early"
        time.sleep(0.2)
    proc.kill()
    raise AssertionError("timed out")


def steps(run_dir):
    """The complete steps: committed by Orbax and checksummed (a step without its manifest is set aside
    on resume, so it does not count as saved)."""
    d = run_dir / "checkpoints"
    done = [p for p in d.iterdir() if p.name.isdigit() and checksums.has_manifest(p)] if d.exists() else []
    return sorted(int(p.name) for p in done)


def test_sigterm_and_kill9_resume(tmp_path, corpus_dir):
    """SIGTERM and SIGINT checkpoint the finished step and exit 143 with the `preempted step=N run_dir=D`
    line; kill -9 loses at most the steps since the last save. Catches: a signal handler that exits
    without saving, a resume from an older step."""
    run_dir = tmp_path / "run"
    p = launch(corpus_dir, run_dir, tmp_path / "a.log")
    try:
        wait_for(lambda: steps(run_dir), p)
        p.send_signal(signal.SIGTERM)
        out, _ = p.communicate(timeout=60)
    finally:
        p.kill()
    assert p.returncode == 143
    last = out.strip().splitlines()[-1]
    assert last.startswith("preempted step=") and last.endswith(f"run_dir={run_dir}")
    n = int(last.split()[1].split("=")[1])
    assert steps(run_dir)[-1] == n  # it checkpointed the step it finished

    p = launch(corpus_dir, run_dir, tmp_path / "b.log")
    try:
        wait_for(lambda: f"resumed from step {n}" in (tmp_path / "b.log").read_text(), p)
        wait_for(lambda: steps(run_dir)[-1] > n, p)
        os.kill(p.pid, signal.SIGKILL)
        p.wait(timeout=30)
    finally:
        p.kill()
    m = steps(run_dir)[-1]

    p = launch(corpus_dir, run_dir, tmp_path / "c.log")
    try:
        wait_for(lambda: "resumed from step" in (tmp_path / "c.log").read_text(), p)
        p.send_signal(signal.SIGINT)
        out, _ = p.communicate(timeout=60)
    finally:
        p.kill()
    resumed = int((tmp_path / "c.log").read_text().split("resumed from step ")[1].split()[0])
    assert resumed >= m > n and p.returncode == 143
