"""MoBA's routing kernels (pallas_kernels/moba/routing_gpu.py, routing_tpu.py), interpreted on CPU,
against the XLA gate `moba_routing`: the picks must be equal, slot for slot (order, ties and -1 slots
included); and their lowerings for CUDA and a TPU."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import quick_or_slow, rand_qkv, segments, v5e_arg

from effattn_jax.ops.moba import moba_attention
from effattn_jax.ops.platform import tracing_for
from effattn_jax.ops.routing import moba_routing
from pallas_kernels.common import gpu_lowering_target
from pallas_kernels.moba import routing_gpu as routing_gpu_module
from pallas_kernels.moba import routing_tpu as routing_tpu_module
from pallas_kernels.moba.routing_gpu import routing_gpu
from pallas_kernels.moba.routing_mgpu import routing_mgpu
from pallas_kernels.moba.routing_tpu import routing_tpu

CASES = {
    # name: (batch, seq, q_heads, kv_heads, block, top_k, segment lengths or None)
    "packed_documents": (2, 96, 2, 1, 8, 4, [13, 50, 33]),
    "gqa": (1, 64, 4, 2, 8, 3, None),
    "partial_last_block": (1, 70, 2, 2, 8, 3, None),
    "top_k_covers_every_block": (1, 64, 2, 1, 8, 12, [40, 24]),
    "top_k_16": (1, 160, 2, 1, 8, 16, None),  # 19 full blocks, 15 picks
}


KERNELS = ("gpu_triton", "tpu")
NAMES = {"gpu_triton": "moba_routing_gpu", "gpu_mosaic": "moba_routing_mgpu", "tpu": "moba_routing_tpu"}


def both(q, k, kernel="gpu_triton", interpret=True, uses=None, **kw):
    """(XLA's past_start, the kernel's), each jitted; `interpret`: True, or "tpu" (TPU interpreter);
    `uses`: the kernel expected to run (default: the Triton or TPU one)."""
    route = lambda kernel: jax.jit(lambda q, k: moba_routing(q, k, kernel=kernel, interpret=interpret, **kw))
    assert (uses or NAMES[kernel]) in str(jax.make_jaxpr(route(kernel))(q, k))
    return route(None)(q, k).past_start, route(kernel)(q, k).past_start


QUICK = {(k, "packed_documents", "bfloat16") for k in KERNELS}


@pytest.mark.parametrize(
    "kernel, name, dtype",
    quick_or_slow(
        [(k, n, "float32") for k in KERNELS for n in CASES]
        + [(k, n, "bfloat16") for k in KERNELS for n in ("packed_documents", "top_k_16")],
        QUICK,
    ),
)
def test_kernel_picks_equal_xla(kernel, name, dtype, monkeypatch):
    """Every slot equal to moba_routing's over packed documents, GQA (a query head reading its KV head's
    means), a partial last block, top_k covering every block (-1 slots) and top_k 16 (means over two tiles),
    in float32 and bfloat16, with tiles of 16 means (the lists carried across tiles; a later document's
    queries start past the first tile). Catches: a candidate window off by one (own block or document
    start), a query head mapped to the wrong KV head, picks out of order, a -1 slot filled, a tile of
    means skipped."""
    monkeypatch.setattr(routing_gpu_module, "MEAN_TILE", 16)
    monkeypatch.setattr(routing_tpu_module, "MEAN_TILE", 16)
    b, s, hq, hkv, c, top_k, lengths = CASES[name]
    q, k, _ = rand_qkv(7, b, s, hq, hkv, 16, dtype=jnp.dtype(dtype))
    seg = None if lengths is None else segments(b, lengths)
    want, got = both(q, k, kernel, block_size=c, top_k=top_k, segment_ids=seg)
    assert got.dtype == jnp.int32 and got.shape == want.shape == (b, s, hq, min(top_k - 1, -(-s // c) - 1))
    np.testing.assert_array_equal(got, want)
    assert (want >= 0).any()
    if name == "top_k_covers_every_block":
        assert (want == -1).any() and (want[:, -1] >= 0).sum() > 0


@pytest.mark.slow
def test_tpu_kernel_in_the_tpu_interpreter():
    """The TPU kernel under the TPU interpret mode (TPU memory, DMAs) at top_k 16 over two query tiles.
    Catches: a running list that this mode mixes up (a loop carry of 31 separate vectors did, in the
    second tile's first 32 lanes; the list is carried as two arrays)."""
    q, k, _ = rand_qkv(7, 1, 256, 1, 1, 16)
    want, got = both(q, k, "tpu", "tpu", block_size=4, top_k=16)
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("kernel", KERNELS)
def test_kernel_ties_go_to_the_earlier_block(kernel):
    """Identical keys make every block's mean the same, so every candidate ties: the picks must be the
    earliest blocks, in order, as in top_k_first; a second case ties only some blocks (pairs of equal
    means) among distinct scores. Catches: ties broken to the later block or by position in a tile."""
    q = jnp.ones((1, 64, 2, 8), jnp.float32)
    k = jnp.ones((1, 64, 1, 8), jnp.float32)
    want, got = both(q, k, kernel, block_size=4, top_k=5)
    np.testing.assert_array_equal(got, want)
    assert got[0, 63, 0].tolist() == [0, 4, 8, 12]
    blocks = np.random.default_rng(3).standard_normal((8, 1, 8)).astype(np.float32)
    k = jnp.asarray(np.repeat(np.repeat(blocks, 2, axis=0), 4, axis=0).reshape(1, 64, 1, 8))  # pairs tie
    q, _, _ = rand_qkv(4, 1, 64, 2, 1, 8)
    want, got = both(q, k, kernel, block_size=4, top_k=6)
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("kernel", KERNELS)
def test_kernel_picks_for_a_context_shard(kernel):
    """The context-parallel gate (q_index: a shard's queries, two chunks from the two ends of the
    sequence, packed documents) equal to XLA's. Catches: query positions taken as 0..T-1."""
    q, k, _ = rand_qkv(5, 1, 128, 2, 1, 16)
    q_index = jnp.concatenate([jnp.arange(16, 48), jnp.arange(80, 112)])[None]
    kw = dict(block_size=8, top_k=4, segment_ids=segments(1, [50, 78]), q_index=q_index)
    want, got = both(q[:, q_index[0]], k, kernel, **kw)
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("kernel", ["triton", "tpu"])
def test_moba_attention_on_pallas_routes_with_the_kernel(kernel):
    """moba_attention(impl="pallas_triton" / "pallas_tpu"), interpreted, gates with that backend's kernel
    and still matches the reference (output and gradients). Catches: the kernel routing not reaching
    the Pallas path, or picks that change the attention."""
    q, k, v = rand_qkv(6, 1, 40, 2, 1, 8)
    seg = segments(1, [25, 15])
    attend = lambda impl: (
        lambda q, k, v: moba_attention(q, k, v, block_size=8, top_k=3, segment_ids=seg, impl=impl)
    )
    assert NAMES.get(kernel, "moba_routing_gpu") in str(jax.make_jaxpr(attend(f"pallas_{kernel}"))(q, k, v))
    assert "moba_routing" not in str(jax.make_jaxpr(attend("xla"))(q, k, v))
    w = jnp.asarray(np.random.default_rng(1).standard_normal(q.shape), jnp.float32)
    loss = lambda impl: jax.jit(
        jax.value_and_grad(lambda *x: jnp.sum(attend(impl)(*x) * w), argnums=(0, 1, 2))
    )
    (got, got_grads), (want, want_grads) = loss(f"pallas_{kernel}")(q, k, v), loss("reference")(q, k, v)
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4)
    for a, e in zip(got_grads, want_grads, strict=True):
        np.testing.assert_allclose(a, e, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_kernel_lowers_for_cuda(dtype):
    """The kernel lowers to Triton for CUDA (jax.export, no GPU) at the suite's head shape and top_k 16,
    in bf16 (tensor-core scores) and float32 (full-precision dot). Catches: an op or block shape the
    Triton lowering rejects, an XLA fallback in its place."""
    dtype = jnp.dtype(dtype)
    b, t, hq, d, n = 1, 2048, 4, 128, 4
    s = jax.ShapeDtypeStruct
    route = lambda q, st, m, lo, hi: routing_gpu(q, st, m, lo, hi, 15, seq=t, key_dtype=dtype)
    triton = jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")
    with gpu_lowering_target():
        exported = jax.export.export(jax.jit(route), platforms=["cuda"], disabled_checks=[triton])(
            s((b, t, hq, d), dtype),
            s((b, n), jnp.int32),
            s((b, n, hq, d), jnp.float32),
            s((b, t), jnp.int32),
            s((b, t), jnp.int32),
        )
    assert re.findall(r'name = "(moba_\w+)"', exported.mlir_module()) == ["moba_routing_gpu"]


@pytest.mark.slow
@pytest.mark.parametrize("d, dtype, seq", [(128, "bfloat16", 4096), (64, "float32", 1000)])
def test_tpu_kernel_compiles_for_a_real_tpu(d, dtype, seq):
    """Mosaic lowering and a libtpu compile for a v5e (no TPU needed): a head of 128 lanes read in place
    (bf16, the suite's shape) and a head of 64 through the head-major copy (float32, a partial query
    tile, top_k 16). Catches: a block shape or op Mosaic rejects (interpret mode accepts them)."""
    arg, dtype = v5e_arg(), jnp.dtype(dtype)
    n, picks = seq // 512, 15
    route = jax.jit(lambda q, st, m, lo, hi: routing_tpu(q, st, m, lo, hi, picks, seq=seq, key_dtype=dtype))
    lowered = route.lower(
        arg((1, seq, 4, d), dtype),
        arg((1, n), jnp.int32),
        arg((1, n, 2, d), jnp.float32),
        arg((1, seq), jnp.int32),
        arg((1, seq), jnp.int32),
    )
    assert lowered.as_text().count("tpu_custom_call") == 1
    lowered.compile()


MGPU_CASES = {
    # name: (batch, seq, q_heads, kv_heads, block, top_k, segment lengths or None); bf16, head dim 64
    "packed_documents": (2, 128, 2, 1, 8, 4, [50, 78]),
    "gqa_partial_last_block": (1, 192, 4, 2, 40, 3, None),
    "top_k_covers_every_block": (1, 128, 2, 1, 8, 12, [80, 48]),
    "top_k_16_two_mean_tiles": (1, 640, 2, 1, 8, 16, [100, 540]),  # 80 full blocks: two tiles of 64
}


@pytest.mark.parametrize("name", quick_or_slow(list(MGPU_CASES), {"packed_documents"}))
def test_mosaic_gpu_kernel_picks_equal_xla(name):
    """The Mosaic GPU kernel (what a Hopper GPU runs for bf16 and a head dim of 64 or 128), in its
    interpreter, slot for slot against moba_routing: packed documents, GQA with a partial last block,
    -1 slots, top_k 16 over two tiles of means. Catches: what the Triton kernel's test catches, in
    this kernel's wgmma operands, TMA slices and float-carried starts."""
    b, s, hq, hkv, c, top_k, lengths = MGPU_CASES[name]
    q, k, _ = rand_qkv(7, b, s, hq, hkv, 64, dtype=jnp.bfloat16)
    seg = None if lengths is None else segments(b, lengths)
    want, got = both(q, k, "gpu_mosaic", uses="moba_routing_mgpu", block_size=c, top_k=top_k, segment_ids=seg)
    np.testing.assert_array_equal(got, want)
    assert (want >= 0).any() and (name != "top_k_covers_every_block" or (want == -1).any())


def test_mosaic_gpu_kernel_ties_and_context_shard():
    """Identical block means (every candidate ties: the earliest blocks, in order) and a context
    shard's queries (q_index), through the Mosaic GPU kernel. Catches: ties to the later block, query
    positions taken as 0..T-1."""
    ones = jnp.ones((1, 128, 2, 64), jnp.bfloat16)
    want, got = both(ones, ones[:, :, :1], "gpu_mosaic", uses="moba_routing_mgpu", block_size=8, top_k=5)
    np.testing.assert_array_equal(got, want)
    assert got[0, 127, 0].tolist() == [0, 8, 16, 24]
    q, k, _ = rand_qkv(5, 1, 256, 2, 1, 64, dtype=jnp.bfloat16)
    q_index = jnp.concatenate([jnp.arange(0, 64), jnp.arange(192, 256)])[None]
    kw = dict(block_size=16, top_k=4, segment_ids=segments(1, [90, 166]), q_index=q_index)
    want, got = both(q[:, q_index[0]], k, "gpu_mosaic", uses="moba_routing_mgpu", **kw)
    np.testing.assert_array_equal(got, want)


def test_moba_attention_routing_follows_the_verified_table(verified):
    """moba_attention traced for a GPU (an H100/H200 when none is at hand), bf16, head dim 64: pallas_gpu
    and auto gate in XLA while no routing kernel is verified, with the Mosaic GPU kernel once it is
    (Triton's when only Triton's is); pallas_triton and pallas_mosaic gate with the kernel they name.
    Catches: an unverified kernel on the default path, the table not reaching the routing."""
    q, k, v = rand_qkv(6, 1, 128, 2, 1, 64, dtype=jnp.bfloat16)
    attend = lambda impl: jax.jit(lambda q, k, v: moba_attention(q, k, v, block_size=64, top_k=3, impl=impl))
    jaxpr = lambda impl: str(jax.make_jaxpr(attend(impl))(q, k, v))
    kernels = lambda impl: {n for n in ("moba_routing_gpu", "moba_routing_mgpu") if n in jaxpr(impl)}
    with tracing_for("gpu"):
        verified()
        assert kernels("pallas_gpu") == kernels("auto") == set()
        assert kernels("pallas_triton") == {"moba_routing_gpu"}
        assert kernels("pallas_mosaic") == {"moba_routing_mgpu"}
        verified(("moba_routing", "triton"))
        assert kernels("pallas_gpu") == {"moba_routing_gpu"}
        verified(("moba_routing", "triton"), ("moba_routing", "mosaic"))
        assert kernels("auto") == {"moba_routing_mgpu"}


def test_mosaic_gpu_kernel_lowers_for_cuda():
    """The Mosaic GPU kernel lowers for CUDA (jax.export, no GPU) at the suite's head shape, top_k 3
    and 16. Catches: a layout, transform or op Mosaic GPU's lowering rejects (its interpreter accepts
    them)."""
    b, t, hq, d, n = 1, 2048, 4, 128, 4
    s = jax.ShapeDtypeStruct
    for picks in (2, 15):
        route = functools.partial(routing_mgpu, picks=picks, seq=t, key_dtype=jnp.bfloat16)
        with gpu_lowering_target():
            exported = jax.export.export(jax.jit(route), platforms=["cuda"])(
                s((b, t, hq, d), jnp.bfloat16),
                s((b, n), jnp.int32),
                s((b, n, 2, d), jnp.float32),
                s((b, t), jnp.int32),
                s((b, t), jnp.int32),
            )
        module = exported.mlir_module()
        assert "mosaic_gpu" in module and "xla.gpu.triton" not in module


def test_routing_kernel_names_are_checked():
    """A routing kernel name that is not one gets one line naming the allowed ones; the Mosaic GPU
    kernel asked for by name with shapes it does not take says what it takes."""
    q, k, _ = rand_qkv(1, 1, 32, 2, 1, 16)
    with pytest.raises(ValueError, match="routing kernel must be"):
        moba_routing(q, k, block_size=8, top_k=3, kernel="cuda")
    with pytest.raises(ValueError, match="Mosaic GPU routing kernel takes bf16/f16"):
        moba_routing(q, k, block_size=8, top_k=3, kernel="gpu_mosaic", interpret=True)
