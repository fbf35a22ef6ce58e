"""The dense core's one dispatch: which path each backend gets, splash attention (jax's
Pallas TPU kernel) against the XLA path in interpret mode, and a real TPU compile."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import v5e_arg

from effattn_jax.ops.dense import dense_attention, resolve_dense_impl, splash_attention


def _qkv(dtype=jnp.float32, b=2, s=256, hq=4, hkv=2, d=16, dv=32):
    rng = np.random.default_rng(0)
    f = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32).astype(dtype)
    return f(b, s, hq, d), f(b, s, hkv, d), f(b, s, hkv, dv)


def test_each_backend_gets_its_path():
    q, _, v = _qkv(jnp.bfloat16, d=64, dv=64)
    assert resolve_dense_impl("auto", q, v, "tpu") == "splash"
    assert resolve_dense_impl("auto", q, v, "gpu") == "cudnn"
    assert resolve_dense_impl("auto", q, v, "cpu") == "xla"
    assert resolve_dense_impl("xla", q, v, "tpu") == "xla"  # an explicit choice stands
    q32, _, v32 = _qkv(jnp.float32, d=64, dv=64)
    assert resolve_dense_impl("auto", q32, v32, "gpu") == "xla"  # cuDNN: bf16/fp16 only
    q_mla, _, v_mla = _qkv(jnp.bfloat16, d=48, dv=32)
    assert resolve_dense_impl("auto", q_mla, v_mla, "gpu") == "xla"  # MLA: q/k wider than v
    with pytest.raises(ValueError, match="impl='flash'"):
        dense_attention(q, q, q, impl="flash")
    with pytest.raises(ValueError, match="not a multiple of its block 512"):
        dense_attention(*_qkv(s=1000), impl="splash")


@pytest.mark.slow
def test_splash_matches_xla_forward_and_gradients():
    """GQA, a value width unlike q/k's (MLA), packed documents crossing kernel blocks."""
    q, k, v = _qkv()
    seg = jnp.asarray(np.stack([np.repeat([1, 2, 3], [100, 100, 56])] * 2), jnp.int32)
    w = jnp.asarray(np.random.default_rng(1).standard_normal((2, 256, 4, 32)), jnp.float32)
    xla = lambda q, k, v: dense_attention(q, k, v, segment_ids=seg)
    splash = lambda q, k, v: splash_attention(q, k, v, segment_ids=seg, scale=0.25, block=128, interpret=True)
    outs, grads = [], []
    for f in (xla, splash):
        outs.append(f(q, k, v))
        grads.append(jax.grad(lambda q, k, v, f=f: jnp.sum(f(q, k, v) * w), argnums=(0, 1, 2))(q, k, v))
    np.testing.assert_allclose(outs[1], outs[0], atol=1e-5, rtol=1e-5)
    for a, b in zip(grads[1], grads[0], strict=True):
        np.testing.assert_allclose(a, b, atol=1e-4, rtol=1e-4)


@pytest.mark.slow
def test_splash_compiles_for_a_real_tpu():
    """Mosaic lowering and a libtpu compile (no TPU needed) of forward + backward through the
    dispatch, bf16, head dim 128, 4 query heads on 2 KV heads, packed documents."""
    arg = v5e_arg()
    q, kv, seg = arg((1, 1024, 4, 128)), arg((1, 1024, 2, 128)), arg((1, 1024), jnp.int32)

    def loss(q, k, v, seg):
        return dense_attention(q, k, v, segment_ids=seg, impl="splash").astype(jnp.float32).sum()

    lowered = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, kv, kv, seg)
    assert lowered.as_text().count("tpu_custom_call") >= 2  # forward and backward kernels
    lowered.compile()
