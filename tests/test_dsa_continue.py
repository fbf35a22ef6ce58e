"""eval.dsa_continue: the dsa-continue-1k recipe's runs, their configs and parents, and a tiny
recipe run in which each run starts from its parent's last checkpoint (a missing parent trained
first), the summaries carry the indexer's KL and the report pairs DSA with full attention."""

import json

import pytest
from conftest import tiny_overrides

from effattn_jax import checkpoint
from effattn_jax.config import load_config
from eval import dsa_continue, ladder, sweep

CONTINUE = sweep.REPO / "configs/dsa/cpu/continue"
LADDER = sweep.REPO / "configs/moba/cpu/ladder"


def test_each_size_and_seed_warms_up_then_goes_sparse_beside_a_full_control():
    runs = sweep.RECIPES["dsa-continue-1k"].runs
    assert runs[:3] == ("warmup_60k.seed0", "dsa_60k.seed0", "full_60k.seed0")  # a parent before its child
    assert len(runs) == 3 * 3 * 3
    for run in runs:
        stage, size = run.split(".")[0].split("_")
        parent_recipe, parent = dsa_continue.continue_parent(run)
        want = ("dsa-continue-1k", f"warmup_{size}") if stage == "dsa" else ("moba-ladder-1k", f"full_{size}")
        assert (parent_recipe, parent.split(".")[0]) == want and parent.endswith(run[-6:])
        if parent_recipe == "moba-ladder-1k":
            assert parent in sweep.RECIPES["moba-ladder-1k"].runs and ladder.LADDER_TUNED[size] in parent


@pytest.mark.parametrize("size", dsa_continue.CONTINUE_SIZES)
def test_configs_keep_the_base_model_and_set_each_stage(size):
    """The continuations keep the base's model and data; the warm-up is an eighth of the base's
    steps, the sparse stage and its control a quarter each, on one schedule."""
    base = load_config(str(LADDER / f"full_{size}.yaml"), [])
    cfg = {stage: load_config(str(CONTINUE / f"{stage}_{size}.yaml"), []) for stage in dsa_continue.STAGES}
    for c in cfg.values():
        assert (c.model, c.data) == (base.model, base.data)
        assert c.checkpoint.every_steps == c.train.steps and c.eval.every_steps == c.train.steps
    assert (cfg["warmup"].attention.core, cfg["warmup"].dsa.stage) == ("dsa", "warmup")
    assert (cfg["dsa"].attention.core, cfg["dsa"].dsa.stage) == ("dsa", "sparse")
    assert cfg["full"].attention.core == "dense"
    assert cfg["warmup"].train.steps == base.train.steps // 8
    assert cfg["dsa"].train == cfg["full"].train and cfg["dsa"].train.steps == base.train.steps // 4


@pytest.mark.slow
def test_a_tiny_recipe_chains_each_run_from_its_parent(tmp_path, corpus_dir):
    tiny = [o for o in tiny_overrides(corpus_dir, tmp_path / "unused") if not o.startswith("train.run_dir=")]
    overrides = tiny + [
        "data.tokenizer=gpt-neox-olmo",
        "model.vocab_size=50304",
        "dsa.index_topk=8",
        "train.steps=2",
        "checkpoint.every_steps=2",
    ]
    root, results = tmp_path / "runs", tmp_path / "results"
    kw = dict(root=root, results=results, overrides=overrides)
    summaries = sweep.run_recipe(
        "dsa-continue-1k", only=["warmup_60k.seed0", "dsa_60k.seed0", "full_60k.seed0"], **kw
    )
    base = root / "moba-ladder-1k" / f"full_60k.lr{ladder.LADDER_TUNED['60k']}.seed0"  # trained first
    assert checkpoint.kept_steps(base) == [2]
    parents = {"warmup": base, "dsa": root / "dsa-continue-1k" / "warmup_60k.seed0", "full": base}
    for s in summaries:
        stage = s["run"].split("_")[0]
        cfg = checkpoint.load_run_config(root / "dsa-continue-1k" / s["run"], 2)
        assert cfg.train.init_from == str(parents[stage]) and s["step"] == 2
        assert ("indexer_kl" in s) == (stage != "full")
    report = (results / "dsa-continue-1k" / "report.md").read_text()
    assert "| 60k | 1 |" in report  # one seed: no gap yet, the seed means only
    assert json.loads((results / "dsa-continue-1k" / "dsa_60k.seed0.json").read_text()) == summaries[1]


def test_report_pairs_dsa_with_full_by_seed_beside_the_base_and_the_kl(tmp_path):
    """Three seeds: the dsa - full gap with its interval, the bases' mean (moba-ladder-1k's runs
    at the tuned rate) and each DSA stage's KL, first and last."""
    lr = ladder.LADDER_TUNED["60k"]

    def summary(run, seed, loss, kl=None):
        s = {"run": f"{run}.seed{seed}", "seed": seed, "lr": 1e-3, "every_token": {"loss": loss}}
        s |= {"trailing": {"loss": loss + 0.1}, "buckets": [{"start": 0, "loss": loss}]}
        return s | ({"indexer_kl": {"first": [10, kl], "last": [70, kl / 2]}} if kl else {})

    summaries = [summary("warmup_60k", k, 5.0, kl=0.4) for k in range(3)]
    summaries += [summary("dsa_60k", k, 4.9 + 0.01 * k, kl=0.2) for k in range(3)]
    summaries += [summary("full_60k", k, 4.8, kl=None) for k in range(3)]
    (tmp_path / "moba-ladder-1k").mkdir()
    for k in range(3):
        (tmp_path / "moba-ladder-1k" / f"full_60k.lr{lr}.seed{k}.json").write_text(
            json.dumps(summary(f"full_60k.lr{lr}", k, 5.0))
        )
    (tmp_path / "dsa-continue-1k").mkdir()
    dsa_continue.draw_dsa_continue(summaries, tmp_path / "dsa-continue-1k")
    report = (tmp_path / "dsa-continue-1k" / "report.md").read_text()
    assert (
        "| 60k, every token, dsa - full | 3 | 4.9100 ± 0.0058 | 4.8000 ± 0.0000 | +0.1100 ± 0.0058 |"
        in report
    )
    assert "| 60k | 3 | 5.0000 | 4.8000 | 4.9100 | 0.4000 → 0.2000 | 0.2000 → 0.1000 |" in report
