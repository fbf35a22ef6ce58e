"""The GPU suite's `routing` section (eval/bench/gpu_suite.py): MoBA's gate through its Pallas kernel
against the XLA gate, its floor and the MoBA forward it is part of.

At each length (bf16, batch 1, 16 heads of 128, block 512, top_k 3, block-local inputs as in the
attention section), alternated (eval/timing.py): `moba_routing` with the kernel the Pallas forward
runs on this GPU once verified (block means, tables and the kernel: what the forward pays; on Hopper
the Mosaic GPU one, with the Triton one by name beside it), `moba_routing` in XLA, and the
MoBA forward with the Pallas kernels (its routing included). The floor is not timed: it is the
bytes the gate must move (q and the block means read once, the picks written once) at the rate of
a device-to-device copy (eval/decoding.py `copy_bandwidth`, bytes read + written per second). A
program that fails to compile or run leaves its error in the row and the others are timed. Rows: ms
of each, the kernel's and XLA's ratio to the floor, the kernel's share of the forward, and whether
each kernel's picks equal XLA's on the device (with the fraction of slots that differ: float32 sums
in another order can part near-ties).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from effattn_jax.ops.moba import moba_attention
from effattn_jax.ops.platform import resolve_impl
from effattn_jax.ops.routing import moba_routing
from eval.bench.attention import structured_inputs
from eval.decoding import copy_bandwidth
from eval.timing import alternated, seconds
from pallas_kernels.gpu_dispatch import capability

FULL = dict(seqs=[32768, 131072], heads=16, head_dim=128, block=512, top_k=3, impl="pallas_gpu",
            repeats=5, copy_gib=1.0)  # fmt: skip
DRY = dict(seqs=[256], heads=2, head_dim=64, block=32, top_k=3, impl="pallas_gpu", repeats=1, copy_gib=0.01)


def floor_bytes(seq: int, heads: int, head_dim: int, block: int, top_k: int, itemsize: int) -> int:
    """Bytes the gate cannot avoid: q and the block means read once, the picks (int32) written once."""
    picks = min(top_k - 1, -(-seq // block) - 1)
    return (seq * heads * head_dim + (seq // block) * heads * head_dim) * itemsize + seq * heads * picks * 4


def routing_rows(p: dict, time_left, add, error) -> None:
    """One row per length of `p["seqs"]` through `add(row)`; `time_left()` false skips the rest;
    `error(e)` is the one line a failure leaves in its row."""
    _, kernel, interpret = resolve_impl(p["impl"])
    gate = lambda kernel: jax.jit(
        lambda q, k: (
            moba_routing(
                q, k, block_size=p["block"], top_k=p["top_k"], kernel=kernel, interpret=interpret
            ).past_start
        )
    )
    forward = jax.jit(
        lambda q, k, v: moba_attention(q, k, v, block_size=p["block"], top_k=p["top_k"], impl=p["impl"])
    )
    # the kernel the dispatch takes once verified (gpu_dispatch.py): Mosaic GPU on Hopper, else Triton;
    # each GPU kernel is timed by name whether the table lists it yet or not
    runs = "tpu" if kernel == "tpu" else ("mosaic" if capability().startswith("9.") else "triton")
    fns = {"routing_kernel": gate("tpu" if runs == "tpu" else f"gpu_{runs}"), "routing_xla": gate(None)}
    if runs == "mosaic":
        fns["routing_triton"] = gate("gpu_triton")
    copy = copy_bandwidth(p["copy_gib"])
    for seq in p["seqs"]:
        row = {
            "seq": seq,
            "heads": p["heads"],
            "head_dim": p["head_dim"],
            "block": p["block"],
            "top_k": p["top_k"],
            "routing_kernel_is": runs,  # the Mosaic GPU kernel where the shapes fit it (bf16, D 64k)
        }
        if not time_left():
            add(row | {"skipped": "time budget"})
            continue
        q, k, v = structured_inputs(seq, p["heads"], p["head_dim"], jnp.bfloat16)
        contenders, picks = {}, {}
        for name, fn in [*fns.items(), ("moba_forward", forward)]:
            args = (q, k, v) if name == "moba_forward" else (q, k)
            try:  # compiled and run once alone; out of memory or a failed compile is the finding
                out = jax.block_until_ready(fn(*args))
            except Exception as e:  # noqa: BLE001
                row[f"{name}_error"] = error(e)
                continue
            contenders[name] = seconds(fn, *args)
            if name != "moba_forward":
                picks[name] = out
        ms = {name: t * 1e3 for name, t in alternated(contenders, p["repeats"]).items()}
        row |= {f"{name}_ms": t for name, t in ms.items()}
        if not {"routing_kernel", "routing_xla", "moba_forward"} <= set(ms):
            add(row)
            continue
        want = picks.pop("routing_xla")
        differ = {name: float(jnp.mean((got != want).astype(jnp.float32))) for name, got in picks.items()}
        floor_ms = floor_bytes(seq, p["heads"], p["head_dim"], p["block"], p["top_k"], 2) / copy * 1e3
        row |= {
            "floor_ms": floor_ms,
            "floor_from": "bytes (q, means, picks) / device copy rate",
            "kernel_over_floor": ms["routing_kernel"] / floor_ms,
            "xla_over_floor": ms["routing_xla"] / floor_ms,
            "kernel_share_of_forward": ms["routing_kernel"] / ms["moba_forward"],
            "picks_equal": all(x == 0.0 for x in differ.values()),
            "picks_differing_fraction": differ,  # of each kernel's slots, against XLA's
        }
        add(row)
