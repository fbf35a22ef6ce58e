"""MoBA inside the model and the training loop: learning, hybrids, resume across the switch."""

import pytest
from conftest import tiny_overrides
from flax import nnx

from effattn_jax.config import ConfigError, load_config
from effattn_jax.model import Transformer
from effattn_jax.train.loop import Preempted, run
from effattn_jax.train.metrics import read_scalars

MOBA = {"attention.core": "moba", "moba.block_size": 8, "moba.top_k": 2}


def cfg_for(corpus_dir, run_dir, **extra):
    return load_config(None, tiny_overrides(corpus_dir, run_dir, **(MOBA | extra)))


def test_moba_model_learns(tmp_path, corpus_dir):
    run(cfg_for(corpus_dir, tmp_path / "run", **{"train.steps": 12}))
    loss = [v for _, v in read_scalars(tmp_path / "run")["loss"]]
    assert sum(loss[-3:]) / 3 < sum(loss[:3]) / 3 - 1.0


def test_switching_core_keeps_the_parameter_tree(tmp_path, corpus_dir):
    moba = cfg_for(corpus_dir, tmp_path)
    tree = lambda cfg: nnx.state(Transformer(cfg, rngs=nnx.Rngs(0)), nnx.Param)
    same = lambda a, b: (
        [(p, v.shape) for p, v in nnx.to_flat_state(a)] == [(p, v.shape) for p, v in nnx.to_flat_state(b)]
    )
    assert same(tree(moba), tree(moba.with_full_attention()))


def test_hybrids_train_and_resume_across_the_switch(tmp_path, corpus_dir):
    """Layer-wise hybrid (last layer dense) plus a MoBA -> dense switch at step 3; a run cut
    at step 2 and resumed gives the same final loss as an uninterrupted one."""
    extra = {
        "attention.last_layers.n": 1,
        "attention.last_layers.core": "dense",
        "moba.full_attention_from_step": 3,
    }
    full = run(cfg_for(corpus_dir, tmp_path / "full", **extra))
    with pytest.raises(Preempted):
        run(cfg_for(corpus_dir, tmp_path / "cut", **extra), stop_at=2)
    resumed = run(cfg_for(corpus_dir, tmp_path / "cut", **extra))
    la, lb = read_scalars(tmp_path / "full")["loss"], read_scalars(tmp_path / "cut")["loss"]
    assert la[-1] == lb[-1] and resumed["val_loss"] == full["val_loss"]


def test_moba_config_errors(tmp_path, corpus_dir):
    with pytest.raises(ConfigError, match="moba.block_size"):
        cfg_for(corpus_dir, tmp_path, **{"moba.block_size": 64})  # > data.seq_len=32
    with pytest.raises(ConfigError, match="moba.impl"):
        cfg_for(corpus_dir, tmp_path, **{"moba.impl": "cuda"})
    with pytest.raises(ConfigError, match="full_attention_from_step"):
        load_config(None, ["moba.full_attention_from_step=5"])  # no MoBA layer to switch
