"""eval.scaling_fits and the MoBA scaling figure on synthetic runs (no training): the fits both
ways recover a known law within their bootstrap interval, resampling leaves one-seed sizes alone,
the envelope names the runs it uses, a law is drawn only over the compute it was fitted on, and
fits.json holds both compute axes and the seed gaps' t intervals."""

import json

import numpy as np
import pytest

from eval import scaling_figure
from eval.scaling_fits import _Kind, fit_scaling, law_line, lower_envelope
from eval.stats import t_interval

A, B = 2.6, -0.063


def _run(name, kind, size, seed, finals, losses, tokens=None):
    """A run's curve: checkpoints at compute `finals` (increasing), losses as given."""
    return {
        "run": name,
        "kind": kind,
        "size": size,
        "seed": seed,
        "points": [
            {"full": c, "6nd": c / 5, "overall": y, "trailing": y * 1.01, "tokens": tokens or size * 20}
            for c, y in zip(finals, losses, strict=True)
        ],
    }


def _seeded_law(rng, sizes=(1e3, 3e3, 1e4, 3e4, 1e5), seeds=5, noise=0.01, kind="k"):
    """Each size's seeds: a curve of 4 checkpoints on L = A C^B times one per-run noise factor."""
    runs = []
    for size in sizes:
        final = size * 1e-12
        for seed in range(seeds):
            cs = final * np.array([0.25, 0.5, 0.75, 1.0])
            runs.append(
                _run(f"{kind}{size:g}.s{seed}", kind, size, seed, cs, A * cs**B * rng.lognormal(0, noise))
            )
    return runs


def test_seed_means_recover_a_known_law_within_the_bootstrap_interval():
    fits = fit_scaling(_seeded_law(np.random.default_rng(1)), ("overall",), ("full", "6nd"), resamples=500)
    for compute in ("full", "6nd"):
        fit = fits["overall"][compute]["seed_means"]["k"]
        lo, hi = fit["b_ci95"]
        assert lo < B < hi and lo < fit["b"] < hi and hi - lo < 0.02, (compute, fit)
        assert fit["points"] == fit["configurations"] == 5 and len(fit["runs"]) == 25
        assert fit["resamples"] == 500 and fit["residual_se"] > 0


def test_envelope_recovers_a_noiseless_law_and_its_interval_holds_it():
    fit = fit_scaling(_seeded_law(np.random.default_rng(0), noise=0.0), ("overall",), ("full",))
    env = fit["overall"]["full"]["envelope"]["k"]
    assert env["b"] == pytest.approx(B, abs=1e-9) and env["a"] == pytest.approx(A, rel=1e-6)
    assert env["b_ci95"] == pytest.approx([B, B], abs=1e-9)  # identical seeds: nothing varies


def test_the_bootstrap_is_seeded():
    runs = _seeded_law(np.random.default_rng(2))
    first = fit_scaling(runs, ("overall",), ("full",), resamples=200)
    assert fit_scaling(runs, ("overall",), ("full",), resamples=200) == first
    assert fit_scaling(runs, ("overall",), ("full",), resamples=200, rng_seed=1) != first


def test_resampling_draws_within_a_size_and_leaves_one_seed_sizes_as_they_are():
    runs = [
        _run("small", "k", 10, 0, [1.0], [5.0]),
        _run("mid.s0", "k", 20, 0, [2.0], [4.0]),
        _run("mid.s1", "k", 20, 1, [2.0], [4.2]),
        _run("mid.s2", "k", 20, 2, [2.0], [4.4]),
        _run("big", "k", 40, 0, [8.0], [3.0]),  # not symmetric: the middle size moves b
    ]
    kind = _Kind(runs, ("full",), ("overall",))
    assert kind.configs == [[0], [1, 2, 3], [4]]
    rng = np.random.default_rng(0)
    draws = [kind.resample(rng) for _ in range(200)]
    assert all(d[0] == [0] and d[2] == [4] and len(d[1]) == 3 and set(d[1]) <= {1, 2, 3} for d in draws)
    assert len({tuple(d[1]) for d in draws}) > 10  # the three-seed size does vary
    fit = fit_scaling(runs, ("overall",), ("full",), resamples=200)["overall"]["full"]["seed_means"]["k"]
    lo, hi = fit["b_ci95"]
    assert lo < fit["b"] < hi
    # no size with two seeds: no interval, rather than a zero-width one
    single = fit_scaling([runs[0], runs[1], runs[4]], ("overall",), ("full",))["overall"]["full"]
    assert single["seed_means"]["k"]["b_ci95"] is None and single["seed_means"]["k"]["resamples"] == 0


def test_the_envelope_names_the_runs_that_supply_its_points():
    cs = [1.0, 2.0, 3.0, 4.0]
    runs = [
        _run("a", "k", 10, 0, cs, [5.0, 4.0, 3.5, 3.2]),
        _run("b", "k", 10, 1, cs, [5.1, 3.9, 3.4, 3.3]),  # beats a at 2 and 3, not at 1 and 4
        _run("c", "k", 10, 2, cs, [6.0, 5.0, 4.0, 3.6]),  # never on it
        _run("d", "k", 20, 0, [8.0, 16.0], [3.1, 2.9]),
    ]
    fit = fit_scaling(runs, ("overall",), ("full",), resamples=300)["overall"]["full"]["envelope"]["k"]
    assert fit["runs"] == {"a": 2, "b": 2, "d": 2} and fit["points"] == 6
    assert fit["compute_range"] == [1.0, 16.0]
    lo, hi = fit["b_ci95"]
    assert lo - 1e-12 <= fit["b"] <= hi + 1e-12 and lo < hi and fit["resamples"] == 300


