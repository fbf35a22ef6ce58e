"""MoBA's own-block kernels on Mosaic GPU (pallas_kernels/moba/mgpu_own.py) on CPU: interpreted
(plgpu.InterpretGPUParams) against the Pallas Triton kernels they replace on Hopper (gpu_own.py,
interpreted) and against a dense own-block reference, forward and gradients; lowered for CUDA
(jax.export) at realistic shapes; `supports` agreeing with what lowers."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import quick_or_slow, rand_qkv, segments

from effattn_jax.ops.routing import moba_routing
from pallas_kernels.common import gpu_lowering_target
from pallas_kernels.moba import gpu_own, mgpu_own, parts
from pallas_kernels.moba.schedule import BlockSizes

TILES = BlockSizes(q_tile=64, kv_block=64, past_q_tile=64, num_warps=4, num_stages=2)
CASES = {
    # name: (batch, seq, q_heads, kv_heads, block, segment lengths or None, tiles)
    "partial_last_block": (1, 150, 2, 2, 64, None, TILES),
    "packed_documents": (2, 150, 2, 1, 64, [40, 75, 35], TILES),
    "gqa_4x": (1, 130, 8, 2, 128, None, TILES),
    "block_of_one_tile": (1, 100, 2, 1, 64, [30, 70], TILES),
    "query_tiles_unlike_key_steps": (1, 200, 4, 2, 128, [50, 150], BlockSizes(128, 64, 64, None, 4, 3)),
    "one_stage_longer_keys_than_queries": (1, 150, 2, 1, 128, [90, 60], BlockSizes(64, 128, 64, None, 4, 1)),
    "values_wider_than_keys": (1, 150, 2, 1, 64, [60, 90], TILES),
}
V_HEAD_DIM = {"values_wider_than_keys": 128}  # the others: the head dim
QUICK = {"packed_documents"}  # what `make test-fast` runs


def _case(name, d=64, dtype=jnp.bfloat16):
    """Head-major q, k, v, dO [rows, S_pad, D], the own-block tables and the call's keywords."""
    b, s, hq, hkv, c, lengths, tiles = CASES[name]
    dv = V_HEAD_DIM.get(name, d)
    q, k, v = rand_qkv(7, b, s, hq, hkv, d, dv, dtype=dtype)
    seg = None if lengths is None else segments(b, lengths)
    own_start = moba_routing(q, k, block_size=c, top_k=1, segment_ids=seg).own_start
    seq_pad = parts.padded_length(s, c, tiles)
    do = jnp.asarray(np.random.default_rng(8).standard_normal((b, s, hq, dv)), dtype)
    heads = lambda x: parts._heads(x, seq_pad)  # zero rows past S: their dO is 0, as in parts.py
    tables = gpu_own.own_tables(own_start, seq_pad=seq_pad, q_tile=tiles.q_tile, kv_block=tiles.kv_block)
    kw = dict(scale=d**-0.5, block_size=c, block_sizes=tiles, interpret=True)
    return [heads(x) for x in (q, k, v, do)], tables, kw


