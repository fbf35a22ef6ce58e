"""The input pipeline at scale, measured in one run: prepare throughput, the training input
pipeline's streaming throughput against the default model's consumption, and a training
process's peak resident memory on a large prepared corpus against on the built-in one.

    python -m eval.bench.data [--copies 90] [--workers 2] [--steps 30] [--repeats 10] [--root DIR]
        [--keep] [--json]

The synthetic corpus is `--copies` copies of the built-in corpus's training speeches, each copy
with every speech's paragraphs shuffled by its own seed (no two copies alike), written as one
.jsonl file per copy (90 copies: about 204M tokens with the default tokenizer). It lives under
`--root` (default: a fresh temporary directory) and is deleted afterwards unless `--keep`.
The input pipeline's rate (stream_*) is the median of `--repeats` one-second windows
(eval/timing.py), after one not kept; BENCHMARKS.md's figures of 2026-12-01 are one 10-second
window after 20 batches. A training process's tokens/s is the median of its logged rates.
`--json` prints {copies, text_gb, tokens, prepare_s, prepare_tokens_per_s, workers, shards_gb,
stream_tokens_per_s, stream_rows_per_s, sotu_peak_rss_gib, sotu_tokens_per_s, large_peak_rss_gib,
large_tokens_per_s, pipeline_over_consumption, peak_rss_large_over_sotu}.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from effattn_jax.cli import positive_int
from effattn_jax.config import load_config
from effattn_jax.data.corpus import Inputs, config_inputs
from effattn_jax.data.pipeline import train_iterator
from effattn_jax.data.prepare import prepare
from effattn_jax.train.metrics import read_scalars
from eval.bench import common
from eval.timing import alternated

CONFIG = "configs/cpu/default.yaml"


def write_corpus(root: Path, copies: int) -> Inputs:
    inputs = config_inputs(load_config(CONFIG).data)
    speeches = [d.text for _, _, d, held_out in inputs.documents() if not held_out]
    root.mkdir(parents=True, exist_ok=True)
    for c in range(copies):
        rng = np.random.default_rng(c)
        with open(root / f"copy{c:03d}.jsonl", "w") as f:
            for text in speeches:
                paragraphs = text.split("\n\n")
                f.write(json.dumps({"text": "\n\n".join(rng.permutation(paragraphs))}) + "\n")
    return Inputs(tuple(sorted(root.glob("*.jsonl"))), val_fraction=0.01)


def stream_rate(manifest, rounds: int, window: float = 1.0) -> tuple[float, float]:
    """(tokens/s, rows/s) of the training iterator alone (default batch and sequence length): the
    median of `rounds` windows of `window` seconds each, after one that is not kept (it starts the
    iterator's readers)."""
    data = load_config(CONFIG).data
    from effattn_jax.data.shards import PackedRows

    it = train_iterator(
        PackedRows(manifest.stream("train"), data.seq_len), batch_size=data.batch_size, seed=0
    )

    def rows_per_s() -> float:
        batches, start = 0, time.perf_counter()
        while (elapsed := time.perf_counter() - start) < window:
            next(it)
            batches += 1
        return batches * data.batch_size / elapsed

    rows = alternated({"rows": rows_per_s}, rounds)["rows"]
    return rows * data.seq_len, rows


def peak_rss_gib(cmd: list[str]) -> float:
    """Peak resident memory (GiB) of `cmd`, a child process; SystemExit with its stderr's tail when it
    fails. Its stderr goes to a file, not a pipe: a pipe nobody reads while waiting fills (64 KiB)
    and the child blocks on it for ever."""
    with tempfile.TemporaryFile(mode="w+") as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err, text=True)
        _, status, usage = os.wait4(proc.pid, 0)
        if os.waitstatus_to_exitcode(status) != 0:
            err.seek(0)
            raise SystemExit(f"{' '.join(cmd)} failed:\n{err.read()[-2000:]}")
    return usage.ru_maxrss / 2**20


