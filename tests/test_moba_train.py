"""MoBA inside the model and the training loop: learning, hybrids, resume across the switch."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import tiny_overrides
from flax import nnx

from effattn_jax import checkpoint
from effattn_jax.config import ConfigError, load_config
from effattn_jax.data.pipeline import build_corpus, train_iterator
from effattn_jax.model import Transformer
from effattn_jax.sharding import make_mesh
from effattn_jax.train.loop import Preempted, run
from effattn_jax.train.metrics import read_scalars
from effattn_jax.train.state import make_setup
from effattn_jax.train.step import make_eval_step

pytestmark = pytest.mark.slow  # training runs

MOBA = {"attention.core": "moba", "moba.block_size": 8, "moba.top_k": 2}


def cfg_for(corpus_dir, run_dir, **extra):
    return load_config(None, tiny_overrides(corpus_dir, run_dir, **(MOBA | extra)))


def test_moba_model_learns_and_is_sparse(tmp_path, corpus_dir):
    """Learns, and really is MoBA: with the trained weights its loss differs from dense attention's
    at seq 32 (4 blocks of 8 > top_k 2), while on the first 16 tokens (S <= top_k * block) it is
    causal attention exactly."""
    cfg = cfg_for(corpus_dir, tmp_path / "run", **{"train.steps": 12})
    run(cfg)
    loss = [v for _, v in read_scalars(tmp_path / "run")["loss"]]
    assert sum(loss[-3:]) / 3 < sum(loss[:3]) / 3 - 1.0
    setup = make_setup(cfg, make_mesh(1, 1, 1))
    _, state = checkpoint.Checkpoints(tmp_path / "run").restore_latest(setup.abstract_state)
    tokens = jax.random.randint(jax.random.key(0), (2, 32), 0, 128)
    logits = lambda c: jax.jit(lambda p, t: make_setup(c, make_mesh(1, 1, 1)).model(p)(t))(
        state["params"], tokens
    )
    lm, ld = logits(cfg), logits(cfg.with_full_attention())
    assert float(jnp.abs(lm[:, 16:] - ld[:, 16:]).max()) > 1e-3
    np.testing.assert_allclose(lm[:, :16], ld[:, :16], atol=1e-5)


def test_switching_core_keeps_the_parameter_tree(tmp_path, corpus_dir):
    moba = cfg_for(corpus_dir, tmp_path)
    tree = lambda cfg: nnx.state(Transformer(cfg, rngs=nnx.Rngs(0)), nnx.Param)
    same = lambda a, b: (
        [(p, v.shape) for p, v in nnx.to_flat_state(a)] == [(p, v.shape) for p, v in nnx.to_flat_state(b)]
    )
    assert same(tree(moba), tree(moba.with_full_attention()))


def test_hybrids_train_and_resume_across_the_switch(tmp_path, corpus_dir):
    """Layer-wise hybrid (last layer dense) plus a MoBA -> dense switch at step 4.

    The step after the switch trains with dense attention (its logged loss is the dense model's
    on that batch, not MoBA's); the hybrid's loss differs from both all-MoBA and all-dense on the
    same weights (each layer runs its own core); a run cut at the switch and resumed ends as an
    uninterrupted one does."""
    extra = {
        "attention.last_layers.n": 1,
        "attention.last_layers.core": "dense",
        "moba.full_attention_from_step": 4,
    }
    full = run(cfg_for(corpus_dir, tmp_path / "full", **extra))
    cfg = cfg_for(corpus_dir, tmp_path / "cut", **extra)
    with pytest.raises(Preempted):
        run(cfg, stop_at=4)

    # What step 5 sees: the weights after step 4 and the next batch, under each attention setting.
    setup = make_setup(cfg, make_mesh(1, 1, 1))
    corpus = build_corpus(cfg.data)
    data_iter = train_iterator(corpus.train, batch_size=cfg.data.batch_size, seed=cfg.data.seed)
    step, state = checkpoint.Checkpoints(tmp_path / "cut").restore_latest(setup.abstract_state, data_iter)
    assert step == 4
    batch = next(data_iter)
    settings = {
        "hybrid": cfg,
        "dense": cfg.with_full_attention(),
        "moba": cfg_for(corpus_dir, tmp_path / "x"),
    }
    loss = {}
    for name, c in settings.items():
        total, count = make_eval_step(make_setup(c, make_mesh(1, 1, 1)))(state["params"], batch)
        loss[name] = float(total) / float(count)
    # 4 steps in, the cores' losses differ by a few 1e-4 nats, far above float32 noise (~1e-6)
    gap = min(abs(loss["hybrid"] - loss["dense"]), abs(loss["hybrid"] - loss["moba"]))
    assert gap > 1e-4, loss

    resumed = run(cfg)
    logged = dict(read_scalars(tmp_path / "cut")["loss"])
    assert logged[5] == pytest.approx(loss["dense"], abs=2e-5)  # step 5 trained dense
    la, lb = read_scalars(tmp_path / "full")["loss"], read_scalars(tmp_path / "cut")["loss"]
    assert la[-1] == lb[-1] and resumed["val_loss"] == full["val_loss"]


def test_moba_config_errors(tmp_path, corpus_dir):
    with pytest.raises(ConfigError, match="moba.block_size"):
        cfg_for(corpus_dir, tmp_path, **{"moba.block_size": 64})  # > data.seq_len=32
    with pytest.raises(ConfigError, match="moba.impl"):
        cfg_for(corpus_dir, tmp_path, **{"moba.impl": "cuda"})
    with pytest.raises(ConfigError, match="full_attention_from_step"):
        load_config(None, ["moba.full_attention_from_step=5"])  # no MoBA layer to switch