def _dense(q, k, v, lo, scale):
    """The own block by dense masked attention in float32: (o [rows, S_pad, Dv], lse [rows, S_pad, 1]);
    lo [B, S_pad, 1]: query t sees keys [lo[t], t]."""
    b, seq = lo.shape[0], q.shape[1]
    group = q.shape[0] // k.shape[0]
    expand = lambda x: jnp.repeat(x.reshape(b, -1, *x.shape[1:]), group, axis=1).reshape(-1, *x.shape[1:])
    k, v = expand(k.astype(jnp.float32)), expand(v.astype(jnp.float32))
    pos = jnp.arange(seq)
    mask = (pos[None, None] >= lo) & (pos[None, None] <= pos[None, :, None])  # [B, S_pad, S_pad]
    mask = jnp.repeat(mask, q.shape[0] // b, axis=0)
    logits = jnp.einsum("rtd,rsd->rts", q.astype(jnp.float32), k) * scale
    logits = jnp.where(mask, logits, -jnp.inf)
    lse = jax.nn.logsumexp(logits, axis=-1, keepdims=True)
    return jnp.einsum("rts,rsd->rtd", jnp.exp(logits - lse), v), lse


def _close(actual, expected, atol, rtol):
    np.testing.assert_allclose(
        np.asarray(actual, np.float32), np.asarray(expected, np.float32), atol=atol, rtol=rtol
    )


@pytest.mark.parametrize("name", quick_or_slow(list(CASES), QUICK))
def test_interpreted_kernels_match_triton_and_dense_reference(name):
    """Forward (o float32, lse) and backward (dq, dK, dV in bf16) of the Mosaic GPU kernels,
    interpreted, against the Triton kernels (interpreted; the same bf16 matmul inputs, so within a
    bf16 rounding) and the dense float32 reference (bf16 tolerances as tests/test_moba_pallas.py's),
    over partial blocks, packed documents, GQA, tiles unlike key steps, a single stage and value heads
    wider than the keys'. Catches:
    a K/V step skipped or fetched into the wrong ring slot, the mask off by one, a query head mapped
    to the wrong KV head, dK/dV missing a query head of its group, a row of the wrong tile."""
    (q, k, v, do), (lo, first, q_end), kw = _case(name)
    fwd = jax.jit(lambda *a: mgpu_own.own_attention_fwd(*a, **kw))
    o, lse = fwd(q, k, v, lo, first)
    o_t, lse_t = gpu_own.own_attention_fwd(q, k, v, lo, first, **kw)
    o_d, lse_d = _dense(q, k, v, lo, kw["scale"])
    assert o.shape == o_t.shape and o.dtype == jnp.float32 and lse.shape == lse_t.shape
    _close(o, o_t, 2e-3, 2e-3)
    _close(lse, lse_t, 1e-4, 1e-4)
    _close(o, o_d, 3e-2, 2e-2)
    _close(lse, lse_d, 1e-3, 1e-3)

    delta = jnp.sum(o * do.astype(jnp.float32), axis=-1, keepdims=True)
    args = (q, k, v, lo, first, q_end, do, lse, delta)
    grads = jax.jit(lambda *a: mgpu_own.own_attention_bwd(*a, **kw))(*args)
    grads_t = gpu_own.own_attention_bwd(*args, **kw)
    f32 = [x.astype(jnp.float32) for x in (q, k, v)]
    _, vjp = jax.vjp(lambda q, k, v: _dense(q, k, v, lo, kw["scale"])[0], *f32)
    grads_d = vjp(do.astype(jnp.float32))
    for g, g_t, g_d in zip(grads, grads_t, grads_d, strict=True):
        assert g.shape == g_t.shape and g.dtype == g_t.dtype == jnp.bfloat16
        _close(g, g_t, 1e-2, 1e-2)
        _close(g, g_d, 3e-2, 2e-2)


def _lower(d, dv, tiles, passes=("fwd", "bwd"), seq=2048, b=1, hq=4, hkv=2, block=512):
    """The forward and/or backward exported for CUDA (an H200), bf16: the lowered modules' text."""
    sd = jax.ShapeDtypeStruct
    bf = lambda rows, width: sd((rows, seq, width), jnp.bfloat16)
    qkv = bf(b * hq, d), bf(b * hkv, d), bf(b * hkv, dv)
    tables = sd((b, seq, 1), jnp.int32), sd((b * seq // tiles.q_tile,), jnp.int32)
    q_end = sd((b * seq // tiles.kv_block,), jnp.int32)
    vec = sd((b * hq, seq, 1), jnp.float32)
    kw = dict(scale=d**-0.5, block_size=block, block_sizes=tiles, interpret=False)
    calls = {
        "fwd": (lambda *a: mgpu_own.own_attention_fwd(*a, **kw), (*qkv, *tables)),
        "bwd": (
            lambda *a: mgpu_own.own_attention_bwd(*a, **kw),
            (*qkv, *tables, q_end, bf(b * hq, dv), vec, vec),
        ),
    }
    outs = {
        "fwd": [((b * hq, seq, dv), jnp.float32), ((b * hq, seq, 1), jnp.float32)],
        "bwd": [
            ((b * hq, seq, d), jnp.bfloat16),
            ((b * hkv, seq, d), jnp.bfloat16),
            ((b * hkv, seq, dv), jnp.bfloat16),
        ],
    }
    text = ""
    for name in passes:
        fn, args = calls[name]
        with gpu_lowering_target():
            exported = jax.export.export(jax.jit(fn), platforms=["cuda"])(*args)
        assert [(o.shape, o.dtype) for o in exported.out_avals] == outs[name]
        text += exported.mlir_module()
    return text


@pytest.mark.parametrize(
    "d, dv, tiles",
    [
        (128, 128, TILES),  # the paper config's heads with the default GPU tiles
        (64, 128, BlockSizes(128, 64, 64, None, 4, 3)),
        (64, 64, BlockSizes(64, 128, 64, None, 4, 2)),
    ],
)
def test_kernels_lower_for_cuda(d, dv, tiles):
    """The three kernels lower for an H200 at realistic shapes (warpgroup matmuls, TMA, swizzled
    shared memory: the lowering checks layouts and shapes the interpreter forgives); `supports` says
    yes to the default tiles and refuses the larger sets, which spill when compiled (make gpu-compile)."""
    reason = mgpu_own.supports(
        head_dim=d, v_head_dim=dv, dtype=jnp.bfloat16, block_sizes=tiles, block_size=512
    )
    assert (reason is None) == (tiles == TILES) and (reason is None or "would spill" in reason), reason
    text = _lower(d, dv, tiles)
    for name in ("moba_own_fwd_mgpu", "moba_own_dq_mgpu", "moba_own_dkv_mgpu"):
        assert name in text


def test_supports_refuses_what_does_not_compile():
    """`supports` gives one line for what these kernels cannot run (the Triton kernels take it), and
    two of its refusals, key steps of 32 and four stages of 128 keys (shared memory), are indeed
    refused by the Mosaic GPU lowering. (The register budget has no such check on a CPU: ptxas would
    spill, not refuse.)"""
    ask = lambda dtype=jnp.bfloat16, d=128, **tiles: mgpu_own.supports(
        head_dim=d, v_head_dim=d, dtype=dtype, block_sizes=dataclasses.replace(TILES, **tiles), block_size=512
    )
    assert ask() is None and ask(jnp.float16) is None
    assert "float32" in ask(jnp.float32)
    assert "head dim" in ask(d=96)
    assert "moba.q_tile" in ask(q_tile=32)
    assert "moba.kv_block" in ask(kv_block=32)
    assert "moba.kv_block" in ask(kv_block=512)
    over = ask(d=256, kv_block=256, num_stages=3)
    assert "shared memory" in over and "moba.num_stages=3" in over
    assert "accumulator registers" in ask(d=192)  # dK + dV: 64 x 384 float32 in one warpgroup
    assert "accumulator registers" in ask(d=64, q_tile=128, kv_block=128)  # a 128 x 128 score tile
    jax.clear_caches()
    with pytest.raises(ValueError, match="multiple of 64"):
        _lower(128, 128, BlockSizes(64, 32, 64, None, 4, 2))
    # four stages of 128 keys at head dim 128: over the shared memory, refused by both
    tiles = BlockSizes(64, 128, 64, None, 4, 4)
    refusal = mgpu_own.supports(
        head_dim=128, v_head_dim=128, dtype=jnp.bfloat16, block_sizes=tiles, block_size=512
    )
    assert "shared memory" in refusal and "moba.num_stages=4" in refusal
    for passes in ("fwd", "bwd"):
        jax.clear_caches()
        with pytest.raises(ValueError, match="exceeds available shared memory"):
            _lower(128, 128, tiles, passes=(passes,))


@pytest.mark.parametrize(
    "d, dv, tiles",
    [
        (128, 128, TILES),
        (64, 128, BlockSizes(128, 64, 64, None, 4, 3)),  # dK/dV the larger backward kernel
        (128, 64, BlockSizes(64, 128, 64, None, 4, 2)),  # dq the larger one
        (64, 128, BlockSizes(128, 64, 64, None, 4, 1)),  # the forward's o larger than its K/V ring
    ],
)
def test_smem_estimate_is_what_the_lowering_allocates(d, dv, tiles):
    """smem_bytes is Mosaic GPU's own count, to the byte: each pass lowers under a shared-memory limit
    of its largest kernel's estimate and fails one byte below it. Catches: a scratch buffer left out of
    the estimate (supports would pass a configuration the compiler then refuses)."""
    from jax.experimental.mosaic.gpu.core import artificial_shared_memory_limit

    sizes = mgpu_own.smem_bytes(
        q_tile=tiles.q_tile, kv_block=tiles.kv_block, stages=tiles.num_stages, d=d, dv=dv, itemsize=2
    )
    need = {
        "fwd": sizes["moba_own_fwd_mgpu"],
        "bwd": max(sizes["moba_own_dq_mgpu"], sizes["moba_own_dkv_mgpu"]),
    }
    for name, limit in need.items():
        jax.clear_caches()  # a kernel lowered before is not lowered (nor checked) again
        with artificial_shared_memory_limit(limit - 1), pytest.raises(ValueError, match="shared memory"):
            _lower(d, dv, tiles, passes=(name,))
        jax.clear_caches()
        with artificial_shared_memory_limit(limit):
            _lower(d, dv, tiles, passes=(name,))


# (q_tile, kv_block, stages, head dim, value head dim) -> spill bytes of the worst kernel, ptxas
# sm_90a through nvJitLink (docs/gpu_registers.md): every one of these is refused, the default
# tiles at head dims 64 and 128 accepted (0 spill)
SPILLED = [
    ((128, 64, 3), 64, 128, 488),
    ((128, 64, 2), 64, 64, 208),
    ((64, 128, 2), 64, 64, 696),
    ((128, 64, 2), 128, 64, 436),
    ((64, 64, 2), 64, 256, 200),
    ((64, 64, 2), 128, 256, 540),
    ((64, 64, 2), 256, 64, 200),
    ((64, 256, 2), 64, 64, 3836),
    ((64, 64, 3), 128, 128, 120),  # a ring of 3: 0 at 2 and 4 stages
]


@pytest.mark.parametrize("tiles, d, dv, spill", SPILLED)
def test_supports_refuses_every_set_that_spilled(tiles, d, dv, spill):
    qt, ck, stages = tiles
    sizes = BlockSizes(q_tile=qt, kv_block=ck, past_q_tile=64, num_warps=4, num_stages=stages)
    reason = mgpu_own.supports(
        head_dim=d, v_head_dim=dv, dtype=jnp.bfloat16, block_sizes=sizes, block_size=512
    )
    assert reason is not None and "would spill" in reason and "\n" not in reason, (tiles, d, dv, spill)


@pytest.mark.parametrize("d, dv", [(64, 64), (64, 128), (128, 64), (128, 128)])
def test_supports_accepts_the_default_tiles(d, dv):
    """64 / 64, two stages: 205-255 registers, no spill, at these head dims."""
    assert (
        mgpu_own.supports(head_dim=d, v_head_dim=dv, dtype=jnp.bfloat16, block_sizes=TILES, block_size=512)
        is None
    )
    live = mgpu_own.live_registers(d, dv, 64, 64)
    assert max(v[2] for v in live.values()) <= mgpu_own.LIVE_REGS
