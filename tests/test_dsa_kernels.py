"""DSA's Triton kernels (pallas_kernels/dsa/): interpreted, the sparse attention equals the XLA path
(`sparse_attention`) in output and gradients on random selections, and a model with
`dsa.impl=pallas_triton` equals one on the XLA path, in training and in decoding (the latent decode
kernel); both kernels lower for CUDA."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import TINY_MLA
from flax import nnx

from effattn_jax.config import load_config
from effattn_jax.model import Transformer, init_cache
from effattn_jax.ops.dsa import sparse_attention
from pallas_kernels.common import gpu_lowering_target
from pallas_kernels.dsa.triton import CHUNK, sparse_attention_gpu
from pallas_kernels.dsa.triton_decode import sparse_latent_decode_gpu
from pallas_kernels.registry import kernel


def _selection(rng, b, t, s, picks):
    """Distinct keys per query, some queries with unused (-1) slots and one with none."""
    idx = np.stack([np.stack([rng.choice(s, picks, replace=False) for _ in range(t)]) for _ in range(b)])
    idx[0, 0, 3:] = -1
    idx[-1, 2, :] = -1
    return jnp.asarray(idx.astype(np.int32))


@pytest.mark.parametrize(
    "heads, kv_heads, d, dv, picks",
    [
        (4, 2, 12, 10, 7),  # GQA, widths and picks that pad
        (4, 1, 20, 16, CHUNK + 5),  # one KV head for all (MLA's absorbed form), two chunks of picks
        (2, 2, 16, 16, 2 * CHUNK),  # MHA, whole chunks
    ],
)
def test_interpreted_kernel_equals_the_xla_path(heads, kv_heads, d, dv, picks):
    """Output and dq, dk, dv (float32). Catches: a pick's row read from another KV head, an unused
    pick attended or its gradient added to row 0, a chunk's rows added twice, a padded head leaking."""
    rng = np.random.default_rng(picks)
    b, t, s = 2, 9, 3 * CHUNK
    q, k, v = (
        jnp.asarray(rng.standard_normal(shape), jnp.float32)
        for shape in ((b, t, heads, d), (b, s, kv_heads, d), (b, s, kv_heads, dv))
    )
    idx, w = _selection(rng, b, t, s, picks), jnp.asarray(rng.standard_normal((b, t, heads, dv)))
    objective = lambda attend: lambda q, k, v: jnp.sum(attend(q, k, v, idx, scale=0.3) * w)
    want, want_grads = jax.value_and_grad(objective(sparse_attention), (0, 1, 2))(q, k, v)
    run = lambda q, k, v, idx, scale: sparse_attention_gpu(q, k, v, idx, scale=scale, interpret=True)
    got, got_grads = jax.value_and_grad(objective(run), (0, 1, 2))(q, k, v)
    np.testing.assert_allclose(got, want, rtol=1e-5)
    for name, g, ref in zip("qkv", got_grads, want_grads, strict=True):
        np.testing.assert_allclose(g, ref, rtol=1e-5, atol=1e-5, err_msg=name)
    assert kernel("dsa", "attention", "triton") is sparse_attention_gpu


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


@pytest.mark.parametrize("kind", ["mla", "mha"])
def test_a_model_on_the_kernel_equals_the_xla_path(kind):
    """Top-5 of 13 and 11 packed tokens: the features, the KL and the gradients of both with
    dsa.impl=pallas_triton (interpreted) equal dsa.impl=xla."""
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
    (_, (got, got_kl)), got_grads = run("pallas_triton")
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(got_kl, want_kl, rtol=1e-4, atol=1e-6)  # KL of a fresh model: ~1e-5 a token
    for g, w in zip(jax.tree.leaves(got_grads), jax.tree.leaves(want_grads), strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5)


def test_latent_decode_on_the_kernel_equals_the_xla_step():
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

    for got, want in zip(decode("pallas_triton"), decode("xla"), strict=True):
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)


def test_latent_decode_kernel_over_groups_of_heads():
    """20 heads (two programs of 16, the second padded), picks over two chunks with unused ones:
    the kernel equals attention over the gathered [c ; k^R] rows written out in numpy."""
    rng = np.random.default_rng(0)
    b, t, h, length, dc, dr, picks = 2, 3, 20, 80, 32, 16, 40
    ql, qr = (jnp.asarray(rng.standard_normal((b, t, h, w)), jnp.float32) for w in (dc, dr))
    lat, kr = (jnp.asarray(rng.standard_normal((b, length, w)), jnp.float32) for w in (dc, dr))
    idx = _selection(rng, b, t, length, picks)
    got = sparse_latent_decode_gpu(ql, qr, lat, kr, idx, scale=0.2, interpret=True)
    rows = lambda x: np.take_along_axis(np.asarray(x)[:, None], np.maximum(np.asarray(idx), 0)[..., None], 2)
    keys, values = np.concatenate([rows(lat), rows(kr)], -1), rows(lat)  # [B, T, K, .]
    s = np.einsum("bthw,btkw->bthk", np.concatenate([ql, qr], -1), keys) * 0.2
    s = np.where((np.asarray(idx) >= 0)[:, :, None, :], s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p = np.where(np.isfinite(s), p, 0) / np.maximum(
        np.where(np.isfinite(s), p, 0).sum(-1, keepdims=True), 1e-30
    )
    want = np.einsum("bthk,btkd->bthd", p, values)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


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
