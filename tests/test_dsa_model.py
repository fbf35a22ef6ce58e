"""DSA as a core (`attention.core=dsa`, docs/dsa.md): the layers' indexer, both training stages,
the KL loss's reach, decoding over the cache, the cache figure and the optimizer's split."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import ROOT, TINY_MLA, saved_fresh_run, tiny_overrides
from flax import nnx

from effattn_jax import checkpoint
from effattn_jax.config import load_config
from effattn_jax.flops import attention_flops_per_token, mean_attended_keys
from effattn_jax.model import Transformer, init_cache, new_model
from effattn_jax.sharding import make_mesh
from effattn_jax.train.loop import run
from effattn_jax.train.metrics import read_scalars
from effattn_jax.train.state import (
    clip_indexers_apart,
    in_indexer,
    init_state,
    keep_only_indexers,
    make_setup,
)
from effattn_jax.train.step import loss_terms, make_train_step
from eval.decoding import kv_cache_report

DSA = ["attention.core=dsa", "dsa.index_n_heads=3", "dsa.index_head_dim=8", "dsa.index_topk=5"]
KINDS = {"mha": ["model.num_kv_heads=2"], "mla": ["attention.kind=mla"], "eg_mla": ["attention.kind=eg_mla"]}


def model_for(*overrides, seed=0):
    return Transformer(load_config(None, TINY_MLA + list(overrides)), rngs=nnx.Rngs(seed))


def _without_indexers(model):
    """The model's parameters outside its indexers, by path."""
    pairs = jax.tree_util.tree_flatten_with_path(nnx.to_pure_dict(nnx.state(model, nnx.Param)))[0]
    return {jax.tree_util.keystr(p): x for p, x in pairs if not in_indexer(p)}


def _packed():
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(0, 128, (2, 24)))
    seg = jnp.asarray(np.repeat([[1, 2]], [13, 11], axis=1).reshape(1, 24).repeat(2, 0))
    return tokens, seg


