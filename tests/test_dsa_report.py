"""eval.dsa_report: the dsa-1k and dsa-ladder-1k recipes' runs and their seed-paired gaps against
moba-scaling-1k's and moba-ladder-1k's runs."""

import json

import pytest

from effattn_jax.config import load_config
from eval import dsa_report, ladder, sweep


def _summary(core, size, seed, loss, trailing, lr=None):
    run = (
        f"{core}_{size}" + (f".seed{seed}" if seed else "")
        if lr is None
        else f"{core}_{size}.lr{lr}.seed{seed}"
    )
    summary = {"run": run, "seed": seed, "every_token": {"loss": loss}, "trailing": {"loss": trailing}}
    return summary | {
        "lr": float(lr or 1e-3),
        "buckets": [{"start": 0, "loss": loss}, {"start": 512, "loss": trailing}],
    }


def test_recipe_runs_both_sizes_at_three_seeds_of_existing_configs():
    runs = sweep.RECIPES["dsa-1k"].runs
    assert sorted(runs) == sorted(
        f"dsa_{s}" + (f".seed{k}" if k else "") for s in ("53k", "107k") for k in (0, 1, 2)
    )
    assert runs[:2] == ("dsa_53k", "dsa_107k")  # seed 0 of both first
    for run in runs:
        assert (sweep.REPO / "configs/moba/cpu/scaling" / f"{run.split('.')[0]}.yaml").exists()


def test_gaps_pair_dsa_with_full_and_moba_by_seed():
    """Seeds 0-2 only (moba-scaling-1k's seeds 3-4 are left out); a size without two shared seeds
    has no gap."""
    dsa = [_summary("dsa", "53k", k, 5.0 + 0.1 * k, 5.2) for k in (0, 1, 2)]
    scaling = [_summary("full", "53k", k, 5.1 + 0.1 * k + 0.01 * k, 5.3) for k in (0, 1, 2, 3)]
    scaling += [_summary("moba", "53k", k, 5.0, 5.2) for k in (0, 1, 2)] + [
        _summary("full", "107k", 0, 4.0, 4.0)
    ]
    gaps = dsa_report.comparison(dsa, scaling)
    assert list(gaps) == ["53k"]
    full = gaps["53k"]["every token"]["dsa - full"]
    assert full["seeds"] == [0, 1, 2] and full["gap"][0] == pytest.approx(-0.11)
    assert gaps["53k"]["trailing"]["dsa - full"]["gap"][0] == pytest.approx(-0.1)
    assert gaps["53k"]["every token"]["dsa - moba"]["gap"][0] == pytest.approx(0.1)


def test_ladder_recipe_runs_every_tuned_size_at_its_rate_on_the_ladder_config_with_dsa():
    runs = sweep.RECIPES["dsa-ladder-1k"].runs
    tuned = ladder.LADDER_TUNED
    assert sorted(runs) == sorted(f"dsa_{s}.lr{lr}.seed{k}" for s, lr in tuned.items() for k in (0, 1, 2))
    for run in runs:
        stem = run.split(".")[0]
        cfg = load_config(str(sweep.REPO / "configs/dsa/cpu/ladder" / f"{stem}.yaml"), [])
        full = load_config(str(sweep.REPO / "configs/moba/cpu/ladder" / f"full_{stem[4:]}.yaml"), [])
        assert cfg.attention.core == "dsa" and cfg.dsa.index_topk == 192
        assert (cfg.model, cfg.train.steps, cfg.data) == (full.model, full.train.steps, full.data)


def test_ladder_gaps_pair_with_the_ladders_runs_at_the_tuned_rate(tmp_path):
    """The ladder's tuning runs at other rates are left out; the report and figure are written."""
    lr = ladder.LADDER_TUNED["13k"]
    dsa = [_summary("dsa", "13k", k, 5.0, 5.1, lr) for k in (0, 1, 2)]
    others = [_summary("full", "13k", k, 5.2, 5.4, lr) for k in (0, 1, 2)]
    others += [_summary("full", "13k", k, 9.0, 9.0, "3e-2") for k in (0, 1)]  # a tuning run
    others += [_summary("moba", "13k", k, 5.1, 5.1, lr) for k in (0, 1, 2)]
    gaps = dsa_report.comparison(dsa, others, dsa_report.DSA_LADDER)
    assert gaps["13k"]["every token"]["dsa - full"]["gap"][0] == pytest.approx(-0.2)
    assert gaps["13k"]["trailing"]["dsa - moba"]["gap"][0] == pytest.approx(0.0)
    (tmp_path / "moba-ladder-1k").mkdir()
    for s in others:
        (tmp_path / "moba-ladder-1k" / f"{s['run']}.json").write_text(json.dumps(s))
    (tmp_path / "dsa-ladder-1k").mkdir()
    dsa_report.draw_dsa_ladder(dsa, tmp_path / "dsa-ladder-1k")
    report = (tmp_path / "dsa-ladder-1k" / "report.md").read_text()
    assert "| 13k, every token, dsa - full | 3 |" in report
    assert "Across sizes" not in report  # one size: no law
    assert (tmp_path / "dsa-ladder-1k" / "loss_by_position.png").stat().st_size > 0


