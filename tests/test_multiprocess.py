"""Two train.py processes (2 simulated CPU devices each, gloo collectives on loopback) through
`python -m effattn_jax.launch`: they train as one 4-device run, stop together when one of them
gets SIGTERM, and their checkpoint resumes on other meshes and in one process."""

import contextlib
import json
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
from conftest import ROOT, tiny_overrides

from effattn_jax import checkpoint
from effattn_jax.config import load_config
from effattn_jax.sharding import make_mesh
from effattn_jax.train.loop import Preempted, run
from effattn_jax.train.metrics import read_scalars
from effattn_jax.train.state import make_setup

pytestmark = pytest.mark.slow  # processes and launches
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
    """Two processes of two devices each train as one 4-device run (the same losses as one process), and
    when one is killed the other stops too. Catches: a process left hanging in a collective, per-process
    data that overlaps."""
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


@pytest.fixture(scope="module")
def small_run(tmp_path_factory):
    """A tiny run with checkpoints at steps 2 and 4."""
    from conftest import write_corpus

    root = tmp_path_factory.mktemp("small_run")
    run(load_config(None, tiny_overrides(write_corpus(root / "corpus"), root / "run", **{"train.steps": 4})))
    return root / "run"


def _launch(tmp_path, module: str, *args: str) -> str:
    """process 0's stdout of `python -m module args` in 2 processes of 1 device each."""
    cmd = [sys.executable, "-m", "effattn_jax.launch", "--processes", "2", "--devices-per-process", "1"]
    cmd += ["--log-dir", str(tmp_path / "logs"), "--module", module, "--", *args]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, p.stderr[-3000:]
    return p.stdout


def test_eval_and_generate_split_across_processes(tmp_path, small_run, capsys):
    """The same commands in this process and in 2 processes of 1 device: the same figures and
    text, printed once."""
    from effattn_jax.generate import main as generate_main
    from eval.__main__ import main as eval_main

    run_dir = str(small_run)
    downstream = ["downstream", "--run", run_dir, "--tasks", "piqa,arc_easy,winogrande", "--limit", "5"]
    lm_loss = ["lm-loss", "--run", run_dir, "--bucket", "8"]
    prompt = ["--run", run_dir, "--prompt", "The", "--prompt", "We the people", "--max-new-tokens", "6"]
    assert eval_main([*downstream, "--json", str(tmp_path / "one.json")]) == 0
    assert eval_main([*lm_loss, "--json", str(tmp_path / "one_lm.json")]) == 0
    capsys.readouterr()
    assert generate_main(prompt) == 0
    text = capsys.readouterr().out

    out = _launch(tmp_path, "eval", *downstream, "--json", str(tmp_path / "two.json"))
    assert out.count("avg_acc=") == 1  # printed by process 0 only
    one, two = (json.loads((tmp_path / f"{n}.json").read_text()) for n in ("one", "two"))
    assert two["tasks"] == one["tasks"]  # every metric and count
    tokens = lambda report: {task: s["tokens"] for task, s in report["speed"].items()}
    assert tokens(two) == tokens(one)

    _launch(tmp_path, "eval", *lm_loss, "--json", str(tmp_path / "two_lm.json"))
    one_lm, two_lm = (json.loads((tmp_path / f"{n}_lm.json").read_text()) for n in ("one", "two"))
    assert (
        two_lm == one_lm and one_lm[0]["tokens"] > 0
    )  # each document's loss from one process, summed exactly

    assert _launch(tmp_path, "effattn_jax.generate", *prompt) == text  # once, and the same text


RESTORE = """
import sys, jax
from effattn_jax.config import DistributedConfig
from effattn_jax.launch import initialize
initialize(DistributedConfig())
from effattn_jax import checkpoint
from effattn_jax.sharding import make_mesh
from effattn_jax.train.state import make_setup
run_dir = sys.argv[1 + jax.process_index()]
setup = make_setup(checkpoint.load_run_config(run_dir, 2), make_mesh(1, 1, 1, devices=jax.local_devices()))
step, _ = checkpoint.Checkpoints(run_dir).restore_latest(setup.abstract_state)
print(f"restored step {step}")
"""


def test_processes_agree_on_a_step_only_one_of_them_finds_corrupt(tmp_path, small_run):
    """Each process reads its own copy of the run; process 1's newest step is damaged. Both must set that
    step aside and resume from the same older one. Catches: a verdict taken per process (they would
    restore different steps and hang)."""
    from conftest import corrupt_step

    from effattn_jax.launch import _env, _free_port

    copies = [tmp_path / "p0", tmp_path / "p1"]
    for c in copies:
        shutil.copytree(small_run, c)
    corrupt_step(copies[1] / "checkpoints" / "4", "flip")
    port = _free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", RESTORE, *map(str, copies)],
            cwd=ROOT,
            env=_env(i, 2, port, 1),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(2)
    ]
    try:
        outs = [p.communicate(timeout=180) for p in procs]
    finally:
        for p in procs:
            p.kill()
            p.wait()
    for p, (out, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, err[-3000:]
        assert out.strip().splitlines()[-1] == "restored step 2"
    assert "it failed on another process" in outs[0][1] and "ChecksumError" in outs[1][1]
    assert (copies[0] / "checkpoints" / "corrupt" / "4").is_dir()  # process 0 moved its own copy's step
