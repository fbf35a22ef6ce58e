"""The MoBA gate of this tree against the one of an earlier git revision, inside the XLA path.

    python -m eval.bench_routing --baseline-rev 1441b68 [--seq 16384] [--repeats 3]

Forward + backward of `moba_attention(impl="xla")` (batch 1, 4 heads, head dim 64, block 512,
top_k 3, float32, random inputs), once with one document per row and once with two packed
documents; the baseline revision's `effattn_jax/ops/routing.py` is read with `git show` and
patched in. Alternating runs, medians; also the largest difference of outputs and gradients.
"""

from __future__ import annotations

import statistics
import subprocess
import time
import types

import jax
import jax.numpy as jnp
import numpy as np

import effattn_jax.ops.moba as moba_op
from effattn_jax.cli import ArgumentParser, positive_int


def baseline_routing(rev: str):
    src = subprocess.run(
        ["git", "show", f"{rev}:effattn_jax/ops/routing.py"], capture_output=True, text=True, check=True
    ).stdout
    module = types.ModuleType("baseline_routing")
    exec(compile(src, f"{rev}:effattn_jax/ops/routing.py", "exec"), module.__dict__)  # noqa: S102
    return module.moba_routing


def main(argv=None) -> int:
    p = ArgumentParser(prog="python -m eval.bench_routing", description=__doc__)
    p.add_argument("--baseline-rev", required=True, help="git revision whose routing is the baseline")
    p.add_argument("--seq", type=positive_int, default=16384)
    p.add_argument("--repeats", type=positive_int, default=3)
    args = p.parse_args(argv)
    routings = {"baseline": baseline_routing(args.baseline_rev), "this tree": moba_op.moba_routing}
    s = args.seq
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.standard_normal((1, s, 4, 64)), jnp.float32) for _ in range(3))
    packed = jnp.asarray(np.repeat([1, 2], [s // 2 + 300, s // 2 - 300])[None], jnp.int32)
    for name, segments in (("one document", None), ("two packed documents", packed)):
        fns = {}
        for label, routing in routings.items():
            moba_op.moba_routing = routing  # read when the function is traced, just below
            loss = lambda q, k, v, seg=segments: moba_op.moba_attention(
                q, k, v, block_size=512, top_k=3, impl="xla", segment_ids=seg
            ).sum()
            fns[label] = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
            jax.block_until_ready(fns[label](q, k, v))
        a, b = (jax.tree.leaves(f(q, k, v)) for f in fns.values())
        diff = max(float(jnp.abs(x - y).max()) for x, y in zip(a, b, strict=True))
        times = {label: [] for label in fns}
        for _ in range(args.repeats):
            for label, f in fns.items():
                start = time.perf_counter()
                jax.block_until_ready(f(q, k, v))
                times[label].append(time.perf_counter() - start)
        ms = {label: statistics.median(t) * 1000 for label, t in times.items()}
        print(
            f"{name}: baseline {ms['baseline']:,.0f} ms, this tree {ms['this tree']:,.0f} ms, "
            f"ratio {ms['this tree'] / ms['baseline']:.2f}; max |difference| {diff:g}",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
