"""The MoBA decode kernel on Mosaic GPU (pallas_kernels/moba/mgpu_decode.py), interpreted on CPU:
against the XLA step and the Triton kernel it replaces on Hopper, with the interpreter's race
detector, lowered for CUDA, and the GPU dispatch between the two kernels."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import mosaic_gpu as plgpu

from effattn_jax.ops.cache import kv_view
from effattn_jax.ops.moba_decode import (
    empty_block_means,
    moba_decode_attention,
    prefill_block_means,
    select_blocks,
)
from effattn_jax.ops.platform import tracing_for
from pallas_kernels.common import gpu_lowering_target
from pallas_kernels.moba import mgpu_decode
from pallas_kernels.moba.gpu_decode import moba_decode_gpu
from pallas_kernels.moba.mgpu_decode import moba_decode_mgpu

BF16 = dict(atol=1e-2, rtol=1e-2)  # bf16 output (the kernels round their result to q's dtype)


def _case(length, block, d=64, dtype=jnp.bfloat16):
    """A single-token step: GQA (4 query heads on 2 KV heads), head-major caches, row 0 near the
    cache's end with every pick used, row 1 in its second block with two of three picks unused.
    -> (step(impl), the kernel's arguments)."""
    k, v = (jax.random.normal(jax.random.key(i), (2, 2, length, d)).astype(dtype) for i in range(2))
    q = jax.random.normal(jax.random.key(2), (2, 1, 4, d)).astype(dtype)
    means = prefill_block_means(
        empty_block_means(2, length, 2, d, block),
        jnp.swapaxes(k, 1, 2),
        length,
        block_size=block,
        dtype=dtype,
    )
    positions = jnp.array([[length - 10], [block + 5]])
    view = kv_view(q, k, v)
    kw = dict(block_size=block, top_k=4)
    starts, lo, hi, size = select_blocks(view, means, positions, **kw)
    args = (q[:, 0], k, v, starts[:, 0], lo[:, 0], hi[:, 0], size, 0.25)
    return lambda impl: moba_decode_attention(view, means, positions, **kw, scale=0.25, impl=impl)[:, 0], args


@pytest.mark.parametrize(
    "length, block, d",
    [
        (512, 128, 64),
        pytest.param(320, 128, 64, marks=pytest.mark.slow),
        pytest.param(512, 128, 128, marks=pytest.mark.slow),
    ],
    ids=["aligned", "short_cache", "d128"],
)
def test_kernel_matches_xla_and_triton(length, block, d):
    """Through the dispatch (moba.impl=pallas_mosaic, interpreted) and called directly in whole blocks
    and in 2 pieces of 64 slots: the Mosaic kernel equals the XLA step and the Triton kernel. The
    second case's cache ends inside the last block, so the own window moves back; head dim 128 the
    third. Catches: an unused pick (hi < lo) attended, a piece with no slot that weighs in the
    combine, a query head reading another KV head, the padded query rows leaking into row 0."""
    step, args = _case(length, block, d)
    assert "moba_decode_mgpu" in str(jax.make_jaxpr(lambda: step("pallas_mosaic"))())  # the kernel ran
    want = step("xla").astype(jnp.float32)
    np.testing.assert_allclose(step("pallas_mosaic").astype(jnp.float32), want, **BF16)
    for pieces in (1, 2):
        got = moba_decode_mgpu(*args, interpret=True, num_pieces=pieces).astype(jnp.float32)
        np.testing.assert_allclose(got, want, **BF16)
        triton = moba_decode_gpu(*args, interpret=True, num_pieces=pieces).astype(jnp.float32)
        np.testing.assert_allclose(got, triton, **BF16)


@pytest.mark.skipif(
    "on_race" not in plgpu.InterpretGPUParams.__dataclass_fields__,
    reason=f"jax {jax.__version__}: InterpretGPUParams has no on_race, so its race detector cannot raise",
)
def test_no_races_in_the_ring(monkeypatch):
    """The interpreter's race detector over a ring that wraps (a 256-slot block in one piece: 4 tiles
    through 2 SMEM slots). Catches: a slot refilled before its matmuls finished (tried: issuing the
    refill before the step's p @ V raises here)."""
    monkeypatch.setattr(
        mgpu_decode,
        "mosaic_gpu_interpret",
        lambda interpret: plgpu.InterpretGPUParams(detect_races=True, on_race="raise"),
    )
    monkeypatch.setattr(mgpu_decode, "MAX_STAGES", 2)
    step, args = _case(512, 256)
    got = moba_decode_mgpu(*args, interpret=True, num_pieces=1).astype(jnp.float32)
    np.testing.assert_allclose(got, step("xla").astype(jnp.float32), **BF16)


def test_supports_says_why_not():
    """What the kernel refuses, each with one line naming it (the dispatch then takes Triton)."""
    ok = dict(head_dim=128, v_head_dim=128, size=512, length=32768, dtype=jnp.bfloat16)
    assert mgpu_decode.supports(**ok) is None
    for change, words in [
        (dict(dtype=jnp.float32), "bfloat16 or float16"),
        (dict(head_dim=96), "head dim"),
        (dict(v_head_dim=512), "value head dim"),
        (dict(size=96), "blocks of a multiple of 64"),
        (dict(length=4100), "cache length"),
    ]:
        reason = mgpu_decode.supports(**(ok | change))
        assert reason is not None and words in reason and "\n" not in reason, change


def _export(fn, d, length, dtype=jnp.bfloat16):
    """fn(q, k, v, starts, lo, hi) exported for CUDA (an H200): batch 2, 8 query heads on 2 KV heads,
    3 blocks of 512 slots. The module's GPU kernel custom calls ("mosaic"/"triton")."""
    sd = jax.ShapeDtypeStruct
    tables = [sd((2, 8, 3), jnp.int32)] * 3
    cache = sd((2, 2, length, d), dtype)
    triton = jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")
    with gpu_lowering_target():
        exported = jax.export.export(jax.jit(fn), platforms=["cuda"], disabled_checks=[triton])(
            sd((2, 8, d), dtype), cache, cache, *tables
        )
    targets = re.findall(r"custom_call @([\w$.]+)", exported.mlir_module())
    return {kind for kind in ("mosaic", "triton") for t in targets if kind in t}


@pytest.mark.parametrize("d", [64, 128])
def test_lowers_for_cuda_within_its_smem_count(d):
    """jax.export lowers the kernel to Mosaic GPU (bf16, whole blocks of 512 over a 32K cache: 4 ring
    slots), under a shared-memory limit of `smem_bytes` and not one byte below it. Catches what the
    interpreter forgives (a TMA slice not on whole tiles, a layout wgmma cannot take) and an estimate
    that under-counts."""
    from jax.experimental.mosaic.gpu.core import artificial_shared_memory_limit

    kernel = lambda q, k, v, *tables: moba_decode_mgpu(q, k, v, *tables, 512, 0.125, num_pieces=1)
    need = mgpu_decode.smem_bytes(d, d, 2, mgpu_decode.MAX_STAGES)
    jax.clear_caches()  # a kernel lowered before is not lowered (nor checked) again
    with artificial_shared_memory_limit(need - 1), pytest.raises(ValueError, match="shared memory"):
        _export(kernel, d, 32768)
    jax.clear_caches()
    with artificial_shared_memory_limit(need):
        assert _export(kernel, d, 32768) == {"mosaic"}


def test_dispatch_exports_mosaic_on_hopper_and_triton_where_it_refuses(verified):
    """The decode op traced for a GPU (an H200), both decode kernels listed as verified, exports the
    Mosaic kernel for bf16 and the Triton one for float32 (Mosaic refuses) and under pallas_triton;
    nothing listed, XLA; pallas_mosaic raises where Mosaic cannot run."""
    from effattn_jax.ops import moba_decode

    def op(impl):
        def step(q, k, v, starts, lo, hi):
            kernel = moba_decode.decode_kernel(kv_view(q[:, None], k, v), 512, impl)
            return kernel(q, k, v, starts, lo, hi, 512, 0.125)

        return step

    with tracing_for("cuda"):
        verified(("moba_decode", "mosaic"), ("moba_decode", "triton"))
        assert _export(op("pallas_gpu"), 128, 4096) == {"mosaic"}
        assert _export(op("auto"), 128, 4096) == {"mosaic"}
        assert _export(op("pallas_gpu"), 128, 4096, jnp.float32) == {"triton"}
        assert _export(op("pallas_triton"), 128, 4096) == {"triton"}
        verified()
        q, cache = jnp.zeros((2, 1, 8, 128), jnp.bfloat16), jnp.zeros((2, 2, 4096, 128), jnp.bfloat16)
        assert moba_decode.decode_kernel(kv_view(q, cache, cache), 512, "auto") is None
        with pytest.raises(ValueError, match="pallas_mosaic cannot run MoBA decode here: .*float32"):
            _export(op("pallas_mosaic"), 128, 4096, jnp.float32)
