"""The chunked output-head cross-entropy against the plain loss: value and gradients."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from effattn_jax.ops.cross_entropy import chunked_cross_entropy


def plain_loss(x, w, targets, weights):
    logits = jnp.einsum("bsd,dv->bsv", x, w, preferred_element_type=jnp.float32)
    return jnp.sum(optax.softmax_cross_entropy_with_integer_labels(logits, targets) * weights)


def inputs(dtype, b=2, s=12, d=16, v=200, seed=0):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((b, s, d)), dtype)
    w = jnp.asarray(rng.standard_normal((d, v)), dtype)
    targets = jnp.asarray(rng.integers(0, v, (b, s)), jnp.int32)
    weights = jnp.asarray(rng.random((b, s)) > 0.3, jnp.float32)
    return x, w, targets, weights


@pytest.mark.parametrize("chunk_tokens", [2, 8, 6, 1 << 20])  # c = 1, 4, 3, the whole sequence
def test_value_and_grads_match_plain_loss(chunk_tokens):
    args = inputs(jnp.float32)
    loss = jax.jit(
        jax.value_and_grad(
            lambda x, w: chunked_cross_entropy(x, w, *args[2:], chunk_tokens=chunk_tokens), (0, 1)
        )
    )
    ref = jax.value_and_grad(lambda x, w: plain_loss(x, w, *args[2:]), (0, 1))
    (value, grads), (ref_value, ref_grads) = loss(*args[:2]), ref(*args[:2])
    np.testing.assert_allclose(value, ref_value, rtol=1e-5)
    for g, r in zip(grads, ref_grads, strict=True):
        np.testing.assert_allclose(g, r, rtol=1e-4, atol=1e-5)
    # undifferentiated: the forward pass alone, same value
    np.testing.assert_allclose(chunked_cross_entropy(*args, chunk_tokens=chunk_tokens), ref_value, rtol=1e-5)


def test_bfloat16_inputs_and_a_scaled_cotangent():
    x, w, targets, weights = inputs(jnp.bfloat16)
    scaled = jax.grad(
        lambda x, w: 0.25 * chunked_cross_entropy(x, w, targets, weights, chunk_tokens=8), (0, 1)
    )
    ref = jax.grad(
        lambda x, w: 0.25 * plain_loss(x.astype(jnp.float32), w.astype(jnp.float32), targets, weights), (0, 1)
    )
    for g, r in zip(scaled(x, w), ref(x, w), strict=True):
        assert g.dtype == jnp.bfloat16
        np.testing.assert_allclose(g.astype(np.float32), r, rtol=0.05, atol=0.02)


def test_never_holds_the_full_logits():
    """The largest intermediate of the differentiated loss is one chunk of logits, not [B, S, V]."""
    x, w, targets, weights = inputs(jnp.float32, b=2, s=64, d=8, v=512)
    grad = jax.jit(
        jax.grad(lambda x, w: chunked_cross_entropy(x, w, targets, weights, chunk_tokens=16), (0, 1))
    )
    hlo = grad.lower(x, w).compile().as_text()
    assert "f32[2,64,512]" not in hlo and "f32[128,512]" not in hlo
    assert "f32[2,8,512]" in hlo  # the chunk: 2 rows x 8 positions
