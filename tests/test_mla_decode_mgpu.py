"""The split MLA decode kernel on Mosaic GPU (pallas_kernels/mla_decode/mgpu.py), interpreted on CPU:
against the XLA step and the Triton kernel it replaces on Hopper, inside a model's decode, and
lowered for CUDA at DeepSeek's shapes; and the GPU dispatch between the two kernels."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import TINY_MLA
from flax import nnx
from jax.experimental.pallas import mosaic_gpu as plgpu

from effattn_jax.config import load_config
from effattn_jax.model import Transformer, init_cache
from effattn_jax.ops.mla_decode import absorbed_attention
from effattn_jax.ops.platform import tracing_for
from pallas_kernels.common import gpu_lowering_target
from pallas_kernels.mla_decode import mgpu
from pallas_kernels.mla_decode.gpu import mla_decode_gpu
from pallas_kernels.mla_decode.mgpu import mla_decode_mgpu

BF16 = dict(atol=2e-2, rtol=2e-2)  # bf16 inputs, float32 accumulation, p rounded to bf16 for its matmul


def _inputs(heads, d, dr, length, batch=3, dtype=jnp.bfloat16, seed=1):
    keys = jax.random.split(jax.random.key(seed), 4)
    normal = lambda key, shape: jax.random.normal(key, shape).astype(dtype)
    return (
        normal(keys[0], (batch, 1, heads, d)),
        normal(keys[1], (batch, 1, heads, dr)),
        normal(keys[2], (batch, length, d)),
        normal(keys[3], (batch, length, dr)),
    )


@pytest.mark.parametrize("heads, d", [(16, 64), (128, 64), (16, 512)])
def test_slices_equal_xla_and_triton(heads, d):
    """328 slots in 3 slices of 128 (64-slot tiles), rows of lengths 10 (its later slices empty), 150
    (ending inside the second slice and inside a tile) and 328 (the last slice partial: its tile is read
    from the cache's last 64 slots, the 56 before the tile's start masked), at 16 heads (padded to one
    group of 64), 128 (two groups) and a 512-wide latent (two compute warpgroups of 256 columns each).
    Catches: a mask off by one, an empty slice that weighs in the combine, the clamped last tile's
    earlier slots counted twice, a group's or a warpgroup's columns swapped."""
    q_lat, q_rope, lat, kr = _inputs(heads, d, 64, 328)
    positions = jnp.array([[9], [149], [327]])
    scale = 0.3 if d == 64 else 0.1  # peaked scores: one slot more or less shows
    lengths = positions[:, 0] + 1
    want = absorbed_attention(q_lat, q_rope, lat, kr, positions, scale, "xla")[:, 0]
    assert mgpu.supports(heads=heads, d=d, dr=64, length=328, dtype=jnp.bfloat16) is None
    out = mla_decode_mgpu(q_lat[:, 0], q_rope[:, 0], lat, kr, lengths, scale, num_slices=3, interpret=True)
    np.testing.assert_allclose(out, want, **BF16)
    triton = mla_decode_gpu(q_lat[:, 0], q_rope[:, 0], lat, kr, lengths, scale, num_slices=3, interpret=True)
    np.testing.assert_allclose(out, triton, **BF16)


@pytest.mark.skipif(
    "on_race" not in plgpu.InterpretGPUParams.__dataclass_fields__,
    reason=f"jax {jax.__version__}: InterpretGPUParams has no on_race, so its race detector cannot raise",
)
def test_no_races_between_the_warpgroups():
    """The interpreter's race detector, latent 512 (two compute warpgroups, the first also issuing the
    copies), one slice of 328 slots: 6 steps through 2 ring slots, so the ring wraps. Catches:
    warpgroup 0 refilling a slot before both compute warpgroups released it (dropping its
    consumed-barrier wait)."""
    races = plgpu.InterpretGPUParams(detect_races=True, on_race="raise")
    q_lat, q_rope, lat, kr = _inputs(16, 512, 64, 328, batch=1)
    assert mgpu.stages_for(512, 64, 2) == 2
    out = mla_decode_mgpu(
        q_lat[:, 0], q_rope[:, 0], lat, kr, jnp.array([328]), 0.1, num_slices=1, interpret=races
    )
    want = absorbed_attention(q_lat, q_rope, lat, kr, jnp.array([[327]]), 0.1, "xla")[:, 0]
    np.testing.assert_allclose(out, want, **BF16)


@pytest.mark.parametrize("kind", ["mla", "eg_mla"])
def test_model_decode_equals_xla(kind):
    """A bf16 model (latent and EG-MLA gate 64, RoPE 64) prefills 11 tokens (XLA), then decodes
    single tokens with the Mosaic kernel (mla.decode_impl=pallas_mosaic) over a 72-slot cache, the
    two rows at different lengths; EG-MLA passes its c~. The steps are checked to contain the Mosaic
    kernel (a dispatch to Triton or XLA would not test it)."""
    widths = ["mla.kv_lora_rank=64", "mla.qk_rope_head_dim=64", "eg_mla.gate_dim=64", "model.dtype=bfloat16"]
    logits = {}
    for name in ("xla", "pallas_mosaic"):
        cfg = load_config(None, TINY_MLA + widths + [f"attention.kind={kind}", f"mla.decode_impl={name}"])
        model = Transformer(cfg, rngs=nnx.Rngs(0))
        graphdef, params = nnx.split(model)
        decode = jax.jit(lambda p, t, pos, c, g=graphdef: nnx.merge(g, p).decode(t, pos, c))
        tokens = jnp.asarray(np.random.default_rng(0).integers(0, 128, (2, 14)))
        caches = init_cache(model, 2, 72, jnp.bfloat16)
        out, caches = decode(params, tokens[:, :11], jnp.broadcast_to(jnp.arange(11), (2, 11)), caches)
        steps = []
        for t in range(11, 14):
            step = (params, tokens[:, t : t + 1], jnp.array([[t], [t + 50]]), caches)
            assert ("mla_decode_mgpu" in str(jax.make_jaxpr(decode)(*step))) == (name != "xla")
            out, caches = decode(*step)
            steps.append(out.astype(jnp.float32))
        logits[name] = jnp.concatenate(steps, axis=1)
    np.testing.assert_allclose(logits["pallas_mosaic"], logits["xla"], atol=5e-2, rtol=5e-2)


def test_supports_says_why_not():
    """What the kernel refuses, each with one line naming it (the dispatch then takes Triton)."""
    ok = dict(heads=16, d=512, dr=64, length=32768, dtype=jnp.bfloat16)
    assert mgpu.supports(**ok) is None
    for change, words in [
        (dict(dtype=jnp.float32), "bfloat16 or float16"),
        (dict(q_dtype=jnp.float32), "queries in the cache's dtype"),
        (dict(d=320), "latent width"),
        (dict(dr=32), "RoPE key width"),
        (dict(length=4100), "cache length"),
        (dict(length=32), "cache length"),
        (dict(d=2048), "shared memory"),
    ]:
        reason = mgpu.supports(**(ok | change))
        assert reason is not None and words in reason and "\n" not in reason, change


@pytest.mark.parametrize("d", [512, 256])
def test_smem_estimate_is_what_the_lowering_allocates(d):
    """smem_bytes is Mosaic GPU's own count, to the byte: the kernel lowers under a shared-memory
    limit of its estimate and fails one byte below it (latent 512: 2 ring slots; 256: 4). Catches: a
    buffer left out of the estimate (supports would pass a shape the compiler then refuses)."""
    from jax.experimental.mosaic.gpu.core import artificial_shared_memory_limit

    stages = mgpu.stages_for(d, 64, 2)
    assert stages == (2 if d == 512 else 4)
    need = mgpu.smem_bytes(d, 64, 2, stages)
    assert need <= 232_448
    jax.clear_caches()  # a kernel lowered before is not lowered (nor checked) again
    with artificial_shared_memory_limit(need - 1), pytest.raises(ValueError, match="shared memory"):
        _export(64, d, 1024)
    jax.clear_caches()
    with artificial_shared_memory_limit(need):
        _export(64, d, 1024)


def _export(heads, d, length, fn=None):
    """`fn` (default: the Mosaic kernel) exported for CUDA (an H200), bf16, batch 2: the module's text."""
    arg = jax.ShapeDtypeStruct
    fn = fn or (lambda ql, qr, lat, kr, lens: mla_decode_mgpu(ql, qr, lat, kr, lens, 0.1))
    triton = jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")
    with gpu_lowering_target():
        exported = jax.export.export(jax.jit(fn), platforms=["cuda"], disabled_checks=[triton])(
            arg((2, heads, d), jnp.bfloat16),
            arg((2, heads, 64), jnp.bfloat16),
            arg((2, length, d), jnp.bfloat16),
            arg((2, length, 64), jnp.bfloat16),
            arg((2,), jnp.int32),
        )
    return exported.mlir_module()