def train_process(run_dir: Path, steps: int, overrides: list[str]) -> tuple[float, float]:
    """(peak RSS GiB, median logged tokens/s) of `train.py` on the default config."""
    cmd = [sys.executable, "train.py", "--config", CONFIG, f"train.run_dir={run_dir}", f"train.steps={steps}"]
    rss = peak_rss_gib(cmd + ["train.progress=false", "train.log_every=5", *overrides])
    rates = [v for step, v in read_scalars(run_dir)["tokens_per_sec"] if step > 5]
    return rss, statistics.median(rates)


def main(argv=None) -> int:
    p = common.parser(__doc__, __file__)
    p.add_argument("--copies", type=positive_int, default=90)
    p.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    p.add_argument("--steps", type=positive_int, default=30, help="train steps per training process")
    p.add_argument("--repeats", type=positive_int, default=10, help="1-second windows of the input pipeline")
    p.add_argument("--root", type=Path, default=None)
    p.add_argument("--keep", action="store_true")
    args = p.parse_args(argv)
    root = args.root or Path(tempfile.mkdtemp(prefix="effattn-bench-data-"))
    try:
        with common.report(args, f"{args.copies} copies, {args.workers} workers") as emit:
            emit(measure(args, root))
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    return 0


def measure(args, root: Path) -> dict:
    """Every figure, printed as it is known; the dict --json prints."""
    out = {"copies": args.copies, "workers": args.workers}
    t = time.perf_counter()
    inputs = write_corpus(root / "text", args.copies)
    out["text_gb"] = sum(f.stat().st_size for f in inputs.files) / 1e9
    print(
        f"synthetic corpus: {args.copies} copies, {out['text_gb']:.2f} GB of jsonl "
        f"({time.perf_counter() - t:.0f} s)"
    )

    t = time.perf_counter()
    manifest = prepare(
        inputs, root / "prepared", tokenizer=load_config(CONFIG).data.tokenizer, workers=args.workers
    )
    seconds = out["prepare_s"] = time.perf_counter() - t
    tokens = out["tokens"] = manifest.data["train"]["tokens"] + manifest.data["val"]["tokens"]
    out["prepare_tokens_per_s"] = tokens / seconds
    out["shards_gb"] = sum(f.stat().st_size for f in (root / "prepared").glob("*.arrayrecord")) / 1e9
    print(
        f"prepare: {tokens:,} tokens in {seconds:.0f} s with {args.workers} workers = "
        f"{tokens / seconds:,.0f} tokens/s; shards {out['shards_gb']:.2f} GB"
    )

    tok_s, rows_s = out["stream_tokens_per_s"], out["stream_rows_per_s"] = stream_rate(manifest, args.repeats)
    print(f"input pipeline alone: {tok_s:,.0f} tokens/s, {rows_s:,.0f} packed rows/s")

    rss_small, rate_small = train_process(root / "run_sotu", args.steps, [])
    big = ["data.source=prepared", f"data.path={root / 'prepared'}"]
    rss_big, rate_big = train_process(root / "run_big", args.steps, big)
    out |= {"sotu_peak_rss_gib": rss_small, "sotu_tokens_per_s": rate_small, "large_peak_rss_gib": rss_big,
            "large_tokens_per_s": rate_big, "pipeline_over_consumption": tok_s / rate_big,
            "peak_rss_large_over_sotu": rss_big / rss_small}  # fmt: skip
    print(f"train.py on SOTU: peak RSS {rss_small:.2f} GiB, {rate_small:,.0f} tokens/s consumed")
    print(
        f"train.py on {tokens / 1e6:.0f}M tokens: peak RSS {rss_big:.2f} GiB, "
        f"{rate_big:,.0f} tokens/s consumed"
    )
    print(f"input pipeline / model consumption: {tok_s / rate_big:.0f}x")
    print(f"peak RSS, large corpus / SOTU: {rss_big / rss_small:.3f}")
    return out


if __name__ == "__main__":
    main()
