"""Context parallelism, dense core: one sequence over 4 context shards equals one device."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from effattn_jax.ops.context_parallel import balanced_order, context_dense_attention, context_split_error
from effattn_jax.ops.dense import dense_attention


def test_balanced_order_gives_every_shard_equal_causal_work():
    """Shard i holds chunks i and 2N-1-i; the keys each shard's queries see sum to the same count.
    Catches: a plain contiguous split (the last shard would do 2N-1 times the first's work)."""
    order = balanced_order(16, 2)
    assert order.tolist() == [0, 1, 2, 3, 12, 13, 14, 15, 4, 5, 6, 7, 8, 9, 10, 11]
    work = [(order.reshape(2, -1)[i] + 1).sum() for i in range(2)]  # keys seen by each shard's queries
    assert len(set(work)) == 1
    assert sorted(balanced_order(64, 4)) == list(range(64))
    assert context_split_error(64, 4, block_size=8) is None
    assert "multiple of moba.block_size=16" in context_split_error(64, 4, block_size=16)
    with pytest.raises(ValueError, match="a multiple of 8"):
        balanced_order(60, 4)


def test_dense_attention_over_context_shards_matches_one_device():
    """Mesh (data=2, context=4), packed documents whose boundaries fall inside and across chunks:
    output and the gradients of q, k, v equal plain dense attention. Catches: a mask built from the
    shard-local index instead of the true positions, a missing reduce-scatter of dK/dV."""
    b, s, hq, hkv, d = 2, 64, 4, 2, 8
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.standard_normal((b, s, h, d)), jnp.float32) for h in (hq, hkv, hkv))
    segments = np.ones((b, s), np.int32)
    segments[0, 13:] = 2  # inside the first chunk (of 8 tokens)
    segments[0, 40:] = 3  # on a chunk boundary
    segments[1, 30:] = 2
    segments = jnp.asarray(segments)
    weights = jnp.asarray(rng.standard_normal((b, s, hq, d)), jnp.float32)

    def reference(q, k, v):
        return jnp.sum(dense_attention(q, k, v, segment_ids=segments) * weights)

    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("data", "context"))
    order = balanced_order(s, 4)
    inverse = np.argsort(order)
    put = lambda x: jax.device_put(
        x, NamedSharding(mesh, PartitionSpec("data", "context", *[None] * (x.ndim - 2)))
    )
    positions = put(jnp.broadcast_to(jnp.asarray(order, jnp.int32), (b, s)))
    seg = put(segments[:, order])

    def parallel(q, k, v):
        out = context_dense_attention(
            put(q[:, order]), put(k[:, order]), put(v[:, order]), positions, seg, mesh=mesh, batch_axis="data"
        )
        return jnp.sum(out[:, inverse] * weights)

    want, want_grads = jax.value_and_grad(reference, argnums=(0, 1, 2))(q, k, v)
    got, got_grads = jax.jit(jax.value_and_grad(parallel, argnums=(0, 1, 2)))(q, k, v)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)
    for g, w in zip(got_grads, want_grads, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5)
