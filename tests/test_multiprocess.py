"""Two train.py processes (2 simulated CPU devices each, gloo collectives on loopback) through
`python -m effattn_jax.launch`: they train as one 4-device run, stop together when one of them
gets SIGTERM, and their checkpoint resumes on other meshes and in one process."""

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest
from conftest import tiny_overrides

from effattn_jax import checkpoint
from effattn_jax.config import load_config
from effattn_jax.sharding import make_mesh
from effattn_jax.train.loop import Preempted, run
from effattn_jax.train.metrics import read_scalars
from effattn_jax.train.state import make_setup

ROOT = Path(__file__).resolve().parents[1]
# the schedule depends on train.steps: every run here has the same, and stops early
LONG = {"train.steps": 100000, "checkpoint.every_steps": 2, "eval.every_steps": 100000}


def _children(pid: int) -> dict[int, int]:
    """JAX_PROCESS_ID -> pid of the launcher's train.py processes."""
    out = {}
    for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split():
        env = Path(f"/proc/{child}/environ").read_bytes().split(b"\0")
        ids = [e.split(b"=", 1)[1] for e in env if e.startswith(b"JAX_PROCESS_ID=")]
        out[int(ids[0])] = int(child)
    return out


def _losses(run_dir) -> dict[int, float]:
    return dict(read_scalars(run_dir)["loss"])


def test_two_processes_train_as_one_and_stop_together(tmp_path, corpus_dir):
    multi = tmp_path / "multi"
    cmd = [sys.executable, "-m", "effattn_jax.launch", "--processes", "2", "--devices-per-process", "2"]
    cmd += ["--log-dir", str(tmp_path / "logs"), "--"]
    cmd += ["--config", str(ROOT / "configs/cpu/default.yaml")]
    cmd += tiny_overrides(corpus_dir, multi, **LONG, **{"mesh.data": -1})
    log = tmp_path / "launch.log"
    with open(log, "w") as err:
        proc = subprocess.Popen(
            cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=err, text=True, start_new_session=True
        )
        try:
            end = time.time() + 240
            while not (multi / "checkpoints" / "4").is_dir():
                assert proc.poll() is None, log.read_text()[-3000:]
                assert time.time() < end, "no checkpoint within 240 s"
                time.sleep(0.2)
            pids = _children(proc.pid)
            os.kill(pids[1], signal.SIGTERM)  # one process only
            out, _ = proc.communicate(timeout=120)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)  # the launcher and its train.py processes
            proc.wait()
    assert proc.returncode == 143, log.read_text()[-3000:]
    last = out.strip().splitlines()[-1]
    stopped = int(last.split()[1].removeprefix("step="))
    assert last == f"preempted step={stopped} run_dir={multi}"
    assert f"preempted step={stopped} " in (tmp_path / "logs/process_1.log").read_text()  # the same step
    assert checkpoint.kept_steps(multi)[-1] == stopped

    # One process on 4 devices, same global batch: the same losses
    single = tmp_path / "single"
    cfg = load_config(None, tiny_overrides(corpus_dir, single, **LONG, **{"mesh.data": 4}))
    with pytest.raises(Preempted):
        run(cfg, stop_at=stopped)
    a, b = _losses(multi), _losses(single)
    assert sorted(a) == sorted(b) == list(range(1, stopped + 1))
    for step in a:
        assert a[step] == pytest.approx(b[step], rel=1e-5)

    # The 2-process checkpoint restores onto other meshes and one device, bitwise the same
    params = {}
    for shape in ((4, 1, 1), (1, 2, 2), (1, 1, 1)):
        setup = make_setup(cfg, make_mesh(*shape))
        step, state = checkpoint.Checkpoints(multi).restore_latest(setup.abstract_state)
        assert step == stopped
        params[shape] = jax.device_get(state["params"])
    for shape in ((1, 2, 2), (1, 1, 1)):
        for x, y in zip(jax.tree.leaves(params[(4, 1, 1)]), jax.tree.leaves(params[shape]), strict=True):
            assert np.array_equal(x, y)

    # ... and training continues there (one process now: the data position carries over)
    with pytest.raises(Preempted):
        run(cfg, stop_at=stopped + 1)
    expected = _losses(single)[stopped + 1]
    for shape in ((1, 2, 2), (1, 1, 1)):
        resumed = tmp_path / f"resumed-{'x'.join(map(str, shape))}"
        shutil.copytree(multi, resumed)
        mesh = dict(zip(("mesh.data", "mesh.fsdp", "mesh.tensor"), shape, strict=True))
        with pytest.raises(Preempted):
            run(load_config(None, tiny_overrides(corpus_dir, resumed, **LONG, **mesh)), stop_at=stopped + 1)
        assert _losses(resumed)[stopped + 1] == pytest.approx(expected, rel=1e-5)
