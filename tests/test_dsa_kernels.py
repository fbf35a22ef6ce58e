"""DSA's kernels (pallas_kernels/dsa/): interpreted, the Triton sparse attention equals the XLA path
(`sparse_attention`) in output and gradients on random selections, and a model with
`dsa.impl=pallas_triton` equals one on the XLA path, in training and in decoding (the latent decode
kernel); both kernels lower for CUDA. The fused GPU selection equals `dsa_select` and lowers for
CUDA. The TPU latent decode kernel equals the same attention
written out in numpy (both TPU interpreters), a model decoding on it equals the XLA step, and it
compiles for a TPU."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import TINY_MLA, assert_attention_over_selection, random_selection, segments, v5e_arg
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from effattn_jax.config import load_config
from effattn_jax.model import Transformer, init_cache
from effattn_jax.ops.dsa import dsa_select
from effattn_jax.sharding import make_mesh, sharding_rules
from pallas_kernels.common import gpu_lowering_target
from pallas_kernels.dsa.tpu_decode import CHUNK as TPU_CHUNK
from pallas_kernels.dsa.tpu_decode import sparse_latent_decode_tpu
from pallas_kernels.dsa.tpu_select import index_topk_tpu
from pallas_kernels.dsa.triton import CHUNK, sparse_attention_gpu, width_parts
from pallas_kernels.dsa.triton_decode import sparse_latent_decode_gpu
from pallas_kernels.dsa.triton_select import index_topk_gpu
from pallas_kernels.registry import kernel


@pytest.mark.parametrize(
    "heads, kv_heads, d, dv, picks",
    [
        (4, 2, 12, 10, 7),  # GQA, widths and picks that pad
        (4, 1, 20, 16, CHUNK + 5),  # one KV head for all (MLA's absorbed form), two chunks of picks
        (2, 2, 16, 16, 2 * CHUNK),  # MHA, whole chunks
        (4, 4, 48, 16, CHUNK + 3),  # a width run as two dots (32 + 16), like V3.2's 192 (128 + 64)
    ],
)
def test_interpreted_kernel_equals_the_xla_path(heads, kv_heads, d, dv, picks):
    """Output and dq, dk, dv (float32). Catches: a pick's row read from another KV head, an unused
    pick attended or its gradient added to row 0, a chunk's rows added twice, a padded head leaking,
    a column part's dq or dK written at another part's columns."""
    rng = np.random.default_rng(picks)
    b, t, s = 2, 9, 3 * CHUNK
    q, k, v = (
        jnp.asarray(rng.standard_normal(shape), jnp.float32)
        for shape in ((b, t, heads, d), (b, s, kv_heads, d), (b, s, kv_heads, dv))
    )
    idx, w = random_selection(rng, b, t, s, picks), jnp.asarray(rng.standard_normal((b, t, heads, dv)))
    run = lambda q, k, v, idx, scale: sparse_attention_gpu(q, k, v, idx, scale=scale, interpret=True)
    assert_attention_over_selection(run, q, k, v, idx, w)
    assert kernel("dsa", "attention", "triton") is sparse_attention_gpu


def test_widths_run_as_binary_parts_or_padded():
    assert [width_parts(d) for d in (192, 128, 48, 240, 12, 20, 8)] == [
        (128, 64), (128,), (32, 16), (128, 64, 32, 16), (16,), (32,), (16,),
    ]  # fmt: skip


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_forward_and_backward_lower_for_cuda(dtype):
    """Both kernels lower to Triton for CUDA (jax.export, no GPU) at V3.2's per-head widths (q/k 192,
    v 128) and top-256. Catches: a gather or atomic the Triton lowering rejects, an XLA fallback."""
    sd = lambda *shape, dt=dtype: jax.ShapeDtypeStruct(shape, jnp.dtype(dt))
    loss = lambda q, k, v, idx: sparse_attention_gpu(q, k, v, idx).astype(jnp.float32).sum()
    triton = jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")
    with gpu_lowering_target():
        exported = jax.export.export(
            jax.jit(jax.grad(loss, (0, 1, 2))), platforms=["cuda"], disabled_checks=[triton]
        )(sd(1, 512, 4, 192), sd(1, 512, 4, 192), sd(1, 512, 4, 128), sd(1, 512, 256, dt="int32"))
    names = re.findall(r'name = "(dsa_\w+)"', exported.mlir_module())
    assert sorted(names) == ["dsa_sparse_attention_bwd", "dsa_sparse_attention_fwd"]


@pytest.mark.parametrize(
    "kind, impl",
    [("mla", "pallas_triton"), ("mha", "pallas_triton"), ("mla", "pallas_tpu"), ("mha", "pallas_tpu")],
)
def test_a_model_on_the_kernel_equals_the_xla_path(kind, impl):
    """Top-5 of 13 and 11 packed tokens: the features, the KL and the gradients of both with
    dsa.impl=pallas_triton or pallas_tpu (the selection and attention kernels), interpreted, equal
    dsa.impl=xla."""
    kinds = {"mla": ["attention.kind=mla"], "mha": ["model.num_kv_heads=2"]}
    dsa = ["attention.core=dsa", "dsa.index_n_heads=3", "dsa.index_head_dim=8", "dsa.index_topk=5"]
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(0, 128, (2, 24)))
    seg = jnp.asarray(np.repeat([[1, 2]], [13, 11], axis=1).repeat(2, 0))

    def run(impl):
        model = Transformer(
            load_config(None, TINY_MLA + kinds[kind] + dsa + [f"dsa.impl={impl}"]), rngs=nnx.Rngs(0)
        )
        graphdef, params = nnx.split(model)

        def objective(p):
            features, kl = nnx.merge(graphdef, p).features_and_indexer_kl(tokens, seg)
            return jnp.sum(features**2) + jnp.sum(kl), (features, kl)

        return jax.value_and_grad(objective, has_aux=True)(params)

    (_, (want, want_kl)), want_grads = run("xla")
    (_, (got, got_kl)), got_grads = run(impl)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(got_kl, want_kl, rtol=1e-4, atol=1e-6)  # KL of a fresh model: ~1e-5 a token
    for g, w in zip(jax.tree.leaves(got_grads), jax.tree.leaves(want_grads), strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("impl", ["pallas_triton", "pallas_tpu"])
def test_latent_decode_on_the_kernel_equals_the_xla_step(impl):
    """An MLA model with DSA (latent 32, RoPE 16: widths the kernel takes), top-5: a 6-token prefill,
    then 3 single-token steps, on the decode kernel (interpreted) and on the XLA step: the same
    logits at every step. Catches: the latent rows or their RoPE keys gathered at the wrong slots,
    the scale or the key split (q_lat . c + q_rope . k^R) wrong, an unused pick attended."""
    widths = ["attention.kind=mla", "mla.kv_lora_rank=32", "mla.qk_rope_head_dim=16"]
    dsa = ["attention.core=dsa", "dsa.index_n_heads=2", "dsa.index_head_dim=16", "dsa.index_topk=5"]
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 128, (2, 9)), jnp.int32)

    def decode(impl):
        cfg = load_config(None, TINY_MLA + widths + dsa + [f"dsa.impl={impl}"])
        model = Transformer(cfg, rngs=nnx.Rngs(0))
        graphdef, params = nnx.split(model)
        step = jax.jit(
            lambda p, t, pos, c, prefill: nnx.merge(graphdef, p).decode(t, pos, c, prefill=prefill),
            static_argnames="prefill",
        )
        caches, logits = init_cache(model, 2, 32), []
        for start, end in ((0, 6), (6, 7), (7, 8), (8, 9)):
            pos = jnp.broadcast_to(jnp.arange(start, end, dtype=jnp.int32), (2, end - start))
            out, caches = step(params, tokens[:, start:end], pos, caches, prefill=start == 0)
            logits.append(np.asarray(out))
        return logits

    for got, want in zip(decode(impl), decode("xla"), strict=True):
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize(
    "seq, top_k, lengths, interpret",
    [
        (40, 7, None, True),  # one key tile, fewer picks than keys
        (300, 130, (100, 200), True),  # two key tiles, picks over two lanes' windows, packed documents
        (300, 130, (100, 200), "tpu"),  # the TPU interpreter
        (20, 64, None, True),  # top-k past the sequence: every visible key
    ],
)
def test_tpu_selection_equals_dsa_select(seq, top_k, lengths, interpret):
    """The fused selection kernel (scores and top-k, pallas_kernels/dsa/tpu_select.py) equals the
    XLA selection index for index, order included, with ties: every other key repeats the one
    before it, so half the scores tie and the earlier key must win. Catches: the k-th score off by
    one, a tie resolved to the later key, a pick written at another query's offset or lost across
    a 128-key tile or a key tile, a key of another document picked."""
    q, k, w, seg = _selection_inputs(seq, lengths, jnp.float32)
    want = dsa_select(q, k, w, top_k=top_k, segment_ids=seg)
    got = index_topk_tpu(q, k, w, top_k=top_k, segment_ids=seg, interpret=interpret)
    np.testing.assert_array_equal(got, want)
    assert kernel("dsa", "select", "tpu") is index_topk_tpu


def _selection_inputs(seq, lengths, dtype, b=2, hi=3, di=16):
    """Indexer outputs with ties (key 2i + 1 repeats key 2i) and weights of both signs: q [b, seq,
    hi, di], k [b, seq, di], w [b, seq, hi]; and the segments of `lengths` (None: one document)."""
    rng = np.random.default_rng(seq + di)
    q = jnp.asarray(rng.standard_normal((b, seq, hi, di)), dtype)
    k = jnp.asarray(rng.standard_normal((b, seq, di)), dtype)
    k = k.at[:, 1::2].set(k[:, : seq // 2 * 2 : 2])
    w = jnp.asarray(rng.standard_normal((b, seq, hi)), jnp.float32)
    return q, k, w, None if lengths is None else segments(b, lengths)


@pytest.mark.parametrize(
    "seq, top_k, lengths, dtype",
    [
        (40, 7, None, jnp.float32),  # two key chunks, fewer picks than keys
        (100, 37, (40, 60), jnp.float32),  # packed documents, picks over four chunks
        (90, 40, (50, 40), jnp.bfloat16),  # bf16 products, a float32 sum
        (20, 64, None, jnp.float32),  # top-k past the sequence: every visible key
    ],
)
def test_gpu_selection_equals_dsa_select(seq, top_k, lengths, dtype):
    """The fused GPU selection (pallas_kernels/dsa/triton_select.py, interpreted) equals the XLA
    selection index for index, order included, over ties that must go to the earlier key. Catches:
    a radix digit or the k-th key off by one, the equal keys' count carried wrongly across chunks,
    a pick written at another slot, a key of another document picked, unused slots not -1."""
    q, k, w, seg = _selection_inputs(seq, lengths, dtype)
    want = dsa_select(q, k, w, top_k=top_k, segment_ids=seg)
    np.testing.assert_array_equal(index_topk_gpu(q, k, w, top_k=top_k, segment_ids=seg, interpret=True), want)
    got = dsa_select(q, k, w, top_k=top_k, segment_ids=seg, impl="pallas_triton")  # the dispatch
    np.testing.assert_array_equal(got, want)
    assert kernel("dsa", "select", "triton") is index_topk_gpu


@pytest.mark.parametrize("select", [index_topk_gpu, index_topk_tpu], ids=["gpu", "tpu"])
def test_selection_kernels_at_query_positions(select):
    """Queries at positions among more keys, as a context shard's (the balanced layout's two runs,
    20-31 and 270-281 of 300 keys), packed documents, ties: each kernel (interpreted) equals
    `dsa_select(q_index=...)`. Catches: a query's position or document taken from its index in
    the batch, a key tile past a tile's last query read, or one before it skipped."""
    q, _, w, _ = _selection_inputs(24, None, jnp.float32)
    _, k, _, seg = _selection_inputs(300, (140, 160), jnp.float32)
    pos = jnp.concatenate([jnp.arange(20, 32), jnp.arange(270, 282)]).astype(jnp.int32)
    pos = jnp.broadcast_to(pos, (2, 24))
    want = dsa_select(q, k, w, top_k=37, segment_ids=seg, q_index=pos)
    got = select(q, k, w, top_k=37, segment_ids=seg, q_index=pos, interpret=True)
    np.testing.assert_array_equal(got, want)


