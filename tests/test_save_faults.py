"""Checkpoints that cannot be written: an injected OS error at the write, and (where this machine
lets the test mount one) a small filesystem that really fills and a read-only checkpoint directory.
Each stops the run with one line and exit status 3, leaves no partial step, keeps the last good one,
and a rerun after the fix resumes to the uninterrupted result."""

import errno
import os
import subprocess
import sys

import orbax.checkpoint as ocp
import pytest
from conftest import ROOT, tiny_overrides

from effattn_jax import checkpoint, checksums
from effattn_jax.config import load_config
from effattn_jax.train.loop import run

pytestmark = pytest.mark.slow  # training runs


def _cfg(corpus_dir, run_dir, **extra):
    return load_config(None, tiny_overrides(corpus_dir, run_dir, **extra))


def _entries(run_dir):
    return sorted(p.name for p in (run_dir / "checkpoints").iterdir())


def test_injected_write_errors_stop_cleanly_and_resume(tmp_path, corpus_dir, monkeypatch, capsys):
    """ENOSPC raised by Orbax's save and EACCES at the manifest write both end in SaveError naming the
    directory, the OS error and the last good step; the partial step (Orbax's temporary directory, a
    step committed without its manifest) is removed; the rerun ends where an uninterrupted run ends.
    Catches: a write error reported as a traceback or as a non-finite stop, a partial step left
    filling the disk, a step without a manifest kept, a failed save that loses the good step."""
    reference = run(_cfg(corpus_dir, tmp_path / "reference"))
    run_dir = tmp_path / "run"
    save = ocp.CheckpointManager.save

    def full_disk(self, step, *args, **kwargs):
        if step == 4:  # Orbax has started the step when the disk runs out
            partial = run_dir / "checkpoints" / "4.orbax-checkpoint-tmp-1"
            partial.mkdir()
            (partial / "array").write_bytes(b"x" * 1000)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return save(self, step, *args, **kwargs)

    monkeypatch.setattr(ocp.CheckpointManager, "save", full_disk)
    with pytest.raises(checkpoint.SaveError) as failed:
        run(_cfg(corpus_dir, run_dir))
    assert "cannot save step 4 in" in str(failed.value) and "No space left on device (ENOSPC)" in str(
        failed.value
    )
    assert "the last good step is 2" in str(failed.value)
    assert _entries(run_dir) == ["2"] and checksums.has_manifest(run_dir / "checkpoints" / "2")
    monkeypatch.setattr(ocp.CheckpointManager, "save", save)

    write_manifest = checksums.write_manifest

    def no_permission(step_dir):
        if step_dir.name == "4":
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(step_dir / "checksums.json"))
        write_manifest(step_dir)

    monkeypatch.setattr(checksums, "write_manifest", no_permission)
    with pytest.raises(checkpoint.SaveError, match=r"Permission denied \(EACCES\); the last good step is 2"):
        run(_cfg(corpus_dir, run_dir, **{"checkpoint.async_save": True}))
    assert _entries(run_dir) == ["2"]  # step 4 was committed by Orbax but never checksummed: removed
    monkeypatch.setattr(checksums, "write_manifest", write_manifest)
    assert "Traceback" not in capsys.readouterr().err

    resumed = run(_cfg(corpus_dir, run_dir))
    assert "resumed from step 2" in capsys.readouterr().err
    assert resumed["val_loss"] == reference["val_loss"]


def _can_mount(where) -> bool:
    where.mkdir()
    ok = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(where)], capture_output=True)
    if ok.returncode == 0:
        subprocess.run(["umount", str(where)], check=True)
    return ok.returncode == 0


def _train(corpus_dir, run_dir):
    cmd = [sys.executable, str(ROOT / "train.py"), *tiny_overrides(corpus_dir, run_dir)]
    return subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=300)


def test_real_full_and_read_only_filesystems(tmp_path, corpus_dir):
    """A tmpfs that holds one step but not two: train.py exits 3 with one line (the free and the
    needed bytes), nothing partial on the disk; after the filesystem grows, the rerun resumes and ends
    where the uninterrupted run ends. A read-only checkpoint directory: exit 3 within a minute naming
    EROFS. Catches: Orbax's minutes of retries and hundreds of lines of tracebacks, exit status 1."""
    disk = tmp_path / "disk"
    if not _can_mount(disk):
        pytest.skip("mounting a tmpfs needs root with CAP_SYS_ADMIN")
    reference = _train(corpus_dir, tmp_path / "reference")
    assert reference.returncode == 0, reference.stderr
    step_bytes = sum(p.stat().st_size for p in (tmp_path / "reference/checkpoints/6").rglob("*"))
    subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={int(step_bytes * 1.5)}", "tmpfs", str(disk)], check=True
    )
    try:
        run_dir = disk / "run"
        full = _train(corpus_dir, run_dir)
        assert full.returncode == 3, full.stderr
        last = full.stderr.strip().splitlines()[-1]
        assert last.startswith("checkpoint error: cannot save step 4 in") and "(ENOSPC)" in last, full.stderr
        assert "the last good step is 2" in last and "Traceback" not in full.stderr
        assert _entries(run_dir) == ["2"]
        subprocess.run(["mount", "-o", f"remount,size={step_bytes * 4}", str(disk)], check=True)
        again = _train(corpus_dir, run_dir)
        assert again.returncode == 0 and "resumed from step 2" in again.stderr, again.stderr
        final = [r.stdout.strip().splitlines()[-1].split()[0] for r in (again, reference)]
        assert final[0] == final[1]  # val_loss=…, as printed

        ckpts = str(run_dir / "checkpoints")
        subprocess.run(["mount", "--bind", ckpts, ckpts], check=True)
        try:
            subprocess.run(["mount", "-o", "remount,ro,bind", ckpts], check=True)
            read_only = _train(corpus_dir, run_dir)
        finally:
            subprocess.run(["umount", ckpts], check=True)
        assert read_only.returncode == 3
        assert read_only.stderr.strip().splitlines()[-1] == (
            f"checkpoint error: {ckpts} cannot be written: Read-only file system (EROFS)"
        )
    finally:
        subprocess.run(["umount", str(disk)], check=True)
