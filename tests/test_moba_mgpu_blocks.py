"""MoBA's selected-block kernels on Mosaic GPU (pallas_kernels/moba/mgpu_blocks.py), interpreted on
CPU: against the Triton kernels they replace on Hopper (same inputs from the real schedule) and,
inside the whole MoBA op, against the dense reference; and lowered for CUDA at a real shape."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import quick_or_slow, rand_qkv, segments
from jax.experimental.pallas import mosaic_gpu as plgpu

from effattn_jax.ops.moba import moba_reference
from effattn_jax.ops.routing import moba_routing
from pallas_kernels.common import gpu_lowering_target
from pallas_kernels.moba import gpu_blocks, mgpu_blocks, parts
from pallas_kernels.moba.attention import moba_pallas
from pallas_kernels.moba.kernels import Kernels
from pallas_kernels.moba.parts import gather_rows, past_schedule
from pallas_kernels.moba.schedule import BlockSizes
from pallas_kernels.registry import kernel

TILES = BlockSizes(q_tile=64, kv_block=64, past_q_tile=64, key_tile=64)  # Mosaic's smallest: 64 rows
CASES = {
    # name: (batch, seq, q_heads, kv_heads, block, top_k, segment lengths or None, tiles)
    "partial_last_block": (1, 200, 2, 2, 64, 3, None, TILES),
    "packed_documents": (1, 210, 2, 1, 64, 3, [77, 133], TILES),  # blocks start off 8-row tiles
    "gqa_4x": (1, 192, 4, 1, 64, 2, None, TILES),
    "top_k_covers_all": (1, 192, 2, 1, 64, 3, [101, 91], TILES),
    "tile_128_block_128": (1, 264, 2, 1, 128, 2, [45, 219], BlockSizes(kv_block=128, past_q_tile=128)),
    "ring_wraps": (1, 400, 2, 1, 192, 2, [83, 317], TILES),  # 3 (4 off-tile) sub-blocks, 2 slots
}
KERNEL_CASES = {
    **CASES,
    "float16": (1, 150, 2, 1, 64, 2, [61, 89], TILES),
    "head_dims_128_64": (1, 150, 2, 1, 64, 2, [61, 89], TILES),
}
REFERENCE_CASES = {**CASES, "top_k_1": (1, 130, 2, 1, 64, 1, None, TILES)}  # no selected block: not called
DTYPES = {"float16": jnp.float16}  # else bf16
DIMS = {"head_dims_128_64": (128, 64)}  # (q/k head dim, v head dim), else 64, 64
QUICK = {"ring_wraps"}  # blocks off 8-row tiles, SMEM rings that wrap (the fast set)
BF16 = dict(atol=3e-2, rtol=2e-2)  # bf16 inputs, float32 accumulation (test_moba_pallas's bf16 test)


def _case(name, seed=0):
    b, s, hq, hkv, c, top_k, lengths, tiles = (KERNEL_CASES | REFERENCE_CASES)[name]
    d, dv = DIMS.get(name, (64, 64))
    q, k, v = rand_qkv(seed, b, s, hq, hkv, d, dv, dtype=DTYPES.get(name, jnp.bfloat16))
    seg = None if lengths is None else segments(b, lengths)
    r = moba_routing(q, k, block_size=c, top_k=top_k, segment_ids=seg)
    return q, k, v, r, seg, c, tiles.resolve("gpu", head_dim=d, v_head_dim=dv, block_size=c)


def _kernel_inputs(name):
    """The selected blocks' kernel inputs, from the real schedule of a random routing."""
    q, k, v, r, _, c, tiles = _case(name)
    call = parts.KernelCall("gpu", True, tiles, c, 64**-0.5)
    q_flat, lay = parts.layout(q, k, v, call)
    past = past_schedule(r.past_start, hkv=k.shape[2], call=call)
    t = past.tiles
    rng = np.random.default_rng(1)
    do = jnp.asarray(rng.standard_normal((*t.rows.shape, v.shape[-1])), q.dtype)
    do = jnp.where((t.rows >= 0)[..., None], do, 0)
    args = (gather_rows(q_flat, t.rows), lay.k, lay.v, t.kv_row, t.key_start, past.tile_group)
    kw = dict(call.kernel_args, num_groups=past.group_tiles.shape[0])
    return args, past, do, kw, lay


