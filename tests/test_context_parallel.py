"""Context parallelism: one sequence over 4 context shards equals one device, for both cores and
every attention kind, and training moves between context degrees (docs/context_parallel.md)."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import TINY_MLA, tiny_overrides
from jax.sharding import NamedSharding, PartitionSpec

from effattn_jax.config import ConfigError, check_context_split, context_split_error, load_config
from effattn_jax.ops.context_parallel import balanced_order
from effattn_jax.ops.dense import dense_attention
from effattn_jax.ops.moba import BlockSizes, moba_attention
from effattn_jax.ops.routing import moba_routing
from effattn_jax.ops.segments import block_starts
from effattn_jax.sharding import make_mesh
from effattn_jax.train.loop import Preempted, run
from effattn_jax.train.metrics import read_scalars
from effattn_jax.train.state import init_state, make_setup
from effattn_jax.train.step import loss_sums
from pallas_kernels.common import gpu_lowering_target
from pallas_kernels.moba.context import moba_pallas_local


def packed_segments(b: int, s: int) -> np.ndarray:
    """Document boundaries inside a chunk (of s / 8 tokens), on a chunk boundary and across one."""
    seg = np.ones((b, s), np.int32)
    seg[0, 13:] = 2
    seg[0, 40:] = 3
    seg[1, 30:] = 2
    return seg


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


def test_start_up_check_rejects_chunks_that_split_a_block():
    cfg = load_config(None, ["attention.core=moba", "moba.block_size=16", "data.seq_len=96"])
    with pytest.raises(ConfigError, match=r"data.seq_len.*chunks of 12 tokens.*moba.block_size=16"):
        check_context_split(cfg, {"context": 4})
    with pytest.raises(ConfigError, match="a multiple of 8"):
        check_context_split(load_config(None, ["data.seq_len=100"]), {"context": 4})
    with pytest.raises(ConfigError, match="moba.impl"):
        check_context_split(
            load_config(None, ["attention.core=moba", "moba.block_size=16", "moba.impl=reference"]),
            {"context": 2},
        )
    check_context_split(cfg, {"context": 1})  # one shard: anything goes


def packed_batch() -> dict:
    """A training batch of 2 rows of 64 tokens with packed_segments' documents, 10 % unscored."""
    rng = np.random.default_rng(1)
    return {
        "inputs": rng.integers(0, 128, (2, 64), dtype=np.int32),
        "targets": rng.integers(0, 128, (2, 64), dtype=np.int32),
        "segment_ids": packed_segments(2, 64),
        "loss_mask": (rng.random((2, 64)) < 0.9).astype(np.float32),
    }


def assert_matches_one_device(op, reference, s: int, seg_of, seed: int):
    """op(q, k, v, seg, rules) over mesh (data=2, context=4), its inputs in the balanced layout,
    against reference(q, k, v, seg) on one device: the output and dq, dk, dv (batch 2, GQA: 2
    query heads on 1 KV head, head dim 8)."""
    b, hq, hkv, d = 2, 2, 1, 8
    rng = np.random.default_rng(seed)
    q, k, v, w = (jnp.asarray(rng.standard_normal((b, s, h, d)), jnp.float32) for h in (hq, hkv, hkv, hq))
    seg = jnp.asarray(seg_of(b))
    mesh = make_mesh(2, 1, 1, context=4)
    order = balanced_order(s, 4)
    rules = (("batch", ("data",)), ("length", ("context",)))

    def parallel(q, k, v):
        with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
            out = op(q[:, order], k[:, order], v[:, order], seg[:, order], rules)
        return jnp.sum(out * w[:, order])

    plain = lambda q, k, v: jnp.sum(reference(q, k, v, seg) * w)
    want, want_grads = jax.value_and_grad(plain, argnums=(0, 1, 2))(q, k, v)
    put = lambda x: jax.device_put(x, NamedSharding(mesh, PartitionSpec("data", "context")))
    got, got_grads = jax.jit(jax.value_and_grad(parallel, argnums=(0, 1, 2)))(put(q), put(k), put(v))
    np.testing.assert_allclose(got, want, rtol=1e-5)
    for g, ref in zip(got_grads, want_grads, strict=True):
        np.testing.assert_allclose(g, ref, rtol=1e-4, atol=1e-5)


def test_splash_over_context_shards_matches_one_device():
    """The dense core through splash (interpreted): each shard's two runs of queries against
    windows of the gathered keys equal plain attention on one device, packed documents.
    Catches: a window off by a chunk, a padded key (before position 0) that a query can see."""
    assert_matches_one_device(  # splash's blocks are 128 keys: chunks of 128
        lambda q, k, v, seg, rules: dense_attention(q, k, v, segment_ids=seg, impl="splash", rules=rules),
        lambda q, k, v, seg: dense_attention(q, k, v, segment_ids=seg),
        1024,
        lambda b: np.repeat(packed_segments(b, 64), 16, axis=1),
        seed=0,
    )


@pytest.mark.slow  # interpreted kernels
@pytest.mark.parametrize("impl", ["pallas_tpu", "pallas_gpu"])
def test_moba_kernels_over_context_shards_match_one_device(impl):
    """MoBA through each backend's kernels (interpreted): each run's own block in a window of its
    own, the selected blocks from the gathered keys, equal to the XLA path on one device, packed
    documents. Catches: a window off by a block, a dummy query's gradient leaking into dK/dV, a
    run's dK/dV added at the wrong place, a selected block's dK/dV (GPU: found from the keys'
    block starts) added to the wrong keys."""
    sizes = BlockSizes(q_tile=8, kv_block=8, past_q_tile=8)
    moba = lambda q, k, v, seg, impl, rules=None: moba_attention(
        q, k, v, block_size=8, top_k=3, segment_ids=seg, impl=impl, rules=rules, block_sizes=sizes
    )
    pallas = lambda q, k, v, seg, rules: moba(q, k, v, seg, impl, rules)
    xla = lambda q, k, v, seg: moba(q, k, v, seg, "xla")
    assert_matches_one_device(pallas, xla, 64, lambda b: packed_segments(b, 64), seed=2)