def _kernels(text):
    """The GPU kernel custom calls of a lowered module: "mosaic" and/or "triton"."""
    targets = re.findall(r"custom_call @([\w$.]+)", text)
    return {kind for kind in ("mosaic", "triton") for t in targets if kind in t}


@pytest.mark.parametrize("heads", [16, 128])
def test_lowers_for_cuda(heads):
    """jax.export lowers the kernel to Mosaic GPU at DeepSeek-V2/V3's latent 512 + RoPE 64, bf16,
    a 32K cache, 16 heads (one padded group) and 128 (two). Catches what the interpreter forgives: a
    TMA slice not on whole tiles, a layout the warpgroup matmuls cannot take, SMEM over an H200's."""
    text = _export(heads, 512, 32768)
    assert _kernels(text) == {"mosaic"} and "mosaic_gpu" in text


def test_dispatch_exports_mosaic_on_hopper_and_triton_where_it_refuses(verified):
    """The op traced for a GPU (an H200), both decode kernels listed as verified: the Mosaic kernel for
    a bf16 cache of 32K slots, the Triton one for a cache length Mosaic refuses (4100, not a multiple
    of 8), XLA there when only Mosaic's is listed; pallas_triton takes Triton, pallas_mosaic raises
    where Mosaic cannot run."""

    def op(impl):
        def step(ql, qr, lat, kr, lens):
            return absorbed_attention(ql[:, None], qr[:, None], lat, kr, lens[:, None] - 1, 0.1, impl)

        return step

    with tracing_for("cuda"):
        verified(("mla_decode", "mosaic"), ("mla_decode", "triton"))
        for impl, length, kernels in [
            ("auto", 32768, {"mosaic"}),
            ("pallas_gpu", 4100, {"triton"}),
            ("pallas_triton", 32768, {"triton"}),
        ]:
            assert _kernels(_export(16, 512, length, op(impl))) == kernels, (impl, length)
        verified(("mla_decode", "mosaic"))
        assert _kernels(_export(16, 512, 4100, op("pallas_gpu"))) == set()
        with pytest.raises(ValueError, match="pallas_mosaic cannot run MLA decode here: .*cache length"):
            _export(16, 512, 4100, op("pallas_mosaic"))


def test_interpreted_dispatch_follows_the_table_and_the_names(verified):
    """On a CPU, pallas_gpu interprets what the table lists (XLA when nothing is), pallas_mosaic and
    pallas_triton the kernel they name."""
    q_lat, q_rope, lat, kr = _inputs(16, 64, 64, 64, batch=1)
    pos = jnp.array([[40]])
    jaxpr = lambda impl: str(
        jax.make_jaxpr(lambda: absorbed_attention(q_lat, q_rope, lat, kr, pos, 0.3, impl))()
    )
    verified()
    assert "mla_decode_gpu" not in jaxpr("pallas_gpu") and "mla_decode_mgpu" not in jaxpr("pallas_gpu")
    verified(("mla_decode", "triton"))
    assert "mla_decode_gpu" in jaxpr("pallas_gpu") and "mla_decode_mgpu" not in jaxpr("pallas_gpu")
    assert "mla_decode_mgpu" in jaxpr("pallas_mosaic")
    assert "mla_decode_gpu" in jaxpr("pallas_triton")
