"""The MoBA XLA path (gate included) of this tree against another checkout's, in one run.

    python -m eval.bench.routing [--baseline DIR] [--seq 16384] [--repeats 3] [--json]

Forward + backward of `moba_attention(impl="xla")` (batch 1, 4 heads, head dim 64, block 512,
top_k 3, float32, random inputs), once with one document per row and once with two packed
documents. With `--baseline DIR` (a checkout of another revision, e.g. `git worktree add DIR
REV`), each measurement runs in a fresh process with that tree's `effattn_jax` or this one's,
the two alternating `--repeats` times (eval/timing.py); medians, and the largest difference of
outputs and gradients between the trees. Nothing is patched: each process imports its own tree.
`--json` prints a list of rows {case, seq, this_tree_ms, and with --baseline: baseline_ms, ratio,
max_abs_difference}.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
CASES = ("one document", "two packed documents")


def measure(seq: int, case: str, out: str) -> float:
    """Milliseconds of one compiled forward + backward (after a warm-up); saves the outputs."""
    import jax
    import jax.numpy as jnp

    from effattn_jax.ops.moba import moba_attention  # the tree on sys.path: this one or the baseline

    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.standard_normal((1, seq, 4, 64)), jnp.float32) for _ in range(3))
    seg = None
    if case == CASES[1]:
        seg = jnp.asarray(np.repeat([1, 2], [seq // 2 + 300, seq // 2 - 300])[None], jnp.int32)
    loss = lambda q, k, v: moba_attention(q, k, v, block_size=512, top_k=3, impl="xla", segment_ids=seg).sum()
    f = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
    jax.block_until_ready(f(q, k, v))
    start = time.perf_counter()
    result = jax.block_until_ready(f(q, k, v))
    ms = (time.perf_counter() - start) * 1e3
    np.savez(out, *[np.asarray(x) for x in jax.tree.leaves(result)])
    return ms


def _run(tree: Path, seq: int, case: str, out: str) -> float:
    """`measure` in a fresh process whose `effattn_jax` is the one in `tree`."""
    code = (
        "import runpy, sys; sys.path.insert(0, sys.argv[1]); "
        "m = runpy.run_path(sys.argv[2]); print(m['measure'](int(sys.argv[3]), sys.argv[4], sys.argv[5]))"
    )
    env = {**os.environ, "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu")}
    done = subprocess.run(
        [sys.executable, "-c", code, str(tree), __file__, str(seq), case, out],
        cwd=tree, env=env, capture_output=True, text=True, check=True,
    )  # fmt: skip
    return float(done.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    from effattn_jax.cli import positive_int  # here, not above: `measure` runs this file in other trees
    from eval.bench import common
    from eval.timing import alternated

    p = common.parser(__doc__, __file__)
    p.add_argument("--baseline", type=Path, help="a checkout of the revision to compare against")
    p.add_argument("--seq", type=positive_int, default=16384)
    p.add_argument("--repeats", type=positive_int, default=3)
    args = p.parse_args(argv)
    trees = {"this tree": ROOT} | ({"baseline": args.baseline.resolve()} if args.baseline else {})
    rows = []
    with common.report(args, f"MoBA xla fwd+bwd at {args.seq}") as emit, tempfile.TemporaryDirectory() as tmp:
        for case in CASES:
            runs = {
                label: partial(_run, tree, args.seq, case, f"{tmp}/{label[0]}.npz")
                for label, tree in trees.items()
            }
            ms = alternated(runs, args.repeats, warmup=0)  # each run warms up in its own process
            row = {"case": case, "seq": args.seq} | {
                f"{label.replace(' ', '_')}_ms": ms[label] for label in trees
            }
            if args.baseline:
                a, b = (np.load(f"{tmp}/{label[0]}.npz") for label in trees)
                row["ratio"] = row["this_tree_ms"] / row["baseline_ms"]
                row["max_abs_difference"] = max(float(np.abs(a[n] - b[n]).max()) for n in a.files)
            rows.append(row)
            print(", ".join(f"{k} {v:,.4g}" if isinstance(v, float) else f"{v}" for k, v in row.items()))
        emit(rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
