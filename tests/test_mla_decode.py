"""The absorbed MLA decode kernel (one pass over the latent for all heads): interpreted equal
to the XLA path inside a model's decode, and compiled ahead of time for a real TPU."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import TINY_MLA, v5e_arg
from flax import nnx

from effattn_jax.config import load_config
from effattn_jax.model import Transformer, init_cache
from effattn_jax.ops.mla_decode import absorbed_attention
from effattn_jax.ops.platform import tracing_for
from pallas_kernels.common import gpu_lowering_target
from pallas_kernels.mla_decode import gpu as mla_gpu
from pallas_kernels.mla_decode.gpu import mla_decode_gpu, slices
from pallas_kernels.mla_decode.tpu import mla_decode_tpu


@pytest.mark.parametrize(
    "kind, impl",
    [("mla", "pallas_tpu"), ("eg_mla", "pallas_tpu"), ("mla", "pallas_triton"), ("eg_mla", "pallas_triton")],
)
def test_kernel_decode_equals_xla_decode(kind, impl, monkeypatch):
    """Prefill 11 tokens (XLA), then single-token steps (the kernel's case) over a 40-slot
    cache, the rows at different lengths; EG-MLA passes its c~. The GPU kernel, with 16-slot
    tiles and slices, splits the cache in 2 slices of 32: one row ends in the first (the second
    empty), the other inside the second. The kernel's steps are checked to contain its pallas_call
    (a dispatch that fell back to XLA would compare XLA with itself)."""
    monkeypatch.setattr(mla_gpu, "TILE", 16)
    monkeypatch.setattr(mla_gpu, "MIN_SLICE", 16)
    assert mla_gpu.slices(2, 1, 40, 16, 132) == (2, 32)
    logits = {}
    for name in ("xla", impl):
        cfg = load_config(None, TINY_MLA + [f"attention.kind={kind}", f"mla.decode_impl={name}"])
        model = Transformer(cfg, rngs=nnx.Rngs(0))
        graphdef, params = nnx.split(model)
        decode = jax.jit(lambda p, t, pos, c, g=graphdef: nnx.merge(g, p).decode(t, pos, c))
        tokens = jnp.asarray(np.random.default_rng(0).integers(0, 128, (2, 16)))
        caches = init_cache(model, 2, 40)
        out, caches = decode(params, tokens[:, :11], jnp.broadcast_to(jnp.arange(11), (2, 11)), caches)
        steps = []
        for t in range(11, 16):
            step = (params, tokens[:, t : t + 1], jnp.array([[t], [t + 20]]), caches)
            assert ("mla_decode" in str(jax.make_jaxpr(decode)(*step))) == (name != "xla")
            out, caches = decode(*step)
            steps.append(out)
        logits[name] = jnp.concatenate(steps, axis=1)
    np.testing.assert_allclose(logits[impl], logits["xla"], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "kernel, interpret", [(mla_decode_tpu, True), (mla_decode_tpu, "tpu"), (mla_decode_gpu, True)]
)
def test_kernel_tiles_equal_xla(kernel, interpret):
    """Each kernel, 16-slot tiles over 40 slots: a partial last tile (masked), and a row whose length ends
    in the first tile (its later tiles are skipped). Catches: a mask of the last tile dropped, a skipped
    tile that still adds, a length off by one."""
    keys = jax.random.split(jax.random.key(0), 4)
    q_lat, q_rope = jax.random.normal(keys[0], (2, 1, 4, 16)), jax.random.normal(keys[1], (2, 1, 4, 8))
    lat, kr = jax.random.normal(keys[2], (2, 40, 16)), jax.random.normal(keys[3], (2, 40, 8))
    positions = jnp.array([[9], [39]])
    out = kernel(q_lat[:, 0], q_rope[:, 0], lat, kr, positions[:, 0] + 1, 0.3, tile=16, interpret=interpret)
    want = absorbed_attention(q_lat, q_rope, lat, kr, positions, 0.3, "xla")[:, 0]
    np.testing.assert_allclose(out, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("heads", [16, 128])
def test_gpu_kernel_slices_equal_xla(heads):
    """The GPU kernel split over the cache: 100 slots in 3 slices of 48 (16-slot tiles), rows of
    lengths 10 (its later slices empty), 57 (ending inside the second slice and inside a tile) and 100
    (the last slice partial, reaching past the cache), at 16 heads (one group) and 128 (in groups of
    32). Catches: an empty slice that still weighs in the combine, a slice that reads past the row's
    length or its own end, a combine weighted without the softmax sums, a head group's slices swapped."""
    keys = jax.random.split(jax.random.key(1), 4)
    q_lat, q_rope = (
        jax.random.normal(keys[0], (3, 1, heads, 16)),
        jax.random.normal(keys[1], (3, 1, heads, 8)),
    )
    lat, kr = jax.random.normal(keys[2], (3, 100, 16)), jax.random.normal(keys[3], (3, 100, 8))
    positions = jnp.array([[9], [56], [99]])
    want = absorbed_attention(q_lat, q_rope, lat, kr, positions, 0.3, "xla")[:, 0]
    for group in (16, 32) if heads == 128 else (16,):
        out = mla_decode_gpu(
            q_lat[:, 0], q_rope[:, 0], lat, kr, positions[:, 0] + 1, 0.3,
            tile=16, group=group, num_slices=3, interpret=True,
        )  # fmt: skip
        np.testing.assert_allclose(out, want, atol=1e-5, rtol=1e-5)


def test_gpu_slices_fill_the_multiprocessors():
    """The slice count: a batch of one at 32K over 132 multiprocessors takes 128 slices of 256 slots
    (every SM busy once), batch 16 takes 9, a short cache or a full batch one; slices are whole tiles
    and cover the cache."""
    assert slices(1, 1, 32768, 64, 132) == (128, 256)
    assert slices(16, 1, 32768, 64, 132) == (9, 3648)
    assert slices(1, 4, 32768, 32, 132) == (32, 1024)
    assert slices(1, 1, 300, 64, 132) == (1, 320)
    assert slices(256, 1, 32768, 64, 132) == (1, 32768)
    for length, tile in [(5000, 16), (4100, 64)]:
        count, size = slices(1, 1, length, tile, 108)
        assert size % tile == 0 and (count - 1) * size < length <= count * size


@pytest.mark.slow
def test_kernel_compiles_for_a_real_tpu():
    """Mosaic lowering and a libtpu compile (no TPU needed): bf16, 12 heads, MLA-Base's latent
    width 256 with a 64-wide RoPE key, a cache length that is not a multiple of the tile. Catches:
    a block shape or op Mosaic rejects (interpret mode accepts it)."""
    arg = v5e_arg()
    step = jax.jit(lambda ql, qr, lat, kr, lens: mla_decode_tpu(ql, qr, lat, kr, lens, 0.1))
    lowered = step.lower(
        arg((2, 12, 256)), arg((2, 12, 64)), arg((2, 4100, 256)), arg((2, 4100, 64)), arg((2,), jnp.int32)
    )
    assert lowered.as_text().count("tpu_custom_call") == 1
    lowered.compile()


@pytest.mark.parametrize("heads, d", [(12, 256), (128, 512)])
def test_gpu_kernel_lowers_for_cuda(heads, d):
    """jax.export lowers the GPU kernel to Triton: bf16, 12 heads (padded to 16) with d 256 + 64, and
    DeepSeek-V2/V3's 128 heads with d 512 + 64 (in head groups that fit an H100/H200). Catches: an op the
    Triton lowering rejects, a non-power-of-two block, a head group's block index out of the grid."""
    triton = jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")
    arg = jax.ShapeDtypeStruct
    step = jax.jit(lambda ql, qr, lat, kr, lens: mla_decode_gpu(ql, qr, lat, kr, lens, 0.1))
    with gpu_lowering_target():
        exported = jax.export.export(step, platforms=["cuda"], disabled_checks=[triton])(
            arg((2, heads, d), jnp.bfloat16),
            arg((2, heads, 64), jnp.bfloat16),
            arg((2, 4100, d), jnp.bfloat16),
            arg((2, 4100, 64), jnp.bfloat16),
            arg((2,), jnp.int32),
        )
    assert re.findall(r'name = "(mla_\w+_gpu)"', exported.mlir_module()) == ["mla_decode_gpu"]


def test_gpu_dispatch_follows_the_verified_table(verified):
    """Traced for a GPU, float32 (the Triton kernel's case): "auto" and "pallas_gpu" take XLA until the
    table lists the Triton MLA decode kernel, then the kernel, except under "auto" where the entry's
    `xla_faster` covers the step's heads (equal), batch and length (at most); "pallas_triton" runs the
    kernel regardless."""
    keys = jax.random.split(jax.random.key(0), 4)
    q_lat, q_rope = jax.random.normal(keys[0], (2, 1, 4, 16)), jax.random.normal(keys[1], (2, 1, 4, 8))
    lat, kr = jax.random.normal(keys[2], (2, 40, 16)), jax.random.normal(keys[3], (2, 40, 8))
    pos = jnp.array([[9], [39]])
    kernel_ran = lambda impl: (
        "mla_decode_gpu"
        in str(jax.make_jaxpr(lambda: absorbed_attention(q_lat, q_rope, lat, kr, pos, 0.3, impl))())
    )
    with tracing_for("gpu"):
        verified()
        assert not kernel_ran("auto") and not kernel_ran("pallas_gpu") and kernel_ran("pallas_triton")
        verified(("mla_decode", "triton"))
        assert kernel_ran("auto") and kernel_ran("pallas_gpu")
        for bound, xla in [
            (dict(heads=4, batch=2, length=40), True),
            (dict(heads=4, batch=1, length=40), False),
            (dict(heads=8, batch=2, length=40), False),
            (dict(heads=4, batch=2, length=39), False),
        ]:
            verified(("mla_decode", "triton"), xla_faster=(bound,))
            assert kernel_ran("auto") != xla, bound
            assert kernel_ran("pallas_gpu")
