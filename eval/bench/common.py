"""What every benchmark script shares: its argument parser (one-line errors, the module docstring
as help, `--json`), the frame of its output (the platform line first; under --json one JSON value
alone on stdout) and synthetic training batches. The timer is eval/timing.py (eval/decoding.py
uses it too); the memory figure is effattn_jax/memory.py's `program_bytes`."""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path

import numpy as np

from effattn_jax.cli import ArgumentParser
from eval.processes import platform_line

ROOT = Path(__file__).resolve().parents[2]
HIDDEN = argparse.SUPPRESS  # the help of an option a script passes to its own child process


def add_json(p) -> None:
    """`--json` on a parser or subparser: the keys are the ones the script's docstring names."""
    p.add_argument("--json", action="store_true", help="print one JSON value (keys: see above) on stdout")


def parser(doc: str, file: str, *, json: bool = True) -> ArgumentParser:
    """The parser of the script in `file` (its `__file__`), `python -m eval.bench.<name>` in usage;
    `json=False` where its subcommands take `--json` (`add_json`: a subcommand's default would
    override the value given before it)."""
    module = ".".join(Path(file).resolve().relative_to(ROOT).with_suffix("").parts)
    p = ArgumentParser(prog=f"python -m {module}", description=doc)
    if json:
        add_json(p)
    return p


@contextlib.contextmanager
def report(args, about: str = ""):
    """The frame of a script's output: the platform line with `about` (what is measured), then what
    the body prints. Under --json all of that goes to stderr and stdout holds only the JSON of the
    value the body passes to the yielded `emit` (without --json, `emit` prints nothing)."""
    stdout, as_json = sys.stdout, getattr(args, "json", False)
    lines = sys.stderr if as_json else stdout
    print(platform_line() + (f"; {about}" if about else ""), file=lines, flush=True)

    def emit(value) -> None:
        if as_json:
            print(json.dumps(value), file=stdout, flush=True)

    with contextlib.redirect_stdout(lines):
        yield emit


def synthetic_batch(batch: int, seq: int, vocab: int = 50_000, seed: int = 0) -> dict[str, np.ndarray]:
    """A training batch of random tokens, one document per row, every target trained."""
    rng = np.random.default_rng(seed)
    return {
        "inputs": rng.integers(0, vocab, (batch, seq), dtype=np.int32),
        "targets": rng.integers(0, vocab, (batch, seq), dtype=np.int32),
        "segment_ids": np.ones((batch, seq), np.int32),
        "loss_mask": np.ones((batch, seq), np.float32),
    }


def resident_kib(field: str) -> int:
    """VmRSS (resident now) or VmHWM (its peak) of this process, from /proc: unlike ru_maxrss, not
    carried over from the parent across exec."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")
