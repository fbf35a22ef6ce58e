"""eval.egmla_report: the egmla-cpu recipe's runs, its seed-paired gaps (to MLA and what the gate
buys over its controls), decode latency in repeats with their provenance (remeasured only when
the configurations change, or when asked), and the four panels drawn from summaries."""

import json

import pytest
from conftest import TINY_MLA

from eval import egmla_report, sweep
from eval.report import markdown, plot


def run(stem, seed, loss, kind="mla"):
    name = stem if seed == 0 else f"{stem}.seed{seed}"
    return {
        "run": name,
        "config": f"configs/egmla/cpu/{stem}.yaml",
        "overrides": [],
        "label": "unused",
        "kind": kind,
        "seed": seed,
        "points": [{"val_loss": loss}],
    }


def test_recipe_runs_every_control_and_five_seeds_of_the_compared_configurations():
    runs = sweep.RECIPES["egmla-cpu"].runs
    assert len(runs) == len(set(runs))
    compared = ("mla", "eg_mla_emb16", "eg_mla_proj_emb128", "mla_table16", "mla_dc16", "mla_table128")
    for stem in (*compared, "mla_dc16_table16"):
        assert [r for r in runs if r.split(".")[0] == stem] == [stem] + [
            f"{stem}.seed{k}" for k in (1, 2, 3, 4)
        ]
    assert runs.index("mla_dc16") < runs.index("mla.seed1")  # every configuration at seed 0 first
    for r in runs:  # every run names a config of the recipe
        assert (sweep.REPO / "configs/egmla/cpu" / f"{r.split('.')[0]}.yaml").exists()


def test_gaps_pair_by_seed_with_t_intervals_and_need_two_shared_seeds():
    summaries = [
        *(run("mla", k, v) for k, v in enumerate([5.0, 5.4, 4.9])),
        *(run("eg_mla_emb16", k, v, "eg_mla") for k, v in enumerate([4.8, 5.1, 4.8])),
        *(run("mla_table16", k, v) for k, v in enumerate([4.9, 5.3, 4.9])),
        run("mla_dc16", 0, 5.2),  # one seed: no gap
        run("mha", 3, 4.0, "mha"),  # no seed shared with MLA
    ]
    gaps = egmla_report.gaps_to_mla(summaries)
    assert list(gaps) == ["eg_mla_emb16", "mla_table16"]
    pair = gaps["eg_mla_emb16"]
    mean, se = pair["gap"]  # differences -0.2, -0.3, -0.1
    assert pair["seeds"] == [0, 1, 2] and mean == pytest.approx(-0.2) and se == pytest.approx(0.1 / 3**0.5)
    low, high = pair["gap_ci95"]
    assert high - low == pytest.approx(2 * 4.302653 * 0.1 / 3**0.5, rel=1e-5)  # t(0.975, 2 d.f.)
    gate = egmla_report.gate_gaps(summaries)
    assert list(gate) == ["eg_mla_emb16 - mla_table16"]  # no pair for mla_dc16 or the 128s
    assert gate["eg_mla_emb16 - mla_table16"]["gap"][0] == pytest.approx(-0.1333333)
    text = egmla_report.gaps_markdown(summaries)
    assert (
        "- eg_mla_emb16 - mla_table16: -0.1333 ± 0.0333 (95 % CI -0.2768 to +0.0101; 3 seeds: 0, 1, 2)"
        in text
    )


TINY_DECODE = [o for o in TINY_MLA if not o.startswith("eg_mla.")] + ["model.dtype=float32"]