def _f32(x):
    return np.asarray(x, np.float32)


@pytest.mark.parametrize("name", quick_or_slow(list(KERNEL_CASES), QUICK))
def test_kernels_match_the_triton_kernels(name):
    """Forward (o, lse) and backward (dq; dK/dV per group, read through each kernel's window) of the
    Mosaic GPU kernels against the Triton ones on the same tiles. Catches: a sub-block read from the
    wrong rows or twice (blocks starting off an 8-row tile read one sub-block more), a key of the
    neighbouring block let through the mask, a group's tiles not all visited by dK/dV, a window row
    written at the wrong offset, a compute warpgroup reading another's rows (past_q_tile 128), a
    key of the window outside the block given a gradient (its window row must stay zero)."""
    args, past, do, kw, lay = _kernel_inputs(name)
    o, lse = mgpu_blocks.block_attention_fwd(*args, **kw)
    o_ref, lse_ref = gpu_blocks.block_attention_fwd(*args, **kw)
    real = np.asarray(past.tiles.rows >= 0)
    assert o.dtype == lse.dtype == jnp.float32 and o.shape == o_ref.shape and lse.shape == lse_ref.shape
    np.testing.assert_allclose(_f32(o)[real], _f32(o_ref)[real], atol=1e-2, rtol=1e-2)
    np.testing.assert_allclose(_f32(lse)[real], _f32(lse_ref)[real], atol=1e-4, rtol=1e-4)

    lse_rows = jnp.where(past.tiles.rows >= 0, lse_ref, jnp.inf)
    delta = jnp.sum(o_ref * do.astype(jnp.float32), axis=-1)
    bwd = (past.group_first, do, lse_rows, delta)
    dq, dk, dv = mgpu_blocks.block_attention_bwd(*args, *bwd, **kw)
    dq_ref, dk_ref, dv_ref = gpu_blocks.block_attention_bwd(*args, *bwd, **kw)
    assert dq.dtype == dk.dtype == dv.dtype == args[0].dtype
    np.testing.assert_allclose(_f32(dq)[real], _f32(dq_ref)[real], atol=2e-2, rtol=2e-2)
    c = kw["block_size"]
    width = mgpu_blocks.window(c, dq.dtype)
    assert dk.shape == (dk_ref.shape[0], width, dk_ref.shape[-1])
    starts = np.asarray(past.group_start)
    offset = starts - np.asarray(mgpu_blocks.window_starts(past.group_start, c, lay.seq, dq.dtype))
    assert ((offset >= 0) & (offset + c <= width)).all()
    for g, off in enumerate(offset):  # slot G (padding) has no tiles: zeros in both
        for got, want in ((dk, dk_ref), (dv, dv_ref)):
            np.testing.assert_allclose(_f32(got[g, off : off + c]), _f32(want[g]), atol=2e-2, rtol=2e-2)
            assert not np.any(_f32(got[g, :off])) and not np.any(_f32(got[g, off + c :]))
    assert not np.any(_f32(dk[-1])) and not np.any(_f32(dv[-1]))