def test_gpu_selection_lowers_for_cuda():
    """The selection lowers to one Triton kernel for CUDA at V3.2's indexer (64 heads of 128, bf16,
    top-2,048; `make gpu-compile` compiles it to machine code). Catches: a scatter, cumsum or
    bitcast the Triton lowering rejects."""
    sd = lambda *shape, dt="bfloat16": jax.ShapeDtypeStruct(shape, jnp.dtype(dt))
    select = lambda q, k, w, seg: index_topk_gpu(q, k, w, top_k=2048, segment_ids=seg)
    triton = jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")
    with gpu_lowering_target():
        exported = jax.export.export(jax.jit(select), platforms=["cuda"], disabled_checks=[triton])(
            sd(1, 4096, 64, 128), sd(1, 4096, 128), sd(1, 4096, 64, dt="float32"), sd(1, 4096, dt="int32")
        )
    assert re.findall(r'name = "(dsa_\w+)"', exported.mlir_module()) == ["dsa_index_topk_gpu"]


def test_tpu_selection_per_batch_shard_under_a_mesh():
    """Under a (data=2, fsdp=2) mesh the selection kernel runs per batch shard (Mosaic partitions
    nothing itself) and equals the XLA selection. Catches: a shard_map spec that splits the
    sequence or drops a batch shard's rows."""
    rng = np.random.default_rng(1)
    q, k, w = (
        jnp.asarray(rng.standard_normal(shape), jnp.float32)
        for shape in ((4, 24, 2, 16), (4, 24, 16), (4, 24, 2))
    )
    seg = segments(4, (10, 14))
    rules = sharding_rules(load_config(None, []))
    mesh = make_mesh(2, 2, 1)

    def select(*x):  # under the mesh, as the train step traces the model
        with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
            return dsa_select(*x, top_k=6, segment_ids=seg, impl="pallas_tpu", rules=rules)

    got = jax.jit(select)(*(jax.device_put(x, NamedSharding(mesh, P(("data", "fsdp")))) for x in (q, k, w)))
    np.testing.assert_array_equal(got, dsa_select(q, k, w, top_k=6, segment_ids=seg))


