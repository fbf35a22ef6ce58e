"""lm-evaluation-harness through `--model effattn` against `python -m eval downstream`, on the same
ARC-Challenge questions (every one the suite has), each command whole as a user runs it.

    JAX_PLATFORMS=cpu python -m eval.bench.harness --run runs/cpu_default [--repeats 3] [--limit K] [--json]

The two commands alternate `--repeats` times (eval/timing.py; the first of each compiles into
jax's persistent cache, as any first run does; the median is over all). Prints each time, the
medians, the ratio harness / own, and whether acc and acc_norm agree, on the last line:
`harness_s=… own_s=… ratio=… acc_equal=…`. `--json` prints {questions, harness_s, own_s, ratio,
acc_equal, own: {acc, acc_norm}, harness: {acc, acc_norm}}.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

from effattn_jax.cli import positive_int
from eval.bench import common
from eval.timing import alternated

ROOT = common.ROOT
TASKS = ROOT / "tests" / "harness_tasks"  # offline_arc_challenge.yaml


def _timed(name: str, cmd: list[str], cwd: Path) -> float:
    """Wall seconds of the whole command, printed as it ends."""
    env = os.environ | {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    start = time.perf_counter()
    p = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if p.returncode != 0:
        sys.exit(f"{' '.join(cmd[:4])} failed:\n{p.stderr[-3000:]}")
    print(f"{name}: {seconds:.1f} s", flush=True)
    return seconds


def main(argv=None) -> int:
    p = common.parser(__doc__, __file__)
    p.add_argument("--run", required=True, help="run directory")
    p.add_argument("--repeats", type=positive_int, default=3)
    p.add_argument("--limit", type=positive_int, default=None, help="a seeded subset of K questions")
    args = p.parse_args(argv)

    run = str(Path(args.run).resolve())
    limit = ["--limit", str(args.limit)] if args.limit else []
    with common.report(args, "lm-evaluation-harness against eval downstream") as emit:
        out = measure(args, run, limit)
        emit(out)
    return 0 if out["acc_equal"] else 1


def measure(args, run: str, limit: list[str]) -> dict:
    """Both commands, alternated; their times and scores (printed as they come)."""
    from eval.harness.offline import write_choice_docs

    with tempfile.TemporaryDirectory(prefix="effattn-harness-bench-") as tmp:
        work = Path(tmp)
        n = write_choice_docs("arc_challenge", work / "arc_challenge.jsonl", limit=args.limit)
        own = [sys.executable, "-m", "eval", "downstream", "--run", run, "--tasks", "arc_challenge", *limit]
        own += ["--json", str(work / "own.json")]
        harness = [sys.executable, "-m", "eval.harness", "--model", "effattn", "--model_args", f"run={run}"]
        harness += ["--tasks", "offline_arc_challenge", "--include_path", str(TASKS)]
        harness += ["--output_path", str(work / "harness")]
        print(f"ARC-Challenge, {n} questions; run {run}", flush=True)
        runs = {name: partial(_timed, name, cmd, work) for name, cmd in (("own", own), ("harness", harness))}
        s = alternated(runs, args.repeats, warmup=0)
        ours = json.loads((work / "own.json").read_text())["tasks"][0]
        results = max((work / "harness").rglob("results_*.json"))  # one per run, timestamped
        theirs = json.loads(results.read_text())["results"]["offline_arc_challenge"]
    equal = all(abs(theirs[f"{m},none"] - ours[m]) < 1e-12 for m in ("acc", "acc_norm"))
    print(
        f"acc {ours['acc']:.4f} / {theirs['acc,none']:.4f}, acc_norm {ours['acc_norm']:.4f} / "
        f"{theirs['acc_norm,none']:.4f} (own / harness)"
    )
    h, o = s["harness"], s["own"]
    print(f"harness_s={h:.1f} own_s={o:.1f} ratio={h / o:.2f} acc_equal={equal}")
    return {"questions": n, "harness_s": h, "own_s": o, "ratio": h / o, "acc_equal": equal,
            "own": {m: ours[m] for m in ("acc", "acc_norm")},
            "harness": {m: theirs[f"{m},none"] for m in ("acc", "acc_norm")}}  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
