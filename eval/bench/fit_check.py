"""XLA's memory estimate of a program against the resident memory it really takes on this machine:
the estimate is what the fit check (effattn_jax/memory.py) compares with the available RAM, and on
a CPU the real peak runs past it (CPU_PEAK_FACTOR there covers the ratios measured here).

    python -m eval.bench.fit_check [--seqs 1024,2048,4096,8192] [--json]

Each program runs in a fresh process: dense and MoBA attention forward+backward as
`eval.bench.attention` runs them (batch 1, 4 heads, head dim 64, block 512, top_k 3, float32),
compiled, checked to fit (a length that cannot fit is skipped), then run twice. The growth is the
peak resident memory after the runs (VmHWM) less the resident memory once the program is compiled
(VmRSS: the runtime, inputs and executable already there), both from /proc. `--json` prints a list
of rows {seq, program, estimate_bytes, growth_bytes, ratio}, or {seq, program, skipped}.
"""

from __future__ import annotations

import json
import subprocess
import sys

from effattn_jax.cli import positive_int_list
from eval.bench import common

PROGRAMS = ("dense", "moba")


def _child(seq: int, name: str) -> None:
    """One program: compiled, checked, run twice; prints its estimate and resident growth (JSON)."""
    import jax
    import jax.numpy as jnp

    from effattn_jax.memory import DoesNotFit, check_fits
    from eval.bench.attention import inputs, make_fns

    x = jax.block_until_ready(inputs(seq, 4, 64, jnp.float32))
    compiled = make_fns(512, 3, "xla")[name].lower(*x).compile()
    try:
        estimate = check_fits(compiled, jax.local_devices()[:1], f"{name} at {seq}", "a shorter --seqs")
    except DoesNotFit as e:
        print(json.dumps({"seq": seq, "program": name, "skipped": str(e)}))
        return
    compiled_kib = common.resident_kib("VmRSS")
    for _ in range(2):
        jax.block_until_ready(compiled(*x))
    growth = (common.resident_kib("VmHWM") - compiled_kib) * 1024
    print(json.dumps({"seq": seq, "program": name, "estimate_bytes": estimate, "growth_bytes": growth,
                      "ratio": growth / estimate}))  # fmt: skip


def measure(seq: int, name: str) -> dict:
    """`_child` in a fresh process (nothing else resident)."""
    cmd = [sys.executable, "-m", "eval.bench.fit_check", "--child", str(seq), name]
    done = subprocess.run(cmd, cwd=common.ROOT, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"{name} at {seq} failed (exit {done.returncode}): {done.stderr.strip()[-500:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    p = common.parser(__doc__, __file__)
    p.add_argument("--seqs", type=positive_int_list, default=[1024, 2048, 4096, 8192])
    p.add_argument("--child", nargs=2, help=common.HIDDEN)
    args = p.parse_args(argv)
    if args.child:
        _child(int(args.child[0]), args.child[1])
        return 0
    with common.report(args, "attention fwd+bwd, batch 1, 4 heads, head dim 64, float32") as emit:
        print("| seq | program | XLA estimate MiB | resident growth MiB | growth / estimate |")
        print("|---|---|---|---|---|")
        rows = []
        for seq in args.seqs:
            for name in PROGRAMS:
                r = measure(seq, name)
                rows.append(r)
                if "skipped" in r:
                    print(f"| {seq} | {name} | skipped: {r['skipped']} |||", flush=True)
                    continue
                mib = lambda b: f"{b / 2**20:,.0f}"
                print(
                    f"| {seq} | {name} | {mib(r['estimate_bytes'])} | {mib(r['growth_bytes'])} "
                    f"| {r['ratio']:.2f} |",
                    flush=True,
                )
        emit(rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
