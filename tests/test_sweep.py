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
    ]
    kw = dict(root=tmp_path / "runs", results=tmp_path / "results", only=["full_s1", "moba_s1"])
    summaries = sweep.run_recipe("moba-scaling-cpu", overrides=overrides, **kw)
    assert [s["run"] for s in summaries] == ["full_s1", "moba_s1"]
    assert [s["label"] for s in summaries] == ["mha dense", "mha moba"]
    for s in summaries:
        assert s["step"] == 2 and s["tokens"] == 2 * 4 * 32 and s["overrides"] == overrides
        assert s["loss"] > 0 and s["trailing"]["loss"] > 0 and s["pflops_days"] > 0
    out = tmp_path / "results" / "moba-scaling-cpu"
    assert json.loads((out / "full_s1.json").read_text()) == summaries[0]
    assert (out / "scaling.png").stat().st_size > 0
    # a fresh clone: the summaries without their run directories; nothing trains, the figure is redrawn
    shutil.rmtree(tmp_path / "runs")
    (out / "scaling.png").unlink()
    monkeypatch.setattr(sweep, "train_run", lambda *a: pytest.fail("trained a finished run"))
    assert sweep.run_recipe("moba-scaling-cpu", overrides=overrides, **kw) == summaries
    assert (out / "scaling.png").stat().st_size > 0
    with pytest.raises(SystemExit, match="full_s9"):
        sweep.run_recipe("moba-scaling-cpu", **kw | {"only": ["full_s9"]})


def test_small_bpe_is_deterministic():
    texts = ["The State of the Union is strong.", "We the people of the United States."] * 20
    first, second = train_small_bpe(300, iter(texts)), train_small_bpe(300, iter(texts))
    assert first == second
    vocab = json.loads(first)["model"]["vocab"]
    assert vocab["<|endoftext|>"] == 0 and len(vocab) <= 300