@pytest.mark.parametrize("kind", list(KINDS))
def test_topk_over_the_sequence_is_the_dense_model(kind):
    """The indexer is made last, so the other parameters are the dense model's; with top-k at least
    the sequence (sparse stage) or in the warm-up stage the logits are the dense model's. Catches:
    the indexer drawing before the attention's weights, a core that drops a key."""
    dense = model_for(*KINDS[kind])
    tokens, seg = _packed()
    want = dense(tokens, seg)
    for stage_args in (["dsa.index_topk=24"], ["dsa.stage=warmup"]):
        dsa = model_for(*KINDS[kind], *DSA, *stage_args)
        rest, dense_params = _without_indexers(dsa), _without_indexers(dense)
        assert rest.keys() == dense_params.keys()
        for name, x in rest.items():
            np.testing.assert_array_equal(x, dense_params[name])
        np.testing.assert_allclose(dsa(tokens, seg), want, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("scan", [True, False], ids=["scanned", "unrolled"])
def test_sparse_model_equals_its_dense_mask_reference(scan):
    """Top-5 of 13 and 11 tokens: the XLA path (gathered rows) equals the dense-mask reference, and
    differs from dense attention; the KL reaches the model's output per token, the same either way."""
    base = [*KINDS["mla"], *DSA, f"model.scan_layers={scan}"]
    tokens, seg = _packed()
    xla, ref = model_for(*base), model_for(*base, "dsa.impl=reference")
    got, want = xla.features_and_indexer_kl(tokens, seg), ref.features_and_indexer_kl(tokens, seg)
    np.testing.assert_allclose(got[0], want[0], atol=2e-5, rtol=2e-5)
    np.testing.assert_allclose(got[1], want[1], atol=1e-6, rtol=1e-5)
    assert got[1].shape == tokens.shape and float(got[1].min()) >= 0 and float(got[1].max()) > 0
    dense = model_for(*KINDS["mla"], f"model.scan_layers={scan}")
    assert not np.allclose(dense.features(tokens, seg), got[0], atol=1e-3)
    assert not nnx.state(xla, nnx.Intermediate)  # what the layers sowed was collected


@pytest.mark.parametrize("stage", ["warmup", "sparse"])
def test_lm_loss_never_reaches_the_indexer_and_kl_only_reaches_it(stage):
    """d(LM)/d(indexer) is exactly 0 and d(KL)/d(rest) is exactly 0; d(KL)/d(indexer) is not."""
    model = model_for(*KINDS["mla"], *DSA, "dsa.index_topk=4", f"dsa.stage={stage}")
    graphdef, params = nnx.split(model)
    tokens, seg = _packed()
    batch = {"inputs": tokens, "targets": jnp.roll(tokens, -1, 1), "segment_ids": seg}
    batch["loss_mask"] = jnp.ones(tokens.shape, jnp.float32)

    def terms(p, which):
        nll, kl, _ = loss_terms(nnx.merge(graphdef, p), batch)
        return nll if which == "lm" else kl

    for which, zero_in_indexer in (("lm", True), ("kl", False)):
        grads = jax.tree_util.tree_flatten_with_path(nnx.to_pure_dict(jax.grad(terms)(params, which)))[0]
        for path, g in grads:
            if in_indexer(path) == zero_in_indexer:
                assert not np.any(np.asarray(g)), (which, jax.tree_util.keystr(path))
        assert [path for path, g in grads if np.any(np.asarray(g))], which


def test_optimizer_clips_apart_and_the_warmup_freezes_the_rest():
    """Each group is clipped by its own norm (a huge model gradient leaves the indexer's alone); the
    warm-up's update is zero outside the indexers."""
    grads = {"attn": {"indexer": {"w": jnp.full((4,), 0.1)}, "q": jnp.full((4,), 100.0)}}
    clipped, _ = clip_indexers_apart(1.0).update(grads, optax.EmptyState())
    np.testing.assert_allclose(clipped["attn"]["indexer"]["w"], 0.1)
    assert float(optax.tree.norm(clipped["attn"]["q"])) == pytest.approx(1.0)
    kept, _ = keep_only_indexers().update(grads, optax.EmptyState())
    assert float(jnp.abs(kept["attn"]["q"]).max()) == 0
    np.testing.assert_array_equal(kept["attn"]["indexer"]["w"], grads["attn"]["indexer"]["w"])


@pytest.mark.parametrize(
    "kind, impl",
    [("mla", "xla"), ("eg_mla", "xla"), ("mla", "pallas_triton"), ("mla", "pallas_tpu")],
)
def test_absorbed_training_equals_the_per_head_form(kind, impl):
    """dsa.absorb=true (W_UK folded into the queries, attention over the gathered latent rows as
    one KV head, W_UV after) gives the per-head form's features, KL and gradients, on the XLA path
    and on the kernels (interpreted) with one KV head. Catches: the RoPE key or the scale left out
    of the latent scores, W_UV applied to the wrong axis, EG-MLA's gated latent not the one
    attended, the KL's target changed by the form."""
    tokens, seg = _packed()

    def run(*extra):
        model = model_for(*KINDS[kind], *DSA, f"dsa.impl={impl}", *extra)
        graphdef, params = nnx.split(model)

        def objective(p):
            features, kl = nnx.merge(graphdef, p).features_and_indexer_kl(tokens, seg)
            return jnp.sum(features**2) + jnp.sum(kl), (features, kl)

        return jax.value_and_grad(objective, has_aux=True)(params)

    (_, (want, want_kl)), want_grads = run()
    (_, (got, got_kl)), got_grads = run("dsa.absorb=true")
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(got_kl, want_kl, rtol=1e-4, atol=1e-6)
    for g, w in zip(jax.tree.leaves(got_grads), jax.tree.leaves(want_grads), strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("kind", list(KINDS))
def test_decode_equals_packed_forward(kind):
    """Two packed documents decoded as two rows: a right-padded prefill, a 3-token step, then single
    tokens, against the packed forward, top-5 (so the selection matters from the sixth token)."""
    model = model_for(*KINDS[kind], *DSA)
    la, lb = 13, 11
    tokens, seg = _packed()
    graphdef, params = nnx.split(model)
    want = np.asarray(jax.jit(lambda p, t, s: nnx.merge(graphdef, p)(t, s))(params, tokens[:1], seg[:1]))[0]
    want = [want[:la], want[la:]]
    decode = jax.jit(
        lambda p, t, pos, c, prefill: nnx.merge(graphdef, p).decode(t, pos, c, prefill=prefill),
        static_argnames="prefill",
    )
    rows = np.zeros((2, 16), np.int32)
    rows[0, :la], rows[1, :lb] = np.asarray(tokens[0, :la]), np.asarray(tokens[0, la:])
    caches, got = init_cache(model, 2, 16), [[], []]

    def run(start, ends, caches, prefill=False):
        t = max(ends) - start[0] if prefill else ends[0] - start[0]
        pos = np.stack([np.arange(s, s + t) for s in start]).astype(np.int32)
        logits, caches = decode(
            params, jnp.asarray(np.take_along_axis(rows, pos, 1)), jnp.asarray(pos), caches, prefill=prefill
        )
        for r in range(2):
            got[r].extend(np.asarray(logits[r, : ends[r] - start[r]]))
        return caches

    caches = run([0, 0], [4, 6], caches, prefill=True)
    caches = run([4, 6], [7, 9], caches)
    for step in range(2):
        caches = run([7 + step, 9 + step], [8 + step, 10 + step], caches)
    np.testing.assert_allclose(np.stack(got[0]), want[0][:9], atol=1e-4, rtol=1e-4)
    np.testing.assert_allclose(np.stack(got[1]), want[1][:11], atol=1e-4, rtol=1e-4)


def test_cache_holds_the_indexer_key():
    """Per token per layer: MLA's d_c + d_R, plus the indexer key's Di."""
    mla = kv_cache_report(load_config(None, TINY_MLA + KINDS["mla"]))["kv_elements_per_token"]
    dsa = kv_cache_report(load_config(None, TINY_MLA + KINDS["mla"] + DSA))["kv_elements_per_token"]
    assert mla == 2 * (16 + 4) and dsa == mla + 2 * 8


def test_flops_count_the_selected_keys_and_the_indexer():
    """Per layer: attention over min(K, t + 1) keys (every visible key in the warm-up), plus the
    indexer's 2 Hi Di per visible key (selection) and 3 x 2 Hi Di per key of its KL."""
    base = TINY_MLA + KINDS["mla"] + DSA + ["data.seq_len=8"]
    per_key, width = 2 * 3 * 8, 2 * (12 + 6) * 4  # 2 Hi Di; 2 (d_qk + d_v) H
    visible, selected = 4.5, mean_attended_keys(8, "dsa", top_k=5)
    for stage, keys in (("sparse", selected), ("warmup", visible)):
        cfg = load_config(None, [*base, f"dsa.stage={stage}"])
        want = 2 * (3 * width * keys + per_key * (visible + 3 * keys))
        assert attention_flops_per_token(cfg) == pytest.approx(want)
    # dsa.absorb: scores over [c ; k^R] (16 + 4) and values over c (16), per head
    absorbed = load_config(None, [*base, "dsa.absorb=true"])
    want = 2 * (3 * 2 * (20 + 16) * 4 * selected + per_key * (visible + 3 * selected))
    assert attention_flops_per_token(absorbed) == pytest.approx(want)


@pytest.mark.slow
def test_warmup_starts_from_a_dense_run_and_trains_only_the_indexers(tmp_path, corpus_dir):
    """train.init_from a dense run's step into dsa.stage=warmup: the indexers start fresh, everything
    else is the source's and stays so; the indexers move and `indexer_kl` is logged. Catches: a
    dense source refused for lacking indexers, frozen weights moving (weight decay included)."""
    src = tmp_path / "dense"
    saved_fresh_run(src, ["attention.kind=mla"])
    dsa = [*KINDS["mla"], *DSA, "dsa.index_head_dim=16", "dsa.stage=warmup", f"train.init_from={src}"]
    cfg = load_config(None, tiny_overrides(corpus_dir, tmp_path / "dsa", **{"train.steps": 2}) + dsa)
    run(cfg)
    (_, _, before), (_, _, after) = (
        checkpoint.load_params(src, 0),
        checkpoint.load_params(tmp_path / "dsa", 2),
    )
    flat = lambda params: {
        jax.tree_util.keystr(p): x for p, x in jax.tree_util.tree_flatten_with_path(params)[0]
    }
    before, after = flat(before), flat(after)
    indexers = {name for name in after if "indexer" in name}
    assert indexers and set(after) - indexers == set(before)
    for name, x in before.items():
        np.testing.assert_array_equal(after[name], x, err_msg=name)
    fresh = flat(nnx.to_pure_dict(nnx.state(new_model(cfg), nnx.Param)))
    assert any(not np.array_equal(after[name], fresh[name]) for name in indexers)
    assert "indexer_kl" in read_scalars(tmp_path / "dsa")


def test_paper_configs_have_v32s_attention_shapes():
    """configs/dsa/paper: V3.2's MLA and indexer shapes; the cache adds the 128-wide indexer key to
    MLA's 512 + 64 in each of the 24 layers; the warm-up differs only in its stage and schedule,
    the 1M config in its length over the context axis."""
    cfg = load_config(ROOT / "configs/dsa/paper/dsa_v32_shapes.yaml")
    m = cfg.mla
    assert (m.kv_lora_rank, m.q_lora_rank, m.qk_nope_head_dim, m.qk_rope_head_dim) == (512, 1536, 128, 64)
    assert (cfg.dsa.index_n_heads, cfg.dsa.index_head_dim, cfg.dsa.index_topk) == (64, 128, 2048)
    assert kv_cache_report(cfg)["kv_elements_per_token"] == 24 * (512 + 64 + 128)
    warmup = load_config(ROOT / "configs/dsa/paper/dsa_v32_shapes_warmup.yaml")
    assert warmup.dsa.stage == "warmup" and (warmup.train.lr, warmup.train.steps) == (1e-3, 1000)
    long = load_config(ROOT / "configs/dsa/paper/dsa_v32_1m.yaml")
    assert (long.data.seq_len, long.mesh.context, long.dsa, long.mla) == (1 << 20, -1, cfg.dsa, cfg.mla)


@pytest.mark.slow
def test_warmup_key_leaves_a_model_without_dsa_layers_training_on_its_lm_loss(tmp_path):
    """dsa.stage=warmup only means something where a layer runs DSA: a dense model given it still
    trains every parameter on its LM loss. Catches: the warm-up's objective (KL alone) applied to a
    model with no indexer, which would leave it untrained."""
    cfg = load_config(None, [*TINY_MLA, "dsa.stage=warmup", "data.seq_len=16", "data.batch_size=2"])
    setup = make_setup(cfg, make_mesh(1, 1, 1))
    state = init_state(setup)
    tokens, seg = _packed()
    batch = {"inputs": tokens[:, :16], "targets": tokens[:, 1:17], "segment_ids": seg[:, :16]}
    batch["loss_mask"] = jnp.ones((2, 16), jnp.float32)
    before = jax.tree.leaves(jax.device_get(state["params"]))
    step = make_train_step(setup)
    new, metrics = step(*step(state, batch)[:1], batch)  # the schedule's first step has lr 0
    assert float(metrics["grad_norm"]) > 0 and "indexer_kl" not in metrics
    assert any(not np.array_equal(a, b) for a, b in zip(before, jax.tree.leaves(new["params"]), strict=True))