def test_decode_is_measured_in_repeats_with_provenance_and_only_when_configs_change(tmp_path, monkeypatch):
    summaries = [
        run("mla", 0, 5.0) | {"overrides": TINY_DECODE},
        run("mla", 1, 5.0) | {"overrides": TINY_DECODE},
        run("mla_table16", 0, 5.0) | {"overrides": TINY_DECODE + ["mla.token_table_dim=8"]},
    ]
    tiny = dict(context=16, rounds=2, repeats=2)
    ms = egmla_report.measure_decode(summaries, tmp_path, **tiny)
    record = json.loads((tmp_path / "decode_latency.json").read_text())
    names = [egmla_report.config_name(s) for s in (summaries[0], summaries[2])]
    assert sorted(ms) == sorted(names) == sorted(record["configs"])  # a configuration's seeds: once
    assert len(record["repeats"]) == 2 and record["context"] == 16 and record["rounds"] == 2
    assert len(record["git_commit"]) == 40 and record["jax"] and record["date"]
    for name in names:
        figures = [r["ms_per_token"][name] for r in record["repeats"]]
        assert ms[name]["repeats"] == figures and ms[name]["min"] <= ms[name]["median"] <= ms[name]["max"]
        assert all(f > 0 for f in figures)

    def remeasured(*a, **k):
        raise AssertionError("remeasured")

    monkeypatch.setattr("eval.decoding.decode_latency_alternated", remeasured)
    more_seeds = summaries + [run("mla", 2, 5.0) | {"overrides": TINY_DECODE}]
    assert egmla_report.measure_decode(more_seeds, tmp_path, **tiny) == ms  # same configurations
    assert egmla_report.measure_decode(summaries[:2], tmp_path, **tiny) == {names[0]: ms[names[0]]}  # fewer
    with pytest.raises(AssertionError, match="remeasured"):  # asked to
        egmla_report.measure_decode(summaries, tmp_path, remeasure=True, **tiny)
    new = summaries + [run("mla_dc16", 0, 5.0) | {"overrides": TINY_DECODE}]
    with pytest.raises(AssertionError, match="remeasured"):  # a configuration not measured yet
        egmla_report.measure_decode(new, tmp_path, **tiny)
    # ... but not while a configuration the recipe requires has no summary (trained in pieces)
    waiting = egmla_report.measure_decode(new, tmp_path, require=("mla", "mla_table128"), **tiny)
    assert waiting == ms


def summary(stem, seed, *, gate=0, table=0, gate_at=None, loss=5.0, ms=(2.0, 1.9, 2.2)):
    return {
        "run": stem,
        "label": stem,
        "seed": seed,
        "gate_at": gate_at,
        "params": {"total": 1000 + gate + table, "embedding_gate": gate, "token_table": table},
        "kv_elements_per_token": 128,
        "decode_ms_per_token": ms[0],
        "decode_ms_range": ms[1:],
        "points": [
            {"tokens": t, "avg_acc": 0.27 + 0.01 * seed, "avg_acc_stderr": 0.01, "avg_chance": 0.333,
             "val_loss": loss + 0.01 * seed}
            for t in (100, 200)
        ],
    }  # fmt: skip


def test_panels_and_table_from_summaries(tmp_path):
    runs = [
        *(summary("mla", k) for k in range(3)),
        *(summary("eg_mla_emb16", k, gate=256) for k in range(3)),
        *(summary("mla_table16", k, table=256) for k in range(3)),
        summary("eg_mla_proj_emb128", 0, gate=2048, gate_at="projected"),
    ]
    plot(runs, tmp_path / "report.png", 16, "note")
    assert (tmp_path / "report.png").stat().st_size > 0
    table = markdown(runs, 16, "note")
    assert "| mla_table16 | 3 | 1,256 | 0 | 256 | 200 | 5.0100 ± 0.0058 |" in table
    assert "| 2.00 (1.90-2.20) |" in table


def test_the_report_waits_for_every_configuration_before_measuring_decode(tmp_path, monkeypatch):
    """Drawn while a recipe trains in pieces: configurations labelled by config stem, no decode
    measurement (the figures say "not measured"), the gaps and both files written."""
    monkeypatch.setattr("eval.decoding.decode_latency_alternated", lambda *a, **k: pytest.fail("measured"))
    runs = [
        summary(stem, k, **extra) | {"config": f"configs/egmla/cpu/{stem}.yaml", "overrides": []}
        for stem, extra in (("mla", {}), ("eg_mla_emb16", {"gate": 256}), ("mla_table16", {"table": 256}))
        for k in range(2)
    ]
    egmla_report.draw_egmla_report(runs, tmp_path)
    table = (tmp_path / "report.md").read_text()
    assert table.count("| not measured |") == 3 and "| mla_table16 | 2 |" in table
    assert "- eg_mla_emb16 - mla_table16: +0.0000 ± 0.0000" in table
    assert (tmp_path / "report.png").stat().st_size > 0 and not (tmp_path / "decode_latency.json").exists()
