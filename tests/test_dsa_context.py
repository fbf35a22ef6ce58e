"""DSA over 4 context shards equals one device (docs/dsa.md, "Context parallelism"): the output,
the indexer's KL per query and every gradient, both stages, packed documents; and a DSA model's
loss, KL and gradients match between context degrees."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import TINY_MLA
from jax.sharding import NamedSharding, PartitionSpec
from test_context_parallel import packed_batch, packed_segments

from effattn_jax.config import load_config
from effattn_jax.ops.context_parallel import balanced_order
from effattn_jax.ops.dense import dense_attention
from effattn_jax.ops.dsa import dsa_select, dsa_sparse_attention, indexer_kl_loss, sparse_attention
from effattn_jax.ops.dsa_context import dsa_context_attention
from effattn_jax.sharding import make_mesh
from effattn_jax.train.state import init_state, make_setup
from effattn_jax.train.step import loss_terms

B, S, H, HKV, D, HI, DI, TOP_K = 2, 64, 2, 1, 8, 2, 8, 5


def one_device(q, k, v, q_idx, k_idx, weights, seg, stage):
    """The single-device core: what `_dsa_core` runs without a context axis."""
    if stage == "warmup":
        out = dense_attention(q, k, v, segment_ids=seg)
        return out, indexer_kl_loss(q, k, q_idx, k_idx, weights, segment_ids=seg)
    indices = dsa_select(q_idx, k_idx, weights, top_k=TOP_K, segment_ids=seg)
    return sparse_attention(q, k, v, indices), indexer_kl_loss(q, k, q_idx, k_idx, weights, indices=indices)


@pytest.mark.parametrize(
    "stage, sparse",
    [("sparse", None), ("warmup", None), ("sparse", "pallas_triton"), ("sparse", "pallas_tpu")],
)
def test_over_context_shards_matches_one_device(stage, sparse):
    """Mesh (data=2, context=4), inputs in the balanced layout, against one device: out, the KL and
    the gradients of q, k, v (through the attention) and of q_idx, k_idx, weights (through the KL).
    Catches: a selection made at shard-local positions, indexer keys not gathered or put back in
    the wrong order, their gradient not reduce-scattered, a document mask from local segments.
    `sparse`: the selection at the shard's positions and the attention over it by that impl's
    kernels (interpreted) on each shard."""
    rng = np.random.default_rng(0)
    shapes = [(B, S, H, D), (B, S, HKV, D), (B, S, HKV, D), (B, S, HI, DI), (B, S, DI), (B, S, HI)]
    args = [jnp.asarray(rng.standard_normal(s), jnp.float32) for s in shapes]
    w_out, w_kl = jnp.asarray(rng.standard_normal((B, S, H, D))), jnp.asarray(rng.random((B, S)))
    seg = jnp.asarray(packed_segments(B, S))
    mesh, order = make_mesh(2, 1, 1, context=4), balanced_order(S, 4)
    rules = (("batch", ("data",)), ("length", ("context",)))

    def objective(out, kl, at=slice(None)):
        return jnp.sum(out * w_out[:, at]) + jnp.sum(kl * w_kl[:, at])

    def parallel(*xs):
        with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
            out, kl = dsa_context_attention(
                *(x[:, order] for x in xs), top_k=TOP_K, stage=stage, segment_ids=seg[:, order],
                scale=D**-0.5, rules=rules, sparse=sparse and dsa_sparse_attention(sparse),
                impl=sparse or "xla",
            )  # fmt: skip
        return objective(out, kl, order)

    plain = lambda *xs: objective(*one_device(*xs, seg, stage))
    argnums = tuple(range(6))
    want, want_grads = jax.value_and_grad(plain, argnums)(*args)
    put = lambda x: jax.device_put(x, NamedSharding(mesh, PartitionSpec("data", "context")))
    got, got_grads = jax.jit(jax.value_and_grad(parallel, argnums))(*map(put, args))
    np.testing.assert_allclose(got, want, rtol=1e-5)
    for name, g, ref in zip(["q", "k", "v", "q_idx", "k_idx", "weights"], got_grads, want_grads, strict=True):
        assert np.abs(ref).max() > 0, name  # each input reaches the objective
        np.testing.assert_allclose(g, ref, rtol=1e-4, atol=1e-5, err_msg=name)


@pytest.mark.slow
@pytest.mark.parametrize("stage", ["sparse", "warmup", "sparse-absorbed"])
def test_model_terms_and_gradients_over_context_shards(stage):
    """An MLA model with DSA (absorbed keys whole on every shard, the indexer reading c'): the LM
    loss, the indexers' KL and every parameter's gradient of LM + KL with mesh (data=2, context=4)
    equal (data=2), packed documents. Catches: the indexer keys of a shard only, the KL summed
    over the wrong queries, RoPE positions of the shard."""
    stage, _, absorbed = stage.partition("-")  # sparse-absorbed: dsa.absorb's latent rows as one KV head
    layers = ["attention.kind=mla", "mla.q_lora_rank=12", "attention.core=dsa", f"dsa.stage={stage}"]
    layers += ["dsa.absorb=true"] if absorbed else []
    dsa = ["dsa.index_head_dim=8", "dsa.index_n_heads=2", "dsa.index_topk=6"]
    # init_std 0.2: peaked attention, so the KL is far from 0 and a wrong selection shows in it
    sizes = ["model.num_layers=2", "data.seq_len=64", "data.batch_size=2", "model.init_std=0.2"]
    cfg = load_config(None, TINY_MLA + layers + dsa + sizes)
    batch, results = packed_batch(), []
    for context in (1, 4):
        setup = make_setup(cfg, make_mesh(2, 1, 1, context=context))
        params = init_state(setup)["params"]

        def terms_and_grads(params, batch, setup=setup):
            def objective(p):
                nll, kl, tokens = loss_terms(setup.model(p), batch)
                return nll + kl, (nll, kl)

            with jax.sharding.use_abstract_mesh(setup.mesh.abstract_mesh):
                (_, terms), grads = jax.value_and_grad(objective, has_aux=True)(params)
            return terms, grads

        results.append(jax.jit(terms_and_grads)(params, jax.device_put(batch, setup.batch_sharding())))
    (want, want_grads), (got, got_grads) = results
    np.testing.assert_allclose(got, want, rtol=1e-5)
    for g, w in zip(jax.tree.leaves(got_grads), jax.tree.leaves(want_grads), strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5)
