"""Checksum manifests of checkpoint steps. A manifest (sha256 and size of every file of a step) is
written last, once the step's save is complete, and verified before the step is restored, so a
flipped, truncated or missing file is found before anything is loaded. A step without a manifest
is never restored: nothing says its files are whole."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

MANIFEST = "checksums.json"


class ChecksumError(RuntimeError):
    """A step's files do not match its manifest."""


class MissingManifest(ChecksumError):
    """A step without a manifest: a save cut short before its manifest, or a removed manifest.
    Nothing vouches for its files, so it is never restored."""


def _digest(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _files(step_dir: Path) -> list[Path]:
    return sorted(p for p in step_dir.rglob("*") if p.is_file() and p.name != MANIFEST)


def write_manifest(step_dir: Path) -> None:
    """{relative path: [size, sha256]} of the step's files, written atomically (tmp + rename)."""
    entries = {str(p.relative_to(step_dir)): [p.stat().st_size, _digest(p)] for p in _files(step_dir)}
    tmp = step_dir / f".{MANIFEST}.tmp"
    tmp.write_text(json.dumps(entries, indent=0, sort_keys=True))
    os.replace(tmp, step_dir / MANIFEST)


def has_manifest(step_dir: Path) -> bool:
    return (step_dir / MANIFEST).is_file()


def verify(step_dir: Path) -> None:
    """Raises ChecksumError naming the first file that differs from the step's manifest, and
    MissingManifest when the step has none (it cannot be verified, so it is not used)."""
    try:
        text = (step_dir / MANIFEST).read_text()
    except FileNotFoundError:
        why = "the save did not complete or the manifest was removed"
        raise MissingManifest(f"no {MANIFEST}: {why}") from None
    try:
        entries = json.loads(text)
    except ValueError:
        raise ChecksumError(f"{step_dir / MANIFEST} is unreadable") from None
    present = {str(p.relative_to(step_dir)) for p in _files(step_dir)}
    extra = sorted(present - set(entries))
    if extra:
        raise ChecksumError(f"{extra[0]} is not in the manifest")
    for name, (size, digest) in sorted(entries.items()):
        path = step_dir / name
        if name not in present:
            raise ChecksumError(f"{name} is missing")
        if path.stat().st_size != size:
            raise ChecksumError(f"{name} has {path.stat().st_size} bytes, {size} were saved")
        if _digest(path) != digest:
            raise ChecksumError(f"{name} does not match its checksum")