@pytest.mark.slow
def test_tpu_selection_compiles_for_a_real_tpu():
    """Mosaic lowering and a libtpu compile for a v5e at V3.2's indexer (64 heads of 128, bf16,
    top-2,048) over 128K tokens: the row of scores (4 MiB a tile of queries) fits VMEM. Catches: an
    op Mosaic refuses (interpret mode accepts it), a scoped VMEM limit the kernel outgrows."""
    arg = v5e_arg()
    select = jax.jit(lambda q, k, w, seg: index_topk_tpu(q, k, w, top_k=2048, segment_ids=seg))
    device = jax.sharding.AbstractDevice(device_kind="TPU v5 lite", num_cores=None, platform="tpu")
    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), (), abstract_device=device)):
        lowered = select.lower(
            arg((1, 131072, 64, 128)), arg((1, 131072, 128)), arg((1, 131072, 64), jnp.float32),
            arg((1, 131072), jnp.int32),
        )  # fmt: skip
        assert lowered.as_text().count("tpu_custom_call") == 1
        lowered.compile()


def _latent_attention(ql, qr, lat, kr, idx, scale):
    """Attention over each token's selected [c ; k^R] rows, values c, in float64 numpy."""
    f = lambda x: np.asarray(x, np.float64)
    idx = np.asarray(idx)
    rows = lambda x: np.take_along_axis(f(x)[:, None], np.maximum(idx, 0)[..., None], 2)  # [B, T, K, .]
    keys, values = np.concatenate([rows(lat), rows(kr)], -1), rows(lat)
    s = np.einsum("bthw,btkw->bthk", np.concatenate([f(ql), f(qr)], -1), keys) * scale
    s = np.where((idx >= 0)[:, :, None, :], s, -np.inf)
    with np.errstate(invalid="ignore"):  # a token with no pick: -inf - -inf
        p = np.where(np.isfinite(s), np.exp(s - s.max(-1, keepdims=True)), 0)
    return np.einsum("bthk,btkd->bthd", p / np.maximum(p.sum(-1, keepdims=True), 1e-30), values)


