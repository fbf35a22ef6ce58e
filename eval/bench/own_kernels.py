"""The GPU suite's own_kernels section: MoBA's own-block kernels on Mosaic GPU (pallas_kernels/moba/
mgpu_own.py) against the Pallas Triton ones they replace on Hopper (gpu_own.py), both compiled, at
the attention section's shape (16 heads of 128, bf16, MoBA block 512, block-local own blocks):
how far apart their outputs and gradients are (o, lse, dq, dK, dV, each relative to its largest
entry) and the ms of each one's forward and backward (dq + dK/dV) kernels, at 8K and 128K.

A GPU before Hopper (Mosaic GPU's wgmma and TMA need sm_90a) or a
configuration `mgpu_own.supports` refuses gets a row saying so. The dry plan runs both interpreted
on a CPU at tiny shapes. Alone (one short device check, no suite around it):

    python -m eval.bench.own_kernels [--dry] [--seqs 8192 131072] [--json]

`--json` prints the rows (one per length, the suite section's) as a JSON list on stdout; the exit
status is 1 when a row is not ok.
"""

from __future__ import annotations

import json
import time

import jax
import jax.numpy as jnp

from eval.bench import common
from eval.bench.gpu_checks import relative_difference
from eval.timing import alternated, seconds
from pallas_kernels import gpu_dispatch
from pallas_kernels.moba import gpu_own, mgpu_own
from pallas_kernels.moba.schedule import BlockSizes

TILES = BlockSizes(q_tile=64, kv_block=64, past_q_tile=64, num_warps=4, num_stages=2)  # GPU_TILES[0]
FULL = dict(
    seqs=[8192, 131072], heads=16, kv_heads=16, head_dim=128, block=512, tiles=TILES, repeats=3, tol=3e-2
)
DRY = dict(
    seqs=[256], heads=2, kv_heads=1, head_dim=64, block=64, tiles=TILES, repeats=1, tol=3e-2, interpret=True
)


def _inputs(seq, heads, kv_heads, head_dim):
    """Head-major q, k, v, dO [rows, S, D], bf16, random (batch 1)."""
    keys = jax.random.split(jax.random.key(seq), 4)
    rows = lambda key, h: jax.random.normal(key, (h, seq, head_dim), jnp.bfloat16)
    q, k, v, do = rows(keys[0], heads), rows(keys[1], kv_heads), rows(keys[2], kv_heads), rows(keys[3], heads)
    return q, k, v, do


def own_case(*, seq, heads, kv_heads, head_dim, block, tiles, repeats, interpret=False, **_) -> dict:
    """One length: the two kernel sets' largest relative differences and ms (forward, backward)."""
    row = {
        "seq": seq,
        "heads": heads,
        "head_dim": head_dim,
        "block": block,
        "tiles": tiles.tiles_text(),
        "stages": tiles.num_stages,
    }
    if not interpret and not (cap := gpu_dispatch.capability()).startswith("9."):
        return row | {"skipped": f"Mosaic GPU kernels need a Hopper GPU, not compute capability {cap}"}
    reason = mgpu_own.supports(
        head_dim=head_dim, v_head_dim=head_dim, dtype=jnp.bfloat16, block_sizes=tiles, block_size=block
    )
    if reason:
        return row | {"skipped": reason}
    q, k, v, do = _inputs(seq, heads, kv_heads, head_dim)
    own_start = (jnp.arange(seq, dtype=jnp.int32) // block * block)[None]
    lo, first, q_end = gpu_own.own_tables(
        own_start, seq_pad=seq, q_tile=tiles.q_tile, kv_block=tiles.kv_block
    )
    kw = dict(scale=head_dim**-0.5, block_size=block, block_sizes=tiles, interpret=interpret)
    fns = {}
    for name, module in (("triton", gpu_own), ("mosaic", mgpu_own)):
        fns[name] = (
            jax.jit(lambda q, k, v, m=module: m.own_attention_fwd(q, k, v, lo, first, **kw)),
            jax.jit(lambda *a, m=module: m.own_attention_bwd(*a, **kw)),
        )
    results, timed = {}, {}
    for name, (fwd, bwd) in fns.items():
        o, lse = fwd(q, k, v)
        delta = jnp.sum(o * do.astype(jnp.float32), axis=-1, keepdims=True)
        args = (q, k, v, lo, first, q_end, do, lse, delta)
        results[name] = (o, lse, *bwd(*args))
        timed[f"{name}_fwd_ms"] = seconds(fwd, q, k, v)
        timed[f"{name}_bwd_ms"] = seconds(bwd, *args)
    names = ("o", "lse", "dq", "dk", "dv")
    diffs = {n: relative_difference(a, b) for n, a, b in zip(names, *results.values(), strict=True)}
    ms = {key: value * 1e3 for key, value in alternated(timed, repeats).items()}
    return row | {"max_rel_diff": max(diffs.values()), "rel_diff": diffs} | ms


def section(suite, rows: list, p: dict) -> None:
    """Every length of the plan within the section's budget; a failure is recorded as the finding."""
    for seq in p["seqs"]:
        if not suite.time_left():
            suite.add(rows, {"seq": seq, "skipped": "time budget"})
            continue
        try:
            row = own_case(seq=seq, **p)
            if "max_rel_diff" in row:
                row["ok"] = row["max_rel_diff"] <= p["tol"]
        except Exception as e:  # noqa: BLE001 - a kernel that fails to compile or run is the finding
            row = {"seq": seq, "ok": False, "error": f"{type(e).__name__}: {e}".splitlines()[0][:300]}
        suite.add(rows, row)


class _Rows:
    """The suite's interface for `section` when it runs alone: every case runs, each printed."""

    time_left = staticmethod(lambda: True)

    def __init__(self):
        self.start = time.perf_counter()

    def add(self, rows: list, row: dict) -> None:
        row["at_s"] = round(time.perf_counter() - self.start, 1)
        rows.append(row)
        print("  " + json.dumps(row), flush=True)


def main(argv=None) -> int:
    p = common.parser(__doc__, __file__)
    p.add_argument("--dry", action="store_true", help="tiny shapes, both kernel sets interpreted (a CPU)")
    p.add_argument("--seqs", type=int, nargs="+", help="lengths (default: the plan's)")
    args = p.parse_args(argv)
    plan = dict(DRY if args.dry else FULL)
    plan["seqs"] = args.seqs or plan["seqs"]
    with common.report(
        args, "own-block kernels, Mosaic GPU vs Triton" + (", dry" if args.dry else "")
    ) as emit:
        rows: list = []
        section(_Rows(), rows, plan)
        emit(rows)
    return 0 if all(row.get("ok", True) for row in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
