"""DSA ops (docs/dsa.md): the XLA path against the dense-mask reference, the selection against a
plain numpy top-k, and the indexer's KL loss."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import jaxpr_outputs, rand_qkv, segments

from effattn_jax.ops.dense import dense_attention
from effattn_jax.ops.dsa import (
    dsa_attention,
    dsa_select,
    indexer_kl,
    indexer_kl_loss,
    lightning_index_scores,
    sparse_attention,
)


def indexer_inputs(seed, b, s, hi=4, di=8):
    """Random q_idx [b, s, hi, di], k_idx [b, s, di], weights [b, s, hi] (weights of both signs)."""
    rng = np.random.default_rng(seed)
    f = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)
    return f(b, s, hi, di), f(b, s, di), f(b, s, hi)


def run(impl, q, k, v, idx, **kw):
    """Jitted forward and (q, k, v, q_idx, k_idx, weights) gradients of a random projection of the output."""
    f = lambda q, k, v, qi, ki, w: dsa_attention(q, k, v, qi, ki, w, impl=impl, **kw)
    proj = jnp.asarray(np.random.default_rng(9).standard_normal(q.shape[:3] + v.shape[3:]), q.dtype)
    out_and_grads = jax.value_and_grad(
        lambda *a: (jnp.sum(f(*a) * proj), f(*a)), tuple(range(6)), has_aux=True
    )
    (_, out), grads = jax.jit(out_and_grads)(q, k, v, *idx)
    return out, grads


def masked_scores(idx, segment_ids, s):
    """The index scores [B, S, S] as numpy, -inf off the causal same-document keys."""
    scores = np.asarray(lightning_index_scores(*idx), np.float64)
    visible = np.tril(np.ones((s, s), bool))[None]
    if segment_ids is not None:
        seg = np.asarray(segment_ids)
        visible = visible & (seg[:, :, None] == seg[:, None, :])
    return np.where(visible, scores, -np.inf)


CASES = {
    # name: (batch, seq, q_heads, kv_heads, head_dim, v_dim, top_k, segment lengths or None, query_chunk)
    "top_k_below_visible": (2, 40, 2, 2, 8, 8, 5, None, 16),
    "packed_documents": (2, 45, 2, 2, 8, 6, 6, [12, 25, 8], 8),
    "gqa_kv_heads": (1, 33, 4, 1, 8, 8, 4, [20, 13], 7),
    "top_k_1": (1, 24, 2, 2, 8, 8, 1, None, 5),
}


@pytest.mark.parametrize("name", list(CASES))
def test_xla_matches_reference(name):
    b, s, hq, hkv, d, dv, top_k, lengths, chunk = CASES[name]
    q, k, v = rand_qkv(1, b, s, hq, hkv, d, dv)
    idx = indexer_inputs(2, b, s)
    seg = None if lengths is None else segments(b, lengths)
    (ro, rg) = run("reference", q, k, v, idx, top_k=top_k, segment_ids=seg)
    (xo, xg) = run("xla", q, k, v, idx, top_k=top_k, segment_ids=seg, query_chunk=chunk)
    np.testing.assert_allclose(xo, ro, atol=1e-5, rtol=1e-5)
    for a, r in zip(xg[:3], rg[:3], strict=True):  # q, k, v
        np.testing.assert_allclose(a, r, atol=1e-5, rtol=1e-5)
    for g in xg[3:] + rg[3:]:  # the indexer learns from its KL loss only
        assert not np.asarray(g).any()


def test_top_k_covering_every_key_is_dense_causal_attention():
    b, s = 2, 30
    q, k, v = rand_qkv(3, b, s, 4, 2, 8)
    seg = segments(b, [11, 19])
    f = jax.jit(lambda *a: dsa_attention(*a, top_k=s, segment_ids=seg, query_chunk=8))
    out = f(q, k, v, *indexer_inputs(4, b, s))
    np.testing.assert_allclose(out, dense_attention(q, k, v, segment_ids=seg), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("top_k, lengths, chunk", [(5, None, 16), (7, [9, 21, 10], 6), (64, [25, 15], 40)])
def test_selection_is_a_plain_top_k_of_the_masked_scores(top_k, lengths, chunk):
    b, s = 2, 40
    idx = indexer_inputs(5, b, s)
    seg = None if lengths is None else segments(b, lengths)
    got = np.asarray(dsa_select(*idx, top_k=top_k, segment_ids=seg, query_chunk=chunk))
    scores = masked_scores(idx, seg, s)
    kk = min(top_k, s)
    assert got.shape == (b, s, kk)
    order = np.argsort(-scores, axis=-1, kind="stable")[..., :kk]  # best first, ties to the earlier key
    want = np.where(np.take_along_axis(np.isfinite(scores), order, -1), order, -1)
    np.testing.assert_array_equal(got, want)


def test_absorbed_latent_form_equals_per_head_keys():
    """V3.2's MQA mode: the selected latent rows [c ; k^R] as one KV head, W_UK folded into the query and
    W_UV applied after, give the per-head (non-absorbed) output."""
    rng = np.random.default_rng(13)
    f = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)
    b, s, h, dc, nope, dr, dv = 1, 20, 3, 6, 4, 2, 5
    c, kr = f(b, s, dc), f(b, s, dr)  # the cached latent and RoPE key
    w_uk, w_uv = f(dc, h, nope), f(dc, h, dv)
    q_nope, q_rope = f(b, s, h, nope), f(b, s, h, dr)
    chosen = dsa_select(*indexer_inputs(14, b, s), top_k=6, segment_ids=segments(b, [8, 12]))
    scale = 1 / np.sqrt(nope + dr)
    keys = jnp.concatenate(
        [jnp.einsum("bsd,dhn->bshn", c, w_uk), jnp.broadcast_to(kr[:, :, None], (b, s, h, dr))], -1
    )
    per_head = sparse_attention(
        jnp.concatenate([q_nope, q_rope], -1), keys, jnp.einsum("bsd,dhv->bshv", c, w_uv), chosen, scale=scale
    )
    q_lat = jnp.concatenate([jnp.einsum("bshn,dhn->bshd", q_nope, w_uk), q_rope], -1)
    latent = sparse_attention(
        q_lat, jnp.concatenate([c, kr], -1)[:, :, None], c[:, :, None], chosen, scale=scale
    )
    np.testing.assert_allclose(jnp.einsum("bshd,dhv->bshv", latent, w_uv), per_head, atol=1e-5, rtol=1e-5)


def test_index_scores_follow_the_equation():
    qi, ki, w = indexer_inputs(6, 1, 9, hi=3, di=4)
    qn, kn, wn = (np.asarray(x, np.float64) for x in (qi, ki, w))
    dots = np.einsum("bthd,bsd->bths", qn, kn)
    want = np.einsum("bth,bths->bts", wn, np.maximum(dots, 0.0)) / np.sqrt(3) / np.sqrt(4)
    np.testing.assert_allclose(lightning_index_scores(qi, ki, w), want, rtol=1e-5, atol=1e-6)


def test_xla_path_never_forms_a_sequence_by_sequence_array():
    b, s, chunk = 1, 64, 16
    q, k, v = rand_qkv(7, b, s, 2, 2, 8)
    idx = indexer_inputs(8, b, s, hi=3)
    f = lambda *a: dsa_attention(*a, top_k=8, query_chunk=chunk).sum()
    jaxpr = jax.make_jaxpr(jax.grad(f, argnums=(0, 1, 2)))(q, k, v, *idx)
    big = [(p, shape) for p, shape in jaxpr_outputs(jaxpr.jaxpr) if shape.count(s) >= 2]
    assert not big, big


def test_indexer_kl_is_zero_at_the_target_and_positive_elsewhere():
    rng = np.random.default_rng(10)
    scores = jnp.asarray(rng.standard_normal((3, 7)), jnp.float32)
    valid = jnp.asarray(rng.random((3, 7)) < 0.7).at[:, 0].set(True)
    target = jax.nn.softmax(jnp.where(valid, scores, -jnp.inf), axis=-1)
    np.testing.assert_allclose(indexer_kl(target, scores, valid), 0.0, atol=1e-6)
    np.testing.assert_allclose(indexer_kl(target, scores + 3.0, valid), 0.0, atol=1e-6)  # shift-invariant
    other = indexer_kl(target, jnp.asarray(rng.standard_normal((3, 7)), jnp.float32), valid)
    assert (np.asarray(other) > 1e-4).all()


def numpy_kl(q, k, idx, segment_ids, allowed):
    """Per-query KL(head-summed, L1-normalised main attention || softmax of index scores) over `allowed`."""
    b, s, h, d = q.shape
    hkv = k.shape[2]
    kh = np.repeat(np.asarray(k, np.float64), h // hkv, axis=2)
    logits = np.einsum("bthd,bshd->bhts", np.asarray(q, np.float64), kh) / np.sqrt(d)
    logits = np.where(allowed[:, None], logits, -np.inf)
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p = (p / p.sum(-1, keepdims=True)).sum(1)
    p /= p.sum(-1, keepdims=True)
    scores = np.where(allowed, masked_scores(idx, segment_ids, s), -np.inf)
    logq = scores - scores.max(-1, keepdims=True)
    logq -= np.log(np.exp(logq).sum(-1, keepdims=True))
    terms = p * (np.log(np.where(p > 0, p, 1.0)) - np.where(allowed, logq, 0.0))
    return np.where(allowed, terms, 0.0).sum(-1)


def test_indexer_kl_loss_dense_warmup_and_sparse_stage():
    b, s, top_k = 2, 26, 6
    q, k, _ = rand_qkv(11, b, s, 4, 2, 8)
    idx = indexer_inputs(12, b, s)
    seg = segments(b, [10, 16])
    visible = masked_scores(idx, seg, s) > -np.inf
    kl = jax.jit(
        lambda *a, indices=None: indexer_kl_loss(*a, indices=indices, segment_ids=seg, query_chunk=8)
    )
    dense = kl(q, k, *idx)
    np.testing.assert_allclose(dense, numpy_kl(q, k, idx, seg, visible), rtol=1e-4, atol=1e-5)
    chosen = jax.jit(lambda *a: dsa_select(*a, top_k=top_k, segment_ids=seg))(*idx)
    onehot = (np.asarray(chosen)[..., None] == np.arange(s)).any(-2)  # -1 matches no key
    sparse = kl(q, k, *idx, indices=chosen)
    np.testing.assert_allclose(sparse, numpy_kl(q, k, idx, seg, onehot), rtol=1e-4, atol=1e-5)
    every = np.argsort(np.where(visible, np.arange(s), s), axis=-1)  # every visible key: the dense loss
    every = jnp.asarray(np.where(np.take_along_axis(visible, every, -1), every, -1), jnp.int32)
    np.testing.assert_allclose(kl(q, k, *idx, indices=every), dense, atol=1e-5)

    # the loss trains the indexer (q_idx, k_idx, weights) and nothing of the main attention
    loss = lambda *a: kl(*a, indices=chosen).sum()
    grads = jax.jit(jax.grad(loss, argnums=tuple(range(5))))(q, k, *idx)
    assert not np.asarray(grads[0]).any() and not np.asarray(grads[1]).any()
    assert all(np.abs(np.asarray(g)).max() > 0 for g in grads[2:])