@pytest.mark.parametrize(
    "decode, interpret, picks",
    [
        (sparse_latent_decode_gpu, True, 40),  # 20 heads: two programs of 16, the second padded
        (sparse_latent_decode_tpu, True, TPU_CHUNK + 12),  # two chunks, the second mostly unused
        (sparse_latent_decode_tpu, "tpu", TPU_CHUNK + 12),  # the TPU interpreter: DMAs, semaphores
    ],
)
def test_latent_decode_kernel_equals_numpy(decode, interpret, picks):
    """20 heads, picks over two chunks with unused ones: the kernel equals attention over the
    gathered [c ; k^R] rows written out in numpy (float32). Catches: a row fetched from the wrong
    slot or batch row, a chunk's copies landing in the other slot, an unused pick attended."""
    rng = np.random.default_rng(0)
    b, t, h, length, dc, dr = 2, 3, 20, 2 * picks, 32, 16
    ql, qr = (jnp.asarray(rng.standard_normal((b, t, h, w)), jnp.float32) for w in (dc, dr))
    lat, kr = (jnp.asarray(rng.standard_normal((b, length, w)), jnp.float32) for w in (dc, dr))
    idx = random_selection(rng, b, t, length, picks)
    got = decode(ql, qr, lat, kr, idx, scale=0.2, interpret=interpret)
    np.testing.assert_allclose(got, _latent_attention(ql, qr, lat, kr, idx, 0.2), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("length", [64, 65])
def test_tpu_latent_decode_in_bf16(length):
    """bf16 copies row pairs (Mosaic slices packed rows at even offsets only): picks on odd and even
    rows, the last row of an odd-length cache and a repeated pick each attend to their own row.
    Catches: the pair's other row attended, the last pair read past the cache."""
    rng = np.random.default_rng(length)
    b, t, h, dc, dr = 2, 3, 4, 32, 16
    bf = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.bfloat16)
    ql, qr, lat, kr = bf(b, t, h, dc), bf(b, t, h, dr), bf(b, length, dc), bf(b, length, dr)
    idx = random_selection(rng, b, t, length, 9).at[1, 1, :3].set(jnp.asarray([length - 1, 4, 4]))
    got = sparse_latent_decode_tpu(ql, qr, lat, kr, idx, scale=0.2, interpret=True)
    want = _latent_attention(ql, qr, lat, kr, idx, 0.2)  # bf16 probabilities: ~3 significant digits
    np.testing.assert_allclose(np.asarray(got, np.float32), want, rtol=2e-2, atol=2e-2)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_tpu_latent_decode_compiles_for_a_real_tpu(dtype):
    """Mosaic lowering and a libtpu compile (no TPU needed) at V3.2's widths (128 heads, 512 + 64,
    top-2,048 of 8,192) and an odd cache length. Catches: a row copy at an offset Mosaic refuses
    (bf16 rows one at a time are; interpret mode accepts them), a block shape Mosaic rejects."""
    arg = v5e_arg()
    step = jax.jit(lambda *x: sparse_latent_decode_tpu(*x, scale=0.1))
    for h, length, picks in [(128, 8192, 2048), (16, 4099, 300)]:
        lowered = step.lower(
            arg((2, 1, h, 512), dtype), arg((2, 1, h, 64), dtype), arg((2, length, 512), dtype),
            arg((2, length, 64), dtype), arg((2, 1, picks), jnp.int32),
        )  # fmt: skip
        assert lowered.as_text().count("tpu_custom_call") == 1
        lowered.compile()


def test_latent_decode_lowers_for_cuda():
    """The decode kernel lowers to Triton for CUDA at V3.2's latent (512 + 64), 128 heads, top-2,048."""
    sd = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.bfloat16)
    step = lambda *x: sparse_latent_decode_gpu(*x, scale=0.1)
    triton = jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")
    with gpu_lowering_target():
        exported = jax.export.export(jax.jit(step), platforms=["cuda"], disabled_checks=[triton])(
            sd(2, 1, 128, 512), sd(2, 1, 128, 64), sd(2, 8192, 512), sd(2, 8192, 64),
            jax.ShapeDtypeStruct((2, 1, 2048), jnp.int32),
        )  # fmt: skip
    assert re.findall(r'name = "(dsa_\w+)"', exported.mlir_module()) == ["dsa_latent_decode"]