# through the whole op: the cases whose schedule differs (the kernel comparison covers the rest)
@pytest.mark.parametrize(
    "name", quick_or_slow(["ring_wraps", "packed_documents", "top_k_covers_all", "top_k_1"], QUICK)
)
def test_moba_with_them_matches_the_reference(name):
    """The whole MoBA op with these kernels for the selected blocks (the own block by the Triton
    kernels), interpreted, against the dense reference with the same routing: output and dq/dK/dV
    within bf16 rounding. Catches what the kernel comparison cannot: a window start the caller
    maps keys through differently from the kernel's."""
    q, k, v, r, seg, c, tiles = _case(name, seed=3)
    scale = 64**-0.5
    mixed = Kernels(
        own=kernel("moba", "attention", "triton").own, blocks=kernel("moba", "attention", "mosaic").blocks
    )
    pallas = lambda q, k, v: moba_pallas(
        q, k, v, r.own_start, r.past_start, c, scale, "gpu", True, tiles, kernels=mixed
    )
    ref = lambda q, k, v: moba_reference(q, k, v, r, block_size=c, segment_ids=seg, scale=scale)
    f32 = [x.astype(jnp.float32) for x in (q, k, v)]
    out = jax.jit(pallas)(q, k, v)
    np.testing.assert_allclose(_f32(out), ref(*f32), **BF16)
    w = jnp.asarray(np.random.default_rng(5).standard_normal(out.shape), jnp.float32)
    loss = lambda f: lambda q, k, v: jnp.sum(f(q, k, v).astype(jnp.float32) * w)
    grads = jax.jit(jax.grad(loss(pallas), argnums=(0, 1, 2)))(q, k, v)
    for a, e in zip(grads, jax.grad(loss(ref), argnums=(0, 1, 2))(*f32), strict=True):
        np.testing.assert_allclose(_f32(a), e, **BF16)


def test_supports_says_why_not():
    """One line naming what does not fit; None for the shipped GPU tiles at head dim 128, bf16."""
    ok = dict(head_dim=128, v_head_dim=128, dtype=jnp.bfloat16, block_size=512)
    tiles = BlockSizes().resolve("gpu", head_dim=128, block_size=512)
    assert mgpu_blocks.supports(block_sizes=tiles, **ok) is None
    assert mgpu_blocks.supports(block_sizes=BlockSizes(), **ok) is None  # auto: the GPU's tiles
    assert "float32" in mgpu_blocks.supports(block_sizes=tiles, **(ok | dict(dtype=jnp.float32)))
    assert "multiples of 64" in mgpu_blocks.supports(block_sizes=tiles, **(ok | dict(head_dim=96)))
    small = BlockSizes(q_tile=32, kv_block=32, past_q_tile=32).resolve("gpu")
    assert "past_q_tile" in mgpu_blocks.supports(block_sizes=small, **ok)
    big = BlockSizes(kv_block=256, past_q_tile=128, num_stages=3).resolve("gpu")
    assert "shared memory" in mgpu_blocks.supports(block_sizes=big, **ok)


@pytest.mark.parametrize("tiles", [(64, 64, 2), (128, 64, 2), (64, 128, 2)])
def test_kernels_lower_for_cuda(tiles):
    """Forward and backward lower for CUDA (jax.export, no GPU) at a real shape: bf16, head dim 128,
    block 512. Catches what the interpreter forgives: a TMA slice not on whole tiles, a layout the
    warpgroup matmuls cannot take, SMEM over an H100/H200's (supports' estimate under-counting)."""
    qt, ck, stages = tiles
    sizes = BlockSizes(q_tile=64, kv_block=ck, past_q_tile=qt, num_stages=stages).resolve("gpu")
    reason = mgpu_blocks.supports(
        head_dim=128, v_head_dim=128, dtype=jnp.bfloat16, block_sizes=sizes, block_size=512
    )
    # the larger sets lower, but their dK/dV spills when compiled (make gpu-compile): supports refuses
    assert (reason is None) == (tiles == (64, 64, 2)) and (reason is None or "would spill" in reason), reason
    ntiles, groups = 40, 16
    sd = jax.ShapeDtypeStruct
    q, kv, i = sd((ntiles, qt, 128), jnp.bfloat16), sd((2, 4096, 128), jnp.bfloat16), sd((ntiles,), jnp.int32)
    rows = sd((ntiles, qt), jnp.float32)
    kw = dict(scale=0.1, block_size=512, block_sizes=sizes, num_groups=groups, interpret=False)
    fwd = lambda q, k, v, a, b, c: mgpu_blocks.block_attention_fwd(q, k, v, a, b, c, **kw)
    bwd = lambda q, k, v, a, b, c, f, do, lse, de: mgpu_blocks.block_attention_bwd(
        q, k, v, a, b, c, f, do, lse, de, **kw
    )
    with gpu_lowering_target():
        text = jax.export.export(jax.jit(fwd), platforms=["cuda"])(q, kv, kv, i, i, i).mlir_module()
        text += jax.export.export(jax.jit(bwd), platforms=["cuda"])(
            q, kv, kv, i, i, i, i, q, rows, rows
        ).mlir_module()
    assert "mosaic_gpu" in text
    assert not re.search(r"triton", text)


