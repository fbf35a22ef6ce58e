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
from pallas_kernels import gpu_memory
from pallas_kernels.moba import gpu_blocks, mgpu_blocks
from pallas_kernels.moba.parts import KernelCall, gather_rows, layout, past_schedule
from pallas_kernels.moba.schedule import BlockSizes

# (sequence length, tiles): the shipped `auto` tiles, and at 128K Mosaic's two-warpgroup tiles
FULL = dict(
    cases=[(8192, BlockSizes()), (131072, BlockSizes()), (131072, BlockSizes(kv_block=128, past_q_tile=128))],
    heads=16,
    head_dim=128,
    block=512,
    top_k=3,
    repeats=3,
)
DRY = dict(
    cases=[(256, BlockSizes(q_tile=64, kv_block=64, past_q_tile=64))],
    heads=2,
    head_dim=64,
    block=64,
    top_k=3,
    repeats=1,
)


def kernel_inputs(seq: int, tiles: BlockSizes, p: dict, interpret: bool):
    """(forward args, dO rows, keywords, schedule) of the selected blocks' kernels for a batch of
    one at `seq` under plan `p` (the attention section's shape), `auto` tiles resolved for the GPU.
    Not KernelCall.fitted: that refuses tiles over the Triton kernels' shared memory, which the
    Mosaic ones may still run."""
    q, k, v = structured_inputs(seq, p["heads"], p["head_dim"], jnp.bfloat16)
    r = moba_routing(q, k, block_size=p["block"], top_k=p["top_k"])
    sizes = tiles.resolve("gpu", head_dim=p["head_dim"], block_size=p["block"])
    call = KernelCall("gpu", interpret, sizes, p["block"], p["head_dim"] ** -0.5)
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


def compare_and_time(seq: int, tiles: BlockSizes, p: dict, interpret: bool) -> dict:
    """One row: the two kernel sets' results compared, then timed (ms, median of p["repeats"]).
    Tiles over the Triton kernels' shared memory (gpu_memory's estimate) time the Mosaic ones
    alone."""
    args, do, kw, past = kernel_inputs(seq, tiles, p, interpret)
    q_rows, k, v = args[:3]
    sizes = kw["block_sizes"]
    row = {
        "seq": seq,
        "heads": p["heads"],
        "head_dim": p["head_dim"],
        "block": p["block"],
        "top_k": p["top_k"],
    }
    row |= {"tiles": sizes.tiles_text(), "tile_rows": int(q_rows.shape[0] * q_rows.shape[1])}
    shape = dict(head_dim=q_rows.shape[-1], v_head_dim=v.shape[-1])
    why_not = mgpu_blocks.supports(**shape, dtype=q_rows.dtype, block_sizes=sizes, block_size=p["block"])
    if why_not:
        return row | {"skipped": why_not}
    modules = {"mosaic": mgpu_blocks}
    kernel, need = sizes.gpu_smem(*shape.values(), q_rows.dtype.itemsize)
    if need <= gpu_memory.smem_limit():
        modules["triton"] = gpu_blocks
    else:
        row["triton"] = f"not run: {kernel} would need about {need:,} bytes of shared memory"
    fns = {
        name: (
            jax.jit(lambda *a, m=module: m.block_attention_fwd(*a, **kw)),
            jax.jit(lambda *a, m=module: m.block_attention_bwd(*a, **kw)),
        )
        for name, module in modules.items()
    }
    real = past.tiles.rows >= 0
    fwd = {name: f(*args) for name, (f, _) in fns.items()}
    o, lse = fwd.get("triton", fwd["mosaic"])
    extra = (
        past.group_first,
        do,
        jnp.where(real, lse, jnp.inf),
        jnp.sum(o * do.astype(jnp.float32), axis=-1),
    )
    if "triton" in fns:
        grads = {name: b(*args, *extra) for name, (_, b) in fns.items()}
        rows_of = lambda x: jnp.where(real.reshape(real.shape + (1,) * (x.ndim - 2)), x, 0)
        blocks = lambda w, m: _block_rows(w, past, m, p["block"], k.shape[1])
        pairs = {
            "o": (rows_of(fwd["mosaic"][0]), rows_of(fwd["triton"][0])),
            "lse": (rows_of(fwd["mosaic"][1]), rows_of(fwd["triton"][1])),
            "dq": (rows_of(grads["mosaic"][0]), rows_of(grads["triton"][0])),
            "dk": (blocks(grads["mosaic"][1], mgpu_blocks), blocks(grads["triton"][1], gpu_blocks)),
            "dv": (blocks(grads["mosaic"][2], mgpu_blocks), blocks(grads["triton"][2], gpu_blocks)),
        }
        row |= {f"{name}_rel_diff": _relative(*pair) for name, pair in pairs.items()}
        del grads, pairs
    del fwd, o
    contenders = {}
    for name, (f, b) in fns.items():
        contenders[f"{name}_fwd"] = seconds(f, *args)
        contenders[f"{name}_bwd"] = seconds(b, *args, *extra)
    times = alternated(contenders, p["repeats"])
    row |= {f"{name}_ms": round(t * 1e3, 3) for name, t in times.items()}
    if "triton" in fns:
        for part in ("fwd", "bwd"):
            row[f"triton_over_mosaic_{part}"] = round(times[f"triton_{part}"] / times[f"mosaic_{part}"], 3)
    return row


def block_kernels(suite, rows: list, p: dict, interpret: bool) -> None:
    """The suite's section: one row per (sequence length, tiles) while its budget lasts."""
    for seq, tiles in p["cases"]:
        if not suite.time_left():
            suite.add(rows, {"seq": seq, "skipped": "time budget"})
            continue
        try:
            suite.add(rows, compare_and_time(seq, tiles, p, interpret))
        except Exception as e:  # a kernel that fails to compile or run is this section's finding
            suite.add(rows, {"seq": seq, "error": f"{type(e).__name__}: {e}".splitlines()[0][:300]})
