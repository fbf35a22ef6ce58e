"""eval.dsa_report: the dsa-1k recipe's runs and its seed-paired gaps against moba-scaling-1k's."""

import pytest

from eval import dsa_report, sweep


def _summary(core, size, seed, loss, trailing):
    run = f"{core}_{size}" + (f".seed{seed}" if seed else "")
    return {"run": run, "seed": seed, "every_token": {"loss": loss}, "trailing": {"loss": trailing}}


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
