"""The selected blocks' kernels alone: the Mosaic GPU ones (pallas_kernels/moba/mgpu_blocks.py, for
Hopper) against the Triton ones they replace there (gpu_blocks.py), on the same tiles of a real
schedule (block-local routing, bf16): their results compared (largest difference relative to the
Triton result's largest value: o, lse, dq, and dK/dV read through each kernel's window), then the
forward and the backward of each timed, taking turns. The GPU suite's "block_kernels" section; its
dry plan interprets both kernels on tiny shapes (a CPU check, no timing claims)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from effattn_jax.ops.routing import moba_routing
from eval.bench.attention import structured_inputs
from eval.timing import alternated, seconds
from pallas_kernels.moba import gpu_blocks, mgpu_blocks
from pallas_kernels.moba.parts import KernelCall, gather_rows, layout, past_schedule
from pallas_kernels.moba.schedule import BlockSizes

FULL = dict(seqs=[8192, 131072], heads=16, head_dim=128, block=512, top_k=3, tiles=BlockSizes(), repeats=3)
DRY = dict(
    seqs=[256],
    heads=2,
    head_dim=64,
    block=64,
    top_k=3,
    tiles=BlockSizes(q_tile=64, kv_block=64, past_q_tile=64),
    repeats=1,
)


def kernel_inputs(seq: int, p: dict, interpret: bool):
    """(forward args, backward extras, keywords, schedule) of the selected blocks' kernels for a
    batch of one at `seq` under plan `p` (the attention section's shape)."""
    q, k, v = structured_inputs(seq, p["heads"], p["head_dim"], jnp.bfloat16)
    r = moba_routing(q, k, block_size=p["block"], top_k=p["top_k"])
    call = KernelCall.fitted(
        p["tiles"],
        q,
        v,
        block_size=p["block"],
        scale=p["head_dim"] ** -0.5,
        backend="gpu",
        interpret=interpret,
    )
    q_flat, lay = layout(q, k, v, call)
    past = past_schedule(r.past_start, hkv=p["heads"], call=call)
    t = past.tiles
    real = t.rows >= 0
    do = jnp.where(real[..., None], jax.random.normal(jax.random.key(1), (*t.rows.shape, v.shape[-1])), 0)
    args = (gather_rows(q_flat, t.rows), lay.k, lay.v, t.kv_row, t.key_start, past.tile_group)
    kw = dict(call.kernel_args, num_groups=past.group_tiles.shape[0])
    return args, do.astype(q.dtype), kw, past


def _block_rows(windows, past, module, block_size: int, seq: int):
    """[G + 1, W, D] windows -> [G + 1, block, D]: each group's block rows, through the module's
    window_starts."""
    starts = jnp.concatenate([past.group_start, jnp.zeros((1,), jnp.int32)])
    offset = starts - module.window_starts(starts, block_size, seq, windows.dtype)
    take = lambda w, o: jax.lax.dynamic_slice_in_dim(w, o, block_size, axis=0)
    return jax.vmap(take)(windows, offset).astype(jnp.float32)


def _relative(a, b) -> float:
    a, b = jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32)
    return float(jnp.abs(a - b).max() / jnp.maximum(jnp.abs(b).max(), 1e-30))


def compare_and_time(seq: int, p: dict, interpret: bool) -> dict:
    """One row: the two kernel sets' results compared, then timed (ms, median of p["repeats"])."""
    args, do, kw, past = kernel_inputs(seq, p, interpret)
    q_rows, k = args[0], args[1]
    row = {
        "seq": seq,
        "heads": p["heads"],
        "head_dim": p["head_dim"],
        "block": p["block"],
        "top_k": p["top_k"],
    }
    row |= {"tiles": kw["block_sizes"].tiles_text(), "tiles_rows": int(q_rows.shape[0] * q_rows.shape[1])}
    why_not = mgpu_blocks.supports(
        head_dim=q_rows.shape[-1],
        v_head_dim=args[2].shape[-1],
        dtype=q_rows.dtype,
        block_sizes=kw["block_sizes"],
        block_size=p["block"],
    )
    if why_not:
        return row | {"skipped": why_not}
    real = past.tiles.rows >= 0
    fns = {}
    for name, module in (("triton", gpu_blocks), ("mosaic", mgpu_blocks)):
        fwd = jax.jit(lambda *a, m=module: m.block_attention_fwd(*a, **kw))
        bwd = jax.jit(lambda *a, m=module: m.block_attention_bwd(*a, **kw))
        fns[name] = (fwd, bwd)
    o_t, lse_t = fns["triton"][0](*args)
    o_m, lse_m = fns["mosaic"][0](*args)
    lse_rows = jnp.where(real, lse_t, jnp.inf)
    delta = jnp.sum(o_t * do.astype(jnp.float32), axis=-1)
    extra = (past.group_first, do, lse_rows, delta)
    grads = {name: fns[name][1](*args, *extra) for name in fns}
    (dq_t, dk_t, dv_t), (dq_m, dk_m, dv_m) = grads["triton"], grads["mosaic"]
    block_rows = lambda w, m: _block_rows(w, past, m, p["block"], k.shape[1])
    row |= {
        "o_rel_diff": _relative(jnp.where(real[..., None], o_m, 0), jnp.where(real[..., None], o_t, 0)),
        "lse_rel_diff": _relative(jnp.where(real, lse_m, 0), jnp.where(real, lse_t, 0)),
        "dq_rel_diff": _relative(jnp.where(real[..., None], dq_m, 0), jnp.where(real[..., None], dq_t, 0)),
        "dk_rel_diff": _relative(block_rows(dk_m, mgpu_blocks), block_rows(dk_t, gpu_blocks)),
        "dv_rel_diff": _relative(block_rows(dv_m, mgpu_blocks), block_rows(dv_t, gpu_blocks)),
    }
    del o_t, o_m, grads, dq_t, dk_t, dv_t, dq_m, dk_m, dv_m
    contenders = {}
    for name, (fwd, bwd) in fns.items():
        contenders[f"{name}_fwd"] = seconds(fwd, *args)
        contenders[f"{name}_bwd"] = seconds(bwd, *args, *extra)
    times = alternated(contenders, p["repeats"])
    row |= {f"{name}_ms": round(s * 1e3, 3) for name, s in times.items()}
    for part in ("fwd", "bwd"):
        row[f"triton_over_mosaic_{part}"] = round(times[f"triton_{part}"] / times[f"mosaic_{part}"], 3)
    return row


def block_kernels(suite, rows: list, p: dict, interpret: bool) -> None:
    """The suite's section: one row per sequence length while its budget lasts."""
    for seq in p["seqs"]:
        if not suite.time_left():
            suite.add(rows, {"seq": seq, "skipped": "time budget"})
            continue
        try:
            suite.add(rows, compare_and_time(seq, p, interpret))
        except Exception as e:  # a kernel that fails to compile or run is this section's finding
            suite.add(rows, {"seq": seq, "error": f"{type(e).__name__}: {e}".splitlines()[0][:300]})
