"""Checksum manifests of checkpoint steps. A manifest (sha256 and size of every file of a step) is
written last, once the step's save is complete, and verified before the step is restored, so a
flipped, truncated or missing file is found before anything is loaded. A step without a manifest
is never restored: nothing says its files are whole."""

from __future__ import annotations

import json

from effattn_jax import storage
from effattn_jax.storage import AnyPath

MANIFEST = "checksums.json"


class ChecksumError(RuntimeError):
    """A step's files do not match its manifest."""


class MissingManifest(ChecksumError):
    """A step without a manifest: a save cut short before its manifest, or a removed manifest.
    Nothing vouches for its files, so it is never restored."""


def _files(step_dir: AnyPath) -> list[AnyPath]:
    return [p for p in storage.files_under(step_dir) if p.name != MANIFEST]


def _relative(p: AnyPath, step_dir: AnyPath) -> str:
    return str(p)[len(str(step_dir)) + 1 :]


def write_manifest(step_dir: AnyPath) -> None:
    """{relative path: [size, sha256]} of the step's files (each read once), written atomically."""
    entries = {_relative(p, step_dir): list(storage.size_and_sha256(p)) for p in _files(step_dir)}
    storage.write_atomic(step_dir / MANIFEST, json.dumps(entries, indent=0, sort_keys=True))


def has_manifest(step_dir: AnyPath) -> bool:
    return (step_dir / MANIFEST).is_file()


def verify(step_dir: AnyPath) -> None:
    """Raises ChecksumError naming the first file that differs from the step's manifest, and
    MissingManifest when the step has none (it cannot be verified, so it is not used)."""
    try:
        text = storage.read_text(step_dir / MANIFEST)
    except FileNotFoundError:
        why = "the save did not complete or the manifest was removed"
        raise MissingManifest(f"no {MANIFEST}: {why}") from None
    try:
        entries = json.loads(text)
    except ValueError:
        raise ChecksumError(f"{step_dir / MANIFEST} is unreadable") from None
    present = {_relative(p, step_dir) for p in _files(step_dir)}
    extra = sorted(present - set(entries))
    if extra:
        raise ChecksumError(f"{extra[0]} is not in the manifest")
    for name, (size, digest) in sorted(entries.items()):
        if name not in present:
            raise ChecksumError(f"{name} is missing")
        got_size, got_digest = storage.size_and_sha256(step_dir / name)  # each file read once
        if got_size != size:
            raise ChecksumError(f"{name} has {got_size} bytes, {size} were saved")
        if got_digest != digest:
            raise ChecksumError(f"{name} does not match its checksum")
