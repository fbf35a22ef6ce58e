"""eval.ladder: the moba-ladder-1k recipe's runs and configs, its tuning choice, the ordering check
that stops a fit, and the fits' intervals on synthetic summaries with known laws."""

import json
import math

import pytest

from eval import ladder, sweep

SIZES = {"13k": 13_408, "30k": 30_096, "60k": 60_144, "107k": 106_816, "250k": 250_160}


def _summary(core, size, lr, seed, loss, compute=None):
    n = SIZES[size]
    compute = compute if compute is not None else n * 1e-9
    return {
        "run": f"{'full' if core == 'dense' else 'moba'}_{size}.lr{lr}.seed{seed}",
        "core": core,
        "lr": float(lr),
        "seed": seed,
        "non_embedding_params": n,
        "pflops_days": compute,
        "pflops_days_6nd": compute / 2,
        "every_token": {"loss": loss},
        "trailing": {"loss": loss + 0.1, "start": 768, "end": 1023, "documents": 12},
        "context": 1024,
        "block_size": 64,
        "top_k": 3,
        "tokens_per_param": 20.0,
        "points": [
            {
                "tokens": 20 * n,
                "pflops_days": compute,
                "pflops_days_6nd": compute / 2,
                "loss": loss,
                "trailing_loss": loss + 0.1,
            }
        ],
    }


def test_runs_name_existing_configs_and_the_tuned_stage_adds_seeds():
    runs = ladder.ladder_runs({})
    assert len(runs) == len(ladder.LADDER_SIZES) * len(ladder.LADDER_LRS) * len(ladder.TUNING_SEEDS)
    more = ladder.ladder_runs({"13k": "1e-2"})
    assert more[len(runs) :] == (
        "full_13k.lr1e-2.seed2",
        "moba_13k.lr1e-2.seed0",
        "moba_13k.lr1e-2.seed1",
        "moba_13k.lr1e-2.seed2",
    )
    recipe = sweep.RECIPES["moba-ladder-1k"]
    for run in more:
        stem, overrides = sweep._config_and_seed(run)
        assert (sweep.REPO / recipe.config_dir / f"{stem}.yaml").exists()
        assert overrides[0].startswith("train.lr=")


def test_the_4k_arm_is_the_three_smallest_sizes_at_4k_rows():
    """The same models and about the same tokens as the 1K ladder's, rows of 4,096 in blocks of 256."""
    from effattn_jax.config import load_config

    tuned = ladder.LADDER_4K_TUNED
    assert sweep.RECIPES["moba-ladder-4k"].runs == ladder.ladder_runs(tuned, ladder.LADDER_4K_SIZES)
    tokens = lambda c: c.train.steps * c.data.batch_size * c.data.seq_len
    for size in ladder.LADDER_4K_SIZES:
        for core in ("full", "moba"):
            long = load_config(sweep.REPO / f"configs/moba/cpu/ladder_4k/{core}_{size}.yaml")
            short = load_config(sweep.REPO / f"configs/moba/cpu/ladder/{core}_{size}.yaml")
            assert long.model == short.model and long.attention == short.attention
            assert (long.data.seq_len, long.data.batch_size, long.moba.block_size) == (4096, 1, 256)
            assert 1.0 <= tokens(long) / tokens(short) < 1.04 and long.train.steps % 8 == 0
            if size in tuned:  # the configs name the rate the 4K tuning chose
                assert long.train.lr == float(tuned[size])


def test_configs_grow_width_and_depth_at_about_20_tokens_per_parameter():
    from effattn_jax.config import load_config
    from eval.runs import model_param_counts

    shapes = []
    for size, n in SIZES.items():
        full = load_config(sweep.REPO / f"configs/moba/cpu/ladder/full_{size}.yaml")
        moba = load_config(sweep.REPO / f"configs/moba/cpu/ladder/moba_{size}.yaml")
        assert (full.attention.core, moba.attention.core) == ("dense", "moba")
        assert full.model == moba.model and full.train == moba.train and full.data == moba.data
        assert model_param_counts(full)["non_embedding"] == n
        tokens = full.train.steps * full.data.batch_size * full.data.seq_len
        assert tokens >= 500_000 and tokens / n >= 19.9
        assert tokens / n <= 20.2 or tokens < 520_000  # about 20 each, or the floor
        assert tokens <= 2 * 2_690_000  # at most two passes over the training speeches
        assert full.train.warmup_steps == full.train.steps // 4 and full.train.steps % 8 == 0
        if size in ladder.LADDER_TUNED:  # a user's run of the config trains on the tuned schedule
            assert full.train.lr == float(ladder.LADDER_TUNED[size])
        shapes.append((full.model.d_model, full.model.num_layers))
    assert shapes == sorted(shapes) and shapes[0] < shapes[-1]
    assert all(a[0] < b[0] or a[1] < b[1] for a, b in zip(shapes, shapes[1:], strict=False))


