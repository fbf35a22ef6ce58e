"""MoBA decoding over the cache: equal to a full MoBA forward (packed documents, GQA, top_k 1,
prompts ending mid-block and on a block boundary, prefill and multi-token steps), with no
[T, L]-sized array in a long prefill and nothing context-sized read by a step."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import TINY_MLA, jaxpr_outputs, v5e_arg
from flax import nnx

from effattn_jax.config import load_config
from effattn_jax.model import Transformer, init_cache
from effattn_jax.ops.cache import kv_view
from effattn_jax.ops.moba_decode import (
    empty_block_means,
    moba_decode_attention,
    prefill_block_means,
    select_blocks,
)
from effattn_jax.ops.platform import tracing_for
from pallas_kernels import registry
from pallas_kernels.common import gpu_lowering_target
from pallas_kernels.moba import gpu_decode
from pallas_kernels.moba.gpu_decode import moba_decode_gpu

BLOCK = 4


def model_for(*overrides):
    cfg = load_config(None, TINY_MLA + ["attention.core=moba", f"moba.block_size={BLOCK}", *overrides])
    return Transformer(cfg, rngs=nnx.Rngs(0))


@pytest.mark.slow
@pytest.mark.parametrize(
    "overrides",
    [
        ["moba.top_k=3", "model.num_kv_heads=2"],
        ["moba.top_k=1"],
        ["moba.top_k=3", "attention.kind=mla"],
        ["moba.top_k=2", "attention.kind=eg_mla", "eg_mla.gate_at=latent"],
        ["moba.top_k=2", "attention.kind=eg_mla", "eg_mla.gate_at=heads"],
    ],
    ids=["gqa_top3", "top1", "mla_top3", "eg_mla_latent", "eg_mla_heads"],
)
def test_decode_equals_packed_forward(overrides):
    """Two documents packed in one row for the forward; decoded as two rows of one batch: a
    right-padded prefill (document A's prompt of 4 tokens ends on a block boundary, B's of 6
    mid-block, so A's padding slots are overwritten later), a 5-token step at an offset
    (completing a block the same call's later queries may select), then single tokens."""
    model = model_for(*overrides)
    la, lb = 17, 19
    rng = np.random.default_rng(0)
    docs = [rng.integers(0, 128, la), rng.integers(0, 128, lb)]
    packed = np.concatenate(docs)[None]
    seg = np.repeat([1, 2], [la, lb])[None]
    graphdef, params = nnx.split(model)
    forward = jax.jit(lambda p, t, s: nnx.merge(graphdef, p)(t, s))
    decode = jax.jit(
        lambda p, t, pos, c, prefill: nnx.merge(graphdef, p).decode(t, pos, c, prefill=prefill),
        static_argnames="prefill",
    )
    full = np.asarray(forward(params, jnp.asarray(packed), jnp.asarray(seg)))[0]
    want = [full[:la], full[la:]]

    rows = np.zeros((2, 24), np.int32)
    rows[0, :la], rows[1, :lb] = docs
    caches = init_cache(model, 2, 24)
    got = [[], []]

    def run(start, ends, prefill=False):
        t = max(ends) - start[0] if prefill else ends[0] - start[0]
        pos = np.stack([np.arange(s, s + t) for s in start]).astype(np.int32)
        tokens = np.take_along_axis(rows, pos, axis=1)
        logits, new = decode(params, jnp.asarray(tokens), jnp.asarray(pos), caches, prefill=prefill)
        for r in range(2):  # keep each row's real positions only
            got[r].extend(np.asarray(logits[r, : ends[r] - start[r]]))
        return new

    caches = run([0, 0], [4, 6], prefill=True)
    caches = run([4, 6], [9, 11])
    for step in range(8):
        caches = run([9 + step, 11 + step], [10 + step, 12 + step])
    np.testing.assert_allclose(np.stack(got[0]), want[0][:17], atol=1e-4, rtol=1e-4)
    np.testing.assert_allclose(np.stack(got[1]), want[1][:19], atol=1e-4, rtol=1e-4)


CACHE_WRITES = ("scatter", "scatter-add", "dynamic_update_slice")


def _decode_shapes(model, t, length, prefill):
    caches = init_cache(model, 1, length)
    tokens = jnp.zeros((1, t), jnp.int32)
    positions = jnp.arange(t)[None] + (0 if prefill else length - t)
    fn = lambda caches: model.decode(tokens, positions, caches, prefill=prefill)[0]
    outputs = jaxpr_outputs(jax.make_jaxpr(fn)(caches).jaxpr)
    return [(p, s) for p, s in outputs if p not in CACHE_WRITES]  # the cache writes are the cache


def test_long_prefill_holds_no_prompt_by_prompt_array():
    """A 16K-token prefill runs the training op: its largest intermediate (the selected blocks'
    scores, T * Hq * top_k * C at most) grows linearly with the prompt, never as [T, L]."""

    def largest(t):
        model = model_for("moba.top_k=3", "moba.block_size=512", f"data.seq_len={t}")
        return max(np.prod(s, dtype=np.int64) for _, s in _decode_shapes(model, t, t, True))

    big = largest(16384)
    assert big <= 16384 * 4 * 3 * 512 and big / largest(4096) <= 5, big


@pytest.mark.parametrize("kind", ["mha", "mla", "eg_mla"])
def test_a_step_reads_only_its_blocks(kind):
    """A single-token step over a 4,096-slot cache: no intermediate has the cache's length (the
    selected blocks are gathered, the gate reads one mean per block; MLA expands only the
    gathered latent rows)."""
    kinds = {
        "mha": ["model.num_kv_heads=2"],
        "mla": ["attention.kind=mla"],
        "eg_mla": ["attention.kind=eg_mla"],
    }
    model = model_for("moba.top_k=3", "data.seq_len=4096", *kinds[kind])
    shapes = _decode_shapes(model, 1, 4096, False)
    assert shapes and not [(p, s) for p, s in shapes if 4096 in s]
    dense = Transformer(load_config(None, TINY_MLA + ["data.seq_len=4096", *kinds[kind]]), rngs=nnx.Rngs(0))
    assert [s for _, s in _decode_shapes(dense, 1, 4096, False) if 4096 in s]  # the check can fail


def _kernel_inputs(length, block):
    """A single-token step's view, block means and positions: GQA (4 query heads on 2 KV heads),
    head-major caches, row 0 with every pick used and row 1 with two of its three picks unused."""
    d = 16
    k, v = (jax.random.normal(jax.random.key(i), (2, 2, length, d)) for i in range(2))
    q = jax.random.normal(jax.random.key(2), (2, 1, 4, d))
    means = prefill_block_means(
        empty_block_means(2, length, 2, d, block),
        jnp.swapaxes(k, 1, 2),
        length,
        block_size=block,
        dtype=k.dtype,
    )
    return kv_view(q, k, v), means, jnp.array([[length - 10], [block + 5]])


def _kernel_case(length, block):
    """The step of _kernel_inputs, by `moba.impl`."""
    view, means, positions = _kernel_inputs(length, block)
    return lambda impl: moba_decode_attention(
        view, means, positions, block_size=block, top_k=4, scale=0.25, impl=impl
    )


def _tpu_interpreter_step(length, block):
    """The step of _kernel_inputs through the registry's TPU decode kernel in the TPU interpreter."""
    view, means, positions = _kernel_inputs(length, block)
    starts, lo, hi, size = select_blocks(view, means, positions, block_size=block, top_k=4)
    tables = (x[:, 0] for x in (starts, lo, hi))
    kernel = registry.kernel("moba", "decode", "tpu")
    return kernel(view.q[:, 0], *view.caches, *tables, size, 0.25, interpret="tpu")[:, None]


@pytest.mark.parametrize("interpret", ["pallas_tpu", "tpu_interpreter"])
@pytest.mark.parametrize("length, block", [(160, 32), (96, 64)], ids=["aligned", "short_last_block"])
def test_tpu_decode_kernel_matches_xla(length, block, interpret):
    """The TPU kernel (interpreted: plain, and the TPU interpreter) equals the XLA step. The second case's
    cache ends inside the last block, so the own window moves back by half a block. Catches: a block start
    not moved back at a short cache, an unused pick (hi < lo) attended, a query head reading another KV
    head."""
    step = _kernel_case(length, block)
    if interpret == "tpu_interpreter":
        got = _tpu_interpreter_step(length, block)
    else:
        assert "moba_decode_tpu" in str(jax.make_jaxpr(lambda: step("pallas_tpu"))())  # the kernel ran
        got = step("pallas_tpu")
    np.testing.assert_allclose(got, step("xla"), atol=1e-5, rtol=1e-5)


@pytest.mark.slow
def test_tpu_decode_kernel_compiles_for_a_real_tpu():
    """Mosaic lowering and a libtpu compile (no TPU needed): bf16, 12 query heads on 4 KV heads (head dim
    64 and 128), block 512 over a 4,096-slot cache. Catches: starts Mosaic cannot prove aligned."""
    from pallas_kernels.moba.tpu_decode import moba_decode_tpu

    arg = v5e_arg()
    step = jax.jit(lambda q, k, v, *tables: moba_decode_tpu(q, k, v, *tables, 512, 0.125))
    for d in (64, 128):
        cache = arg((2, 4, 4096, d))
        lowered = step.lower(arg((2, 12, d)), cache, cache, *[arg((2, 12, 3), jnp.int32)] * 3)
        assert lowered.as_text().count("tpu_custom_call") == 1
        lowered.compile()


@pytest.mark.parametrize("min_piece", [64, 2], ids=["whole_blocks", "pieces_of_2"])
def test_gpu_decode_kernel_matches_xla_and_lowers_for_cuda(min_piece, monkeypatch):
    """A single-token step through the GPU kernel (interpreted here) equals the XLA step (GQA, a partial
    own block, picks and an unused pick), each 8-slot block one program or cut in 4 pieces of 2 slots
    (pieces wholly after the query or in an unused pick), and lowers for CUDA with jax.export. Catches:
    the same mutations as the TPU kernel's test, a piece with no slot that weighs in the combine, a piece
    reading another piece's slots, and a dispatch that silently falls back to XLA."""
    monkeypatch.setattr(gpu_decode, "MIN_PIECE", min_piece)
    assert gpu_decode.pieces(2 * 4 * 4, 8, 132) == (4 if min_piece == 2 else 1)
    step = _kernel_case(70, 8)
    assert "moba_decode_gpu" in str(jax.make_jaxpr(lambda: step("pallas_triton"))())  # the kernel ran
    np.testing.assert_allclose(step("pallas_triton"), step("xla"), atol=1e-5, rtol=1e-5)
    triton = jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")
    tables = [jax.ShapeDtypeStruct((2, 8, 3), jnp.int32)] * 3
    cache = jax.ShapeDtypeStruct((2, 2, 4096, 64), jnp.bfloat16)
    kernel = lambda q, k, v, *tables: moba_decode_gpu(q, k, v, *tables, 512, 0.125)
    with gpu_lowering_target():
        exported = jax.export.export(jax.jit(kernel), platforms=["cuda"], disabled_checks=[triton])(
            jax.ShapeDtypeStruct((2, 8, 64), jnp.bfloat16), cache, cache, *tables
        )
    assert re.findall(r'name = "(moba_\w+_gpu)"', exported.mlir_module()) == ["moba_decode_gpu"]


def test_gpu_dispatch_follows_the_verified_table(verified):
    """Traced for a GPU: "auto" and "pallas_gpu" take XLA until the table lists the Triton decode kernel
    (float32: Mosaic's refuses), then the kernel, except under "auto" where the entry's `xla_faster`
    covers the step's batch and cache length (at most); "pallas_triton" runs it regardless."""
    step = _kernel_case(64, 8)
    kernel_ran = lambda impl: "moba_decode_gpu" in str(jax.make_jaxpr(lambda: step(impl))())
    with tracing_for("gpu"):
        verified()
        assert not kernel_ran("auto") and not kernel_ran("pallas_gpu") and kernel_ran("pallas_triton")
        verified(("moba_decode", "triton"))
        assert kernel_ran("auto")
        for bound, xla in [(dict(batch=2, length=64), True), (dict(batch=1, length=64), False),
                           (dict(batch=2, length=63), False)]:  # fmt: skip
            verified(("moba_decode", "triton"), xla_faster=(bound,))
            assert kernel_ran("auto") != xla, bound
            assert kernel_ran("pallas_gpu")