def _sized(core, size, seed, b, lr="1e-2", offset=0.0):
    """A summary at `size` whose loss (both measures) is 2·C^b on its every-matmul compute."""
    compute = {"13k": 1e-9, "30k": 3e-9, "60k": 1e-8}[size]
    loss = 2.0 * compute**b + offset + 0.01 * seed
    summary = _summary(core, size, seed, loss, loss, lr)
    params = {"13k": 13_408, "30k": 30_096, "60k": 60_144}[size] + (1_000 if core == "dsa" else 0)
    core_name = {"full": "dense"}.get(core, core)  # a summary's `core`, as train.py names it
    return summary | {
        "core": core_name,
        "non_embedding_params": params,
        "pflops_days": compute,
        "pflops_days_6nd": compute / 10,
    }


def test_across_sizes_fits_dsa_and_pairs_its_slope_with_full_and_moba_by_seed(tmp_path):
    """DSA's sizes carry the indexers' parameters (not full attention's), so sizes pair by name;
    the ladder's report ends with them."""
    sizes = ("13k", "30k", "60k")
    dsa = [_sized("dsa", n, k, -0.10) for n in sizes for k in (0, 1, 2)]
    others = [_sized("full", n, k, -0.08) for n in sizes for k in (0, 1, 2)]
    others += [_sized("moba", n, k, -0.10, offset=0.05) for n in sizes for k in (0, 1, 2)]
    others += [_sized("full", n, k, 0.5, lr="3e-2") for n in sizes for k in (0, 1)]  # tuning runs
    record = dsa_report.across_sizes(dsa, others, dsa_report.DSA_LADDER)
    assert record["sizes"] == list(sizes) and record["order_problems"] == []
    fit = record["fits"]["overall"]["full"]
    assert fit["dsa"]["b"] == pytest.approx(-0.10, abs=2e-3)
    assert fit["dsa - full"]["seeds"] == [0, 1, 2]
    assert fit["dsa - full"]["mean"] == pytest.approx(-0.02, abs=2e-3)
    assert fit["dsa - moba"]["mean"] == pytest.approx(0.0, abs=2e-3)
    lines = dsa_report.across_sizes_lines(record)
    assert lines[0] == "- DSA's seed-mean loss (every token) falls at every step of 3 sizes"
    assert any(line.startswith("- trailing, 6nd, b_dsa − b_moba: ") for line in lines)
    (tmp_path / "moba-ladder-1k").mkdir()
    for s in others:
        (tmp_path / "moba-ladder-1k" / f"{s['run']}.json").write_text(json.dumps(s))
    (tmp_path / "dsa-ladder-1k").mkdir()
    dsa_report.draw_dsa_ladder(dsa, tmp_path / "dsa-ladder-1k")
    assert (tmp_path / "dsa-ladder-1k" / "report.md").read_text().endswith("\n".join(lines) + "\n")
    assert json.loads((tmp_path / "dsa-ladder-1k" / "across_sizes.json").read_text())["sizes"] == list(sizes)


def test_across_sizes_names_a_size_that_does_not_order_and_needs_three_sizes():
    sizes = ("13k", "30k", "60k")
    dsa = [_sized("dsa", n, k, -0.1, offset=20.0 * (n == "60k")) for n in sizes for k in (0, 1)]
    record = dsa_report.across_sizes(dsa, [], dsa_report.DSA_LADDER)
    assert len(record["order_problems"]) == 1 and record["order_problems"][0].startswith(
        "dsa: 61,144 params ends at "
    )
    assert record["fits"]["overall"]["full"]["dsa - full"] is None  # no full attention runs
    assert dsa_report.across_sizes_lines(record)[0].startswith("- dsa: 61,144 params ends at ")
    assert dsa_report.across_sizes(dsa[:4], [], dsa_report.DSA_LADDER) is None