@pytest.mark.skipif(
    "on_race" not in plgpu.InterpretGPUParams.__dataclass_fields__,
    reason=f"jax {jax.__version__}: InterpretGPUParams has no on_race, so its race detector cannot raise",
)
@pytest.mark.slow
def test_no_races_between_the_warpgroups():
    """The interpreter's race detector on every kernel, with rings that wrap and blocks off 8-row
    tiles: the memory warpgroup refills a slot only after the compute warpgroups released it.
    Catches: a missing or misplaced consumed-barrier wait (tried: dropping the memory warpgroup's
    wait raises here)."""
    args, past, do, kw, _ = _kernel_inputs("ring_wraps")
    kw["interpret"] = plgpu.InterpretGPUParams(detect_races=True, on_race="raise")
    o, lse = mgpu_blocks.block_attention_fwd(*args, **kw)
    lse_rows = jnp.where(past.tiles.rows >= 0, lse, jnp.inf)
    delta = jnp.sum(o * do.astype(jnp.float32), axis=-1)
    jax.block_until_ready(mgpu_blocks.block_attention_bwd(*args, past.group_first, do, lse_rows, delta, **kw))


# (past_q_tile, kv_block, head dim, value head dim) -> the worst kernel's spill bytes, ptxas sm_90a
# through nvJitLink, setmaxnreg dropped (docs/gpu_registers.md): all refused by supports
SPILLED = [
    (128, 64, 128, 128, 544),  # dK/dV, 256 threads
    (64, 128, 128, 128, 440),  # dK/dV, 384 threads: 168 registers a thread
    (64, 128, 64, 128, 212),
    (64, 128, 128, 64, 192),
    (64, 64, 64, 256, 176),
    (64, 64, 256, 64, 120),
    (64, 256, 64, 64, 396),  # dK/dV, 640 threads: 96 registers a thread
    (128, 64, 64, 256, 216),  # the forward, 384 threads
]


@pytest.mark.parametrize("qt, ck, d, dv, spill", SPILLED)
def test_supports_refuses_every_set_that_spilled(qt, ck, d, dv, spill):
    sizes = BlockSizes(q_tile=64, kv_block=ck, past_q_tile=qt, num_stages=2).resolve("gpu")
    reason = mgpu_blocks.supports(
        head_dim=d, v_head_dim=dv, dtype=jnp.bfloat16, block_sizes=sizes, block_size=512
    )
    assert reason is not None and "would spill" in reason and "\n" not in reason, (qt, ck, d, dv, spill)


def test_supports_counts_the_register_cap_without_setmaxnreg():
    """65,536 registers over 128 threads per compute warpgroup and the memory one: 255, 168, 96; the
    sets that compiled without a spill are accepted (64 / 64 at head dims 64-128; 64 / 128 at 64)."""
    assert [mgpu_blocks.register_cap(n) for n in (1, 2, 4)] == [255, 168, 96]
    for qt, ck, d, dv in [
        (64, 64, 64, 64),
        (64, 64, 128, 128),
        (64, 64, 64, 128),
        (64, 128, 64, 64),
        (128, 64, 64, 64),
    ]:
        sizes = BlockSizes(q_tile=64, kv_block=ck, past_q_tile=qt, num_stages=2).resolve("gpu")
        ok = dict(head_dim=d, v_head_dim=dv, dtype=jnp.bfloat16, block_size=512)
        assert mgpu_blocks.supports(block_sizes=sizes, **ok) is None, (qt, ck, d, dv)