@pytest.mark.slow
def test_model_loss_and_gradients_over_context_shards():
    """The loss and every parameter's gradient with mesh (data=2, context=4) equal (data=2) for a
    hybrid of every attention kind, GQA (4 query heads, 2 KV) and MoBA over per-head keys, dense
    MLA, MoBA EG-MLA over its latent (MoBA's XLA path; the dense core over per-head keys is the
    training test's), with packed documents whose boundaries
    fall inside and across chunks. Catches: a mask or block built from the shard-local index
    instead of the true position, a chunk put back in the wrong order, dK/dV not summed over
    the shards, RoPE positions of the shard instead of the document, MLA's latent or EG-MLA's
    token ids not gathered whole."""
    sizes = ["model.num_layers=3", "model.num_kv_heads=2", "data.seq_len=64", "data.batch_size=2"]
    layers = ["attention.layers=[mha:moba,mla:dense,eg_mla:moba]", "moba.block_size=4", "moba.top_k=3"]
    cfg = load_config(None, TINY_MLA + layers + sizes)
    batch, results = packed_batch(), []
    for context in (1, 4):
        setup = make_setup(cfg, make_mesh(2, 1, 1, context=context))
        params = init_state(setup)["params"]

        def loss_and_grads(params, batch, setup=setup):
            with jax.sharding.use_abstract_mesh(setup.mesh.abstract_mesh):
                grad = jax.value_and_grad(lambda p: loss_sums(setup.model(p), batch), has_aux=True)
                (total, count), grads = grad(params)
            return total / count, grads

        results.append(jax.jit(loss_and_grads)(params, jax.device_put(batch, setup.batch_sharding())))
    (want, want_grads), (got, got_grads) = results
    np.testing.assert_allclose(got, want, rtol=1e-5)
    for g, w in zip(jax.tree.leaves(got_grads), jax.tree.leaves(want_grads), strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_training_over_context_shards_matches_and_resumes_across_degrees(tmp_path, corpus_dir):
    """10 dense GQA steps with mesh.context=4 log the losses of mesh.context=1; a run saved at
    context 4 resumes at context 1 and again at 4 on the same losses."""
    common = {
        "data.seq_len": 64, "data.batch_size": 2, "mesh.data": 2, "train.steps": 10,
        "checkpoint.every_steps": 4, "eval.every_steps": 100,
    }  # fmt: skip
    config = lambda run_dir, context: load_config(
        None, tiny_overrides(corpus_dir, run_dir, **common, **{"mesh.context": context})
    )
    losses = lambda run_dir: [v for _, v in read_scalars(run_dir)["loss"]]
    run(config(tmp_path / "one", 1))
    with pytest.raises(Preempted):
        run(config(tmp_path / "moved", 4), stop_at=4)
    with pytest.raises(Preempted):
        run(config(tmp_path / "moved", 1), stop_at=8)
    run(config(tmp_path / "moved", 4))
    want, got = losses(tmp_path / "one"), losses(tmp_path / "moved")
    assert len(want) == len(got) == 10
    np.testing.assert_allclose(got, want, rtol=2e-5)


@pytest.mark.slow
@pytest.mark.parametrize("kernel", ["mosaic", "triton"])
def test_moba_gpu_kernels_over_a_shard_lower_for_cuda(kernel):
    """A context shard's MoBA through the GPU kernels lowers for CUDA (jax.export, no GPU), forward
    and backward: shard 0 of 2 (chunks 0 and 3 of 256 queries) against 1,024 gathered keys, block
    128; `mosaic` (the Mosaic GPU kernels) and `triton` (the six Triton kernels, by
    name). Catches: a window shape a lowering rejects (interpret mode accepts it), a kernel
    replaced by an XLA fallback."""
    firsts, c = (0, 768), 128
    q_index = jnp.concatenate([jnp.arange(f, f + 256) for f in firsts])[None]

    def loss(q, k, v):
        r = moba_routing(q, k, block_size=c, top_k=3, q_index=q_index)
        out = moba_pallas_local(
            q, k, v, r.own_start, r.past_start, block_starts(None, 1, 1024, c), firsts, c, 128**-0.5,
            kernel, False, BlockSizes(64, 64),
        )  # fmt: skip
        return out.astype(jnp.float32).sum()

    q, kv = (jax.ShapeDtypeStruct((1, s, 2, 128), jnp.bfloat16) for s in (512, 1024))
    triton = jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")  # not a stable-ABI call
    grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    with gpu_lowering_target():
        exported = jax.export.export(grad, platforms=["cuda"], disabled_checks=[triton])(q, kv, kv)
    text = exported.mlir_module()
    names = set(re.findall(r'name = "(moba_\w+_gpu)"', text))
    if kernel == "triton":
        assert names == {f"moba_{k}_{p}_gpu" for k in ("own", "block") for p in ("fwd", "dq", "dkv")}
    else:
        calls = len(re.findall(r"stablehlo.custom_call @mosaic_gpu", text))
        assert not names and calls == 2 * 3 + 3  # the own block's three per chunk, the blocks' three
