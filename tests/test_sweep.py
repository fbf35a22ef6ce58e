"""eval.sweep: a recipe trains its runs, leaves one summary per run, skips finished runs
(also when their run directories are gone, as on a fresh clone) and redraws from summaries;
the small BPE vocabulary is deterministic."""

import json
import shutil

import pytest
from conftest import tiny_overrides

from effattn_jax.data.small_bpe import train_small_bpe
from eval import sweep

pytestmark = pytest.mark.slow  # trains a recipe


def test_recipe_trains_summarizes_then_only_redraws(tmp_path, corpus_dir, monkeypatch):
    tiny = [o for o in tiny_overrides(corpus_dir, tmp_path / "unused") if not o.startswith("train.run_dir=")]
    overrides = tiny + [
        "data.tokenizer=gpt-neox-olmo",  # the recipe's own vocabulary is trained on the built-in corpus
        "model.vocab_size=50304",
        "moba.block_size=8",
        "train.steps=2",
        "checkpoint.every_steps=1",
        "checkpoint.keep_every=1",  # a point per step: each run's curve
    ]
    runs = ["full_53k", "moba_53k", "full_53k.seed1", "moba_53k.seed1"]  # a size with two seeds
    kw = dict(root=tmp_path / "runs", results=tmp_path / "results", only=runs)
    summaries = sweep.run_recipe("moba-scaling-1k", overrides=overrides, **kw)
    assert [s["run"] for s in summaries] == runs
    assert [(s["label"], s["seed"]) for s in summaries] == [
        ("mha dense", 0),
        ("mha moba", 0),
        ("mha dense", 1),
        ("mha moba", 1),
    ]
    for s in summaries:
        assert s["step"] == 2 and s["tokens"] == 2 * 4 * 32 and s["overrides"] == overrides
        assert [p["step"] for p in s["points"]] == [1, 2]  # every kept checkpoint
        assert s["points"][0]["pflops_days"] < s["points"][1]["pflops_days"] == s["pflops_days"]
        assert s["pflops_days_6nd"] < s["pflops_days"]  # the head and attention counted
        assert s["loss"] > 0 and s["trailing"]["loss"] > 0
        assert s["every_token"]["tokens"] > s["trailing"]["tokens"]
        assert s["tokens_per_param"] == pytest.approx(s["tokens"] / s["non_embedding_params"])
    assert summaries[0]["points"][-1]["loss"] != summaries[2]["points"][-1]["loss"]  # another seed
    out = tmp_path / "results" / "moba-scaling-1k"
    assert json.loads((out / "full_53k.json").read_text()) == summaries[0]
    fits = json.loads((out / "fits.json").read_text())
    (gap,) = fits["seed_gaps"]["overall"]
    assert gap["seeds"] == [0, 1] and gap["gap_moba_minus_full"][1] >= 0
    lo, hi = gap["gap_ci95"]
    assert lo <= gap["gap_moba_minus_full"][0] <= hi
    for compute in ("full", "6nd"):  # one size: no seed-mean law (one compute value)
        fit = fits["fits"]["overall"][compute]
        assert "MoBA" in fit["envelope"] and fit["seed_means"]["MoBA"] is None
    assert (out / "scaling.png").stat().st_size > 0
    # a fresh clone: the summaries without their run directories; nothing trains, the figure is redrawn
    shutil.rmtree(tmp_path / "runs")
    (out / "scaling.png").unlink()
    monkeypatch.setattr(sweep, "train_run", lambda *a: pytest.fail("trained a finished run"))
    assert sweep.run_recipe("moba-scaling-1k", overrides=overrides, **kw) == summaries
    assert (out / "scaling.png").stat().st_size > 0
    with pytest.raises(SystemExit, match="full_s9"):
        sweep.run_recipe("moba-scaling-1k", **kw | {"only": ["full_s9"]})


def test_lower_envelope_keeps_only_points_nothing_cheaper_beats():
    points = [(1.0, 5.0), (2.0, 4.0), (2.5, 4.5), (3.0, 3.9), (4.0, 4.2), (5.0, 3.0)]
    assert sweep.lower_envelope(points) == [(1.0, 5.0), (2.0, 4.0), (3.0, 3.9), (5.0, 3.0)]


def test_small_bpe_is_deterministic():
    texts = ["The State of the Union is strong.", "We the people of the United States."] * 20
    first, second = train_small_bpe(300, iter(texts)), train_small_bpe(300, iter(texts))
    assert first == second
    vocab = json.loads(first)["model"]["vocab"]
    assert vocab["<|endoftext|>"] == 0 and len(vocab) <= 300


def test_run_names_carry_lr_warmup_and_seed_overrides():
    assert sweep._config_and_seed("full_53k") == ("full_53k", [])
    assert sweep._config_and_seed("mla.seed3") == ("mla", ["train.seed=3"])
    assert sweep._config_and_seed("full_53k.lr1e-2.warmup32.seed2") == (
        "full_53k",
        ["train.lr=0.01", "train.warmup_steps=32", "train.seed=2"],
    )
    assert sweep._config_and_seed("full_53k.lr3e-3") == ("full_53k", ["train.lr=0.003"])
    for bad in ("full_53k.foo", "full_53k.seed1.lr1e-2", "full_53k.seedx"):
        with pytest.raises(ValueError, match="expected <config>"):
            sweep._config_and_seed(bad)


def test_lr_sweep_table_gives_each_settings_seeds_mean_and_spread():
    from eval.lr_sweep import settings_table

    runs = [(3e-3, 96, 0, 5.2), (3e-3, 96, 1, 5.0), (1e-2, 8, 0, 5.6), (3e-3, 96, 2, 5.3)]
    rows = settings_table([{"lr": a, "warmup_steps": w, "seed": k, "loss": v} for a, w, k, v in runs])
    assert [(r["lr"], r["warmup_steps"], r["seeds"]) for r in rows] == [(3e-3, 96, [0, 1, 2]), (1e-2, 8, [0])]
    assert rows[0]["losses"] == [5.2, 5.0, 5.3] and rows[0]["mean"] == pytest.approx(5.1666667)
    assert rows[0]["sd"] == pytest.approx(0.1527525) and rows[0]["range"] == pytest.approx(0.3)
    assert rows[1]["sd"] != rows[1]["sd"]  # nan for one seed