def test_lower_envelope_keeps_only_points_nothing_cheaper_beats():
    points = [(1.0, 5.0), (2.0, 4.0), (2.5, 4.5), (3.0, 3.9), (4.0, 4.2), (5.0, 3.0), (5.0, 2.9)]
    assert lower_envelope(points) == [(1.0, 5.0), (2.0, 4.0), (3.0, 3.9), (5.0, 2.9)]
    assert lower_envelope([]) == []


def _summaries(rng):
    """moba-scaling-like summaries: 3 sizes x {dense, moba}, seeds 0-2 at the middle size."""
    out = []
    for size, seeds in ((10_000, (0,)), (50_000, (0, 1, 2)), (200_000, (0,))):
        for core in ("dense", "moba"):
            for seed in seeds:
                full = size * 1e-12 * np.array([0.25, 0.5, 0.75, 1.0])
                loss = A * full**B * rng.lognormal(0, 0.02)
                points = [
                    {
                        "tokens": int(f * 1e15),
                        "pflops_days": f,
                        "pflops_days_6nd": f / 5,
                        "loss": y,
                        "trailing_loss": y + 0.01,
                    }
                    for f, y in zip(full, loss, strict=True)
                ]
                out.append(
                    {
                        "run": f"{'full' if core == 'dense' else core}_{size}"
                        + (f".seed{seed}" if seed else ""),
                        "core": core,
                        "seed": seed,
                        "non_embedding_params": size,
                        "tokens_per_param": 20.0,
                        "context": 1024,
                        "block_size": 64,
                        "top_k": 3,
                        "trailing": {"start": 768, "end": 1024, "documents": 12},
                        "points": points,
                    }
                )
    return out


def test_the_law_is_drawn_over_exactly_the_compute_it_was_fitted_on():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summaries = _summaries(np.random.default_rng(3))
    fits = fit_scaling(
        scaling_figure.fit_runs(summaries), ("overall", "trailing"), ("full", "6nd"), resamples=50
    )
    fig, ax = plt.subplots()
    scaling_figure._draw_panel(ax, summaries, fits, "6nd", "overall")
    for core, kind in scaling_figure.KIND_NAMES.items():
        runs = [s for s in summaries if s["core"] == core]
        envelope = lower_envelope([(p["pflops_days_6nd"], p["loss"]) for s in runs for p in s["points"]])
        finals = [s["points"][-1]["pflops_days_6nd"] for s in runs]
        for method, data in (("envelope", [c for c, _ in envelope]), ("seed_means", finals)):
            fit = fits["overall"]["6nd"][method][kind]
            assert fit["compute_range"] == pytest.approx([min(data), max(data)])
            (line,) = [
                ln
                for ln in ax.get_lines()
                if ln.get_label().startswith(f"{kind}, {method.replace('_', ' ')}")
            ]
            xs = line.get_xdata()
            assert (xs[0], xs[-1]) == pytest.approx((min(data), max(data)))
            assert np.allclose(law_line(fit)[0], xs)
    plt.close(fig)


def test_fits_json_has_both_axes_both_methods_and_gap_intervals(tmp_path, capsys):
    summaries = _summaries(np.random.default_rng(4))
    scaling_figure.draw_moba_scaling(summaries, tmp_path)
    record = json.loads((tmp_path / "fits.json").read_text())
    assert (tmp_path / "scaling.png").stat().st_size > 0
    assert record["bootstrap"]["resamples"] == 2000
    for loss in ("overall", "trailing"):
        assert set(record["fits"][loss]) == {"full", "6nd"}
        for compute in ("full", "6nd"):
            for method in ("envelope", "seed_means"):
                for kind in ("full attention", "MoBA"):
                    fit = record["fits"][loss][compute][method][kind]
                    assert fit["b_ci95"][0] - 1e-12 <= fit["b"] <= fit["b_ci95"][1] + 1e-12
                    assert fit["residual_se"] > 0 and fit["runs"]
        (gap,) = record["seed_gaps"][loss]
        key = "loss" if loss == "overall" else "trailing_loss"
        final = {
            (s["core"], s["seed"]): s["points"][-1][key]
            for s in summaries
            if s["non_embedding_params"] == 50_000
        }
        diffs = [final["moba", k] - final["dense", k] for k in (0, 1, 2)]
        assert gap["seeds"] == [0, 1, 2] and gap["gap_ci95"] == pytest.approx(list(t_interval(diffs)))
    out = capsys.readouterr().out.splitlines()
    assert sum("b 95 % bootstrap" in line for line in out) == 2 * 2 * 2 * 2  # loss x axis x method x kind
    assert sum("95 % t interval" in line for line in out) == 2