def test_tuning_picks_the_lowest_mean_over_both_seeds_and_flags_the_edge(tmp_path):
    losses = {"3e-3": (5.0, 5.2), "1e-2": (4.9, 5.1), "3e-2": (5.5, 5.6)}
    runs = [_summary("dense", "13k", lr, k, v[k]) for lr, v in losses.items() for k in (0, 1)]
    table = ladder.tuning_table(runs)["13k"]
    assert [r["chosen"] for r in table] == [False, True, False]
    assert table[1]["mean"] == pytest.approx(5.0)
    edge = [_summary("dense", "30k", lr, k, 4 + i) for i, lr in enumerate(ladder.LADDER_LRS) for k in (0, 1)]
    assert "(at the grid's edge)" in "\n".join(ladder.tuning_lines(ladder.tuning_table(edge)))
    # a size with a missing seed chooses nothing
    assert not any(r["chosen"] for r in ladder.tuning_table(runs[:-1])["13k"])


def _ladder(loss_at, tuned_lr="1e-2"):
    """Both kinds at every size, seeds 0-2, and a worse tuning lr (which the ladder leaves out)."""
    runs = []
    for size in SIZES:
        for k in ladder.LADDER_SEEDS:
            for core in ("dense", "moba"):
                runs.append(_summary(core, size, tuned_lr, k, loss_at(core, SIZES[size], k)))
        runs += [_summary("dense", size, "3e-3", k, 9.0) for k in ladder.TUNING_SEEDS]
        runs += [_summary("dense", size, "3e-2", k, 9.5) for k in ladder.TUNING_SEEDS]
    return runs


def test_a_ladder_that_does_not_order_is_not_fitted(tmp_path):
    def loss(core, n, k):
        return 5.0 - 0.1 * math.log(n) + (0.5 if n == SIZES["60k"] else 0.0)  # 60k above 30k

    record = ladder.draw_ladder(_ladder(loss), tmp_path, tuned=dict.fromkeys(SIZES, "1e-2"))
    assert record["order_problems"] and "fits" not in record
    assert len(record["order_problems"]) == 2  # both kinds, at the 30k -> 60k step
    assert "do not order" in (tmp_path / "ladder.md").read_text()
    assert not (tmp_path / "scaling.png").exists()


def test_fits_recover_known_laws_and_pair_the_slopes_by_seed(tmp_path):
    noise = {0: 0.0, 1: 0.01, 2: -0.01}

    def loss(core, n, k):  # L = 2 * C^-0.05 with C = n * 1e-9; MoBA 1 % above, same slope
        return (
            2
            * (n * 1e-9) ** -0.05
            * (1.01 if core == "moba" else 1.0)
            * math.exp(noise[k] * (n % 7 - 3) / 10)
        )

    tuned = dict.fromkeys(SIZES, "1e-2")
    record = ladder.draw_ladder(_ladder(loss), tmp_path, tuned=tuned)
    assert record["order_problems"] == [] and record["mismatch"] == []
    overall = record["fits"]["overall"]["full"]
    for kind in ("full", "moba"):
        fit = overall[kind]
        assert fit["b"] == pytest.approx(-0.05, abs=2e-3) and fit["sizes"] == sorted(SIZES.values())
        lo, hi = fit["b_t95"]
        assert lo < fit["b"] < hi and hi - lo < 0.02
        lo, hi = fit["b_leave_one_size_out"]
        assert lo <= fit["b"] <= hi
    gap = overall["slope_gap"]
    assert gap["seeds"] == [0, 1, 2] and gap["mean"] == pytest.approx(0.0, abs=1e-9)
    rows = record["gaps"]["overall"]
    assert len(rows) == 5 and all(r["gap_moba_minus_full"][0] > 0 for r in rows)
    saved = json.loads((tmp_path / "ladder.json").read_text())
    assert saved["sizes"] == sorted(SIZES.values())
    assert (tmp_path / "scaling.png").exists() and "b_MoBA − b_full" in (tmp_path / "ladder.md").read_text()


def test_a_tuned_lr_the_data_does_not_choose_is_reported(tmp_path):
    runs = _ladder(lambda core, n, k: 5 - 0.1 * math.log(n))
    record = ladder.draw_ladder(runs, tmp_path, tuned={"13k": "3e-3"})
    assert record["mismatch"] == ["13k: the committed choice is 3e-3, the tuning runs choose 0.01"]


def test_the_committed_choices_are_the_committed_tuning_runs_lowest_means():
    """LADDER_TUNED against results/moba-ladder-1k: each tuned size's lr is the lowest mean there."""
    summaries = [
        json.loads(p.read_text()) for p in (sweep.REPO / "results/moba-ladder-1k").glob("full_*.json")
    ]
    chosen = {
        size: next(r["lr"] for r in rows if r["chosen"])
        for size, rows in ladder.tuning_table(summaries).items()
        if any(r["chosen"] for r in rows)
    }
    assert {size: float(lr) for size, lr in ladder.LADDER_TUNED.items()} == {
        size: chosen[size] for size in ladder.LADDER_TUNED
    }
