"""Fault test: `python -m eval.bench.faults [--kills 5] [--seed 0] [--steps 120] [--cases-only]`.

First the kill test: trains a tiny model on the built-in corpus through train.py, `kill -9`s it
at random moments (the first kill lands while an async checkpoint is being written), reruns the
same command after each kill, and checks that the run, once finished, ends bitwise where an
uninterrupted run of the same config ends (final val_loss and last training loss); one line per
kill and then `kills survived: K/N`.

Then the bad-input cases, each a fresh process: a step whose manifest is gone (and whose files are
flipped or cut short) in training and in eval, a full and a read-only checkpoint directory (a
tmpfs, where this machine lets the script mount one), a run too large for memory, a config that
is not UTF-8, and a corrupt prepared shard. A table (case, expected, observed, pass) and then
`faults passed: P/Q` (a case that cannot run here counts as neither and says why). Exit status 0
only when every kill survived and every case passed. `--json` prints {kills, kills_survived,
bitwise_equal (null with --cases-only), cases: [{case, expected, observed, pass}], faults_passed,
faults_run}.
"""

from __future__ import annotations

import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from effattn_jax.cli import positive_int
from eval.bench import common
from eval.bench.fault_cases import Cases, run_cases

ROOT = common.ROOT
TINY = [
    "model.d_model=32",
    "model.num_layers=2",
    "model.num_heads=4",
    "model.num_kv_heads=2",
    "model.mlp_dim=64",
    "data.seq_len=64",
    "data.batch_size=8",
    "train.warmup_steps=10",
    "train.log_every=10",
    "train.progress=true",
    "checkpoint.every_steps=10",
    "checkpoint.async_save=true",
    "eval.every_steps=100000",
    "mesh.data=1",
]


def _command(run_dir: Path, steps: int) -> list[str]:
    config = str(ROOT / "configs/cpu/default.yaml")
    return [
        sys.executable,
        str(ROOT / "train.py"),
        "--config",
        config,
        *TINY,
        f"train.steps={steps}",
        f"train.run_dir={run_dir}",
    ]


class _Training:
    """One train.py process whose progress bar is followed (the step it has reached)."""

    def __init__(self, cmd: list[str]):
        env = {**os.environ, "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu")}
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        self.step = 0
        threading.Thread(target=self._follow, daemon=True).start()

    def _follow(self) -> None:
        buf = b""
        while chunk := self.proc.stderr.read1(4096):
            buf = (buf + chunk)[-4096:]
            found = re.findall(rb"train:\s+\d+%\|[^|]*\|\s*(\d+)/", buf)
            if found:
                self.step = int(found[-1])

    def finish(self, timeout: float = 600) -> tuple[int, str]:
        """(exit status, stdout); stderr stays with the follower thread."""
        out = self.proc.stdout.read()
        return self.proc.wait(timeout), out.decode()


def _final(out: str, run_dir: Path) -> tuple[str, float]:
    from effattn_jax.train.metrics import read_scalars

    return out.strip().splitlines()[-1].split()[0], read_scalars(run_dir)["loss"][-1][1]


def _kill_during_save(t: _Training, ckpt_dir: Path, deadline: float) -> bool:
    """kill -9 as soon as Orbax's temporary directory of a save in progress appears."""
    while time.monotonic() < deadline and t.proc.poll() is None:
        if ckpt_dir.is_dir() and any("tmp" in p.name for p in ckpt_dir.iterdir()):
            t.proc.send_signal(signal.SIGKILL)
            return True
        time.sleep(0.001)
    return False


def run_faults(kills: int, steps: int, seed: int, workdir: Path) -> dict:
    """The kill test: {kills, kills_survived, bitwise_equal}, each line printed as it happens."""
    rng = random.Random(seed)
    t0 = time.monotonic()
    code, out = _Training(_command(workdir / "reference", steps)).finish()
    if code != 0:
        print(f"the uninterrupted run failed (exit {code})", file=sys.stderr)
        return {"kills": kills, "kills_survived": 0, "bitwise_equal": False}
    reference = _final(out, workdir / "reference")
    print(
        f"uninterrupted: {reference[0]} last loss {reference[1]!r} ({time.monotonic() - t0:.0f} s)",
        flush=True,
    )

    run_dir, survived = workdir / "killed", 0
    targets = sorted(rng.sample(range(2, steps - 1), kills - 1))  # the other kills: at these steps
    for k in range(kills):
        t = _Training(_command(run_dir, steps))
        if k == 0:
            hit = _kill_during_save(t, run_dir / "checkpoints", time.monotonic() + 600)
            where = "while an async checkpoint was being written" if hit else "(no save seen: not killed)"
        else:
            while t.proc.poll() is None and t.step < targets[k - 1]:
                time.sleep(rng.uniform(0.0, 0.05))
            t.proc.send_signal(signal.SIGKILL)
            where = f"at step {t.step} (target {targets[k - 1]})"
        code, _ = t.finish()
        survived += code == -signal.SIGKILL
        print(f"kill {k + 1}: {where}; exit {code}", flush=True)
    code, out = _Training(_command(run_dir, steps)).finish()  # the rerun after the last kill, to the end
    final = _final(out, run_dir) if code == 0 else None
    same = final == reference
    print(
        f"resumed to the end: {final[0] if final else f'exit {code}'}; bitwise equal to uninterrupted: {same}"
    )
    survived = survived if same else 0
    print(f"kills survived: {survived}/{kills}")
    return {"kills": kills, "kills_survived": survived, "bitwise_equal": same}


def run_bad_input_cases(workdir: Path) -> dict:
    """The table of bad-input cases and `faults passed: P/Q`: {cases, faults_passed, faults_run}."""
    finished = workdir / "finished"
    code, _ = _Training(_command(finished, 20)).finish()  # saves steps 10 and 20
    if code != 0:
        print(f"the tiny run the cases start from failed (exit {code})", file=sys.stderr)
        return {"cases": [], "faults_passed": 0, "faults_run": 1}
    train = lambda run_dir, steps, *extra: [*_command(run_dir, steps), "train.progress=false", *extra]
    rows = run_cases(Cases(train, finished, workdir, ROOT))
    ran = [r for r in rows if r["pass"] is not None]
    passed = sum(r["pass"] for r in ran)
    print(f"faults passed: {passed}/{len(ran)}")
    return {"cases": rows, "faults_passed": passed, "faults_run": len(ran)}


def main(argv: list[str] | None = None) -> int:
    p = common.parser(__doc__, __file__)
    p.add_argument("--kills", type=positive_int, default=5)
    p.add_argument("--cases-only", action="store_true", help="skip the kill test")
    p.add_argument("--steps", type=positive_int, default=120, help="training steps of the tiny run")
    p.add_argument("--seed", type=int, default=0, help="chooses the kill moments")
    p.add_argument("--workdir", help="where the two runs go (default: a new temp dir)")
    args = p.parse_args(argv)
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="effattn-faults-"))
    with common.report(args, f"runs in {workdir}") as emit:
        none = {"kills": 0, "kills_survived": 0, "bitwise_equal": None}
        out = none if args.cases_only else run_faults(args.kills, args.steps, args.seed, workdir)
        out |= run_bad_input_cases(workdir)
        emit(out)
    ok = out["kills_survived"] == out["kills"] and out["faults_passed"] == out["faults_run"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
