"""The bad-input cases of `python -m eval.bench.faults`: each runs train.py or eval in a fresh
process on a copy of one tiny finished run and checks the exit status and the last line on stderr
(one line, no traceback)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from effattn_jax import checksums


class CannotRun(Exception):
    """A case this machine cannot set up (e.g. no permission to mount a filesystem)."""


@dataclass
class Outcome:
    code: int
    stderr: str

    @property
    def last(self) -> str:
        return (self.stderr.strip().splitlines() or [""])[-1]

    @property
    def traceback(self) -> bool:
        return "Traceback" in self.stderr

    def __str__(self) -> str:
        return f"exit {self.code}: {self.last[:150]}"


def run_process(cmd: list[str], cwd: Path) -> Outcome:
    env = {**os.environ, "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu")}
    p = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    return Outcome(p.returncode, p.stderr)


def _damage(step_dir: Path, how: str) -> None:
    """Removes the step's manifest, then flips 16 bytes of its largest file or cuts it in half."""
    (step_dir / checksums.MANIFEST).unlink()
    f = max((p for p in step_dir.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    data = bytearray(f.read_bytes())
    mid = len(data) // 2
    data = (
        data[:mid]
        if how == "truncate"
        else data[:mid] + bytes(b ^ 0xFF for b in data[mid : mid + 16]) + data[mid + 16 :]
    )
    f.write_bytes(bytes(data))


def _mount(*args: str) -> None:
    p = subprocess.run(["mount", *args], capture_output=True, text=True)
    if p.returncode:
        raise CannotRun(f"mount {' '.join(args)}: {p.stderr.strip() or 'refused'} (needs root)")


class Cases:
    """`train(run_dir, steps, *overrides)` builds a train.py command; `finished` is a tiny run that
    saved steps 10 and 20; `workdir` holds the copies."""

    def __init__(self, train: Callable[..., list[str]], finished: Path, workdir: Path, root: Path):
        self.train, self.finished, self.workdir, self.root = train, finished, workdir, root

    def _copy(self, name: str) -> Path:
        dest = self.workdir / name
        shutil.copytree(self.finished, dest)
        return dest

    def manifest_flip(self) -> tuple[str, Outcome, bool]:
        run = self._copy("no-manifest-flip")
        _damage(run / "checkpoints" / "20", "flip")
        out = run_process(self.train(run, 30), self.root)
        said = "checkpoint step 20 cannot be verified" in out.stderr and "resumed from step 10" in out.stderr
        ok = out.code == 0 and said and not out.traceback
        return "exit 0; step 20 set aside, resumed from step 10", out, ok

    def manifest_truncate_eval(self) -> tuple[str, Outcome, bool]:
        run = self._copy("no-manifest-truncate")
        _damage(run / "checkpoints" / "20", "truncate")
        out = run_process(
            [sys.executable, "-m", "eval", "lm-loss", "--run", str(run), "--step", "20"], self.root
        )
        ok = out.code == 2 and "MissingManifest" in out.last and not out.traceback
        return "exit 2: step 20 cannot be restored: MissingManifest", out, ok

    def _step_bytes(self) -> int:
        return sum(p.stat().st_size for p in (self.finished / "checkpoints" / "20").rglob("*") if p.is_file())

    def full_disk(self) -> tuple[str, Outcome, bool]:
        disk = self.workdir / "full-disk"
        disk.mkdir()
        _mount("-t", "tmpfs", "-o", f"size={int(self._step_bytes() * 1.5)}", "tmpfs", str(disk))
        try:
            out = run_process(self.train(disk / "run", 20), self.root)
            partial = [p.name for p in (disk / "run" / "checkpoints").iterdir()]
        finally:
            subprocess.run(["umount", str(disk)], check=False)
        ok = out.code == 3 and "(ENOSPC)" in out.last and partial == ["10"] and not out.traceback
        return "exit 3: no space (ENOSPC), last good step 10, nothing partial", out, ok

    def read_only(self) -> tuple[str, Outcome, bool]:
        run = self._copy("read-only")
        ckpts = str(run / "checkpoints")
        _mount("--bind", ckpts, ckpts)
        try:
            _mount("-o", "remount,ro,bind", ckpts)
            out = run_process(self.train(run, 30), self.root)
        finally:
            subprocess.run(["umount", ckpts], check=False)
        ok = out.code == 3 and "Read-only file system (EROFS)" in out.last and not out.traceback
        return "exit 3: read-only (EROFS), within seconds", out, ok

    def oversized(self) -> tuple[str, Outcome, bool]:
        run = self.workdir / "oversized"
        out = run_process(self.train(run, 20, "data.seq_len=100000"), self.root)
        ok = out.code == 2 and out.last.startswith("memory error: the train step needs") and not run.exists()
        return "exit 2: memory error with the knobs, no run directory", out, ok

    def latin1_config(self) -> tuple[str, Outcome, bool]:
        config = self.workdir / "latin1.yaml"
        config.write_bytes("# caf\xe9\nmodel:\n  d_model: 32\n".encode("latin-1"))
        cmd = self.train(self.workdir / "latin1", 20)
        at = cmd.index("--config")
        out = run_process([*cmd[: at + 1], str(config), *cmd[at + 2 :]], self.root)
        ok = out.code == 2 and "not UTF-8 text (byte 0xe9" in out.last and not out.traceback
        return "exit 2: not UTF-8 text", out, ok

    def corrupt_shard(self) -> tuple[str, Outcome, bool]:
        texts = self.workdir / "texts"
        for split, n in (("train", 40), ("val", 4)):
            (texts / split).mkdir(parents=True)
            for i in range(n):
                words = " ".join(f"word{(i * 7 + j) % 97}" for j in range(400))
                (texts / split / f"doc{i}.txt").write_text(words + "\n")
        prepared = self.workdir / "prepared"
        prepare = [sys.executable, "-m", "effattn_jax.data.prepare", "--input", f"{texts}/train/*.txt"]
        prepare += ["--val-input", f"{texts}/val/*.txt", "--out", str(prepared), "--workers", "0"]
        p = subprocess.run(prepare, cwd=self.root, capture_output=True, text=True, timeout=300)
        if p.returncode:
            raise CannotRun(f"prepare failed: {p.stderr.strip().splitlines()[-1:]}")
        for shard in prepared.glob("train-*.arrayrecord"):
            data = bytearray(shard.read_bytes())
            mid = len(data) // 2
            data[mid : mid + 8] = bytes(b ^ 0xFF for b in data[mid : mid + 8])
            shard.write_bytes(bytes(data))
        overrides = ("data.source=prepared", f"data.path={prepared}", "data.seq_len=64")
        out = run_process(self.train(self.workdir / "shard", 40, *overrides), self.root)
        ok = out.code == 2 and ": record " in out.last and "is corrupt" in out.last and not out.traceback
        return "exit 2: the shard file and record named", out, ok

    def all(self) -> list[tuple[str, Callable]]:
        return [
            ("missing manifest + flipped byte (train)", self.manifest_flip),
            ("missing manifest + truncation (eval lm-loss)", self.manifest_truncate_eval),
            ("checkpoint directory full", self.full_disk),
            ("checkpoint directory read-only", self.read_only),
            ("run too large for memory", self.oversized),
            ("Latin-1 config", self.latin1_config),
            ("corrupt prepared shard", self.corrupt_shard),
        ]


def run_cases(cases: Cases) -> list[dict]:
    """Prints the table as it goes; returns its rows {case, expected, observed, pass} (pass None:
    the case cannot run here)."""
    print("| case | expected | observed | pass |\n|---|---|---|---|", flush=True)
    rows = []
    for name, case in cases.all():
        try:
            expected, out, ok = case()
        except CannotRun as e:
            rows.append({"case": name, "expected": None, "observed": f"not run: {e}", "pass": None})
            print(f"| {name} | — | not run: {e} | — |", flush=True)
            continue
        rows.append({"case": name, "expected": expected, "observed": str(out), "pass": bool(ok)})
        print(f"| {name} | {expected} | {out} | {'yes' if ok else 'NO'} |", flush=True)
    return rows
