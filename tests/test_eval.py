"""The eval suite: prefix-shared scoring against a plain forward pass, the accuracy metrics,
position-wise loss, power-law fits, loading a sharded run on one device, and the CLI's
figures from tiny runs made here."""

import json
import math
import shutil

import jax
import numpy as np
import pytest
from conftest import TINY_MLA, corrupt_step, tiny_overrides
from flax import nnx

from effattn_jax import checkpoint
from effattn_jax.config import load_config
from effattn_jax.model import Transformer
from effattn_jax.train.loop import run
from eval.__main__ import main as eval_main
from eval.downstream import average_accuracy, choice_chars, choice_metrics
from eval.lm_loss import lm_loss, parse_mesh, position_report, token_nll
from eval.scaling_fits import fit_power_law
from eval.scoring import direct_loglikelihood, score_requests

pytestmark = pytest.mark.slow  # trains runs to evaluate


def _requests(rng, vocab, n_questions=7):
    """Questions of 1-4 choices sharing a context (one of a single choice, as WinoGrande), and
    lengths that cross the padding buckets; contexts up to 30 tokens, continuations up to 12."""
    out = []
    for q in range(n_questions):
        ctx = tuple(int(t) for t in rng.integers(0, vocab, int(rng.integers(1, 31))))
        for _ in range(1 if q == 0 else int(rng.integers(2, 5))):
            out.append((ctx, tuple(int(t) for t in rng.integers(0, vocab, int(rng.integers(1, 13))))))
    return out


@pytest.mark.parametrize("kind,core", [("mha", "dense"), ("eg_mla", "moba")])
def test_prefix_shared_scoring_equals_direct_forward(kind, core):
    overrides = [
        *TINY_MLA,
        f"attention.kind={kind}",
        f"attention.core={core}",
        "moba.block_size=8",
        "moba.top_k=2",
    ]
    model = Transformer(load_config(None, overrides), rngs=nnx.Rngs(1))
    requests = _requests(np.random.default_rng(0), 128)
    scores = score_requests(model, requests, max_len=64, progress=False)
    direct = [direct_loglikelihood(model, c, x) for c, x in requests]
    np.testing.assert_allclose(scores.logprob, [lp for lp, _ in direct], rtol=1e-4, atol=1e-4)
    assert list(scores.tokens) == [len(x) for _, x in requests]
    assert list(scores.greedy) == [greedy for _, greedy in direct]


def test_contexts_are_cut_from_the_left_to_fit():
    model = Transformer(load_config(None, TINY_MLA), rngs=nnx.Rngs(1))
    ctx, cont = tuple(range(1, 41)), (5, 6, 7)
    scores = score_requests(model, [(ctx, cont)], max_len=16, progress=False)
    assert scores.truncated == 1
    np.testing.assert_allclose(scores.logprob[0], direct_loglikelihood(model, ctx[-13:], cont)[0], rtol=1e-4)


def test_accuracy_metrics_on_a_hand_made_task():
    # q1: acc right (-1 > -2), acc_norm wrong (-1/1 < -2/10); q2: both right; q3: both wrong
    logprobs = [np.array([-1.0, -2.0]), np.array([-5.0, -3.0]), np.array([-2.0, -4.0, -9.0])]
    chars = [np.array([1, 10]), np.array([5, 5]), np.array([1, 8, 9])]
    m = choice_metrics(logprobs, chars, np.array([0, 1, 2]))
    assert m["acc"] == pytest.approx(2 / 3) and m["acc_norm"] == pytest.approx(1 / 3)
    # sample standard error of a mean of 0/1 values: sqrt(p (1 - p) / (n - 1))
    assert m["acc_stderr"] == pytest.approx(math.sqrt(2 / 9 / 2))
    assert m["acc_norm_stderr"] == pytest.approx(math.sqrt(2 / 9 / 2))
    assert m["chance"] == pytest.approx((1 / 2 + 1 / 2 + 1 / 3) / 3)  # 1 / choices, per question


def test_acc_norm_counts_the_choice_without_its_delimiter():
    # the harness divides by len(choice); the continuation is " " + choice
    assert choice_chars(" Paris") == 5 and choice_chars("Paris") == 5 and choice_chars("  x") == 2


def test_average_takes_each_tasks_own_metric():
    from eval.downstream import TaskResult

    def result(name, acc, acc_norm):
        return TaskResult(name, "validation", 1, 2, {"acc": acc, "acc_norm": acc_norm})

    results = {
        "piqa": result("piqa", 0.0, 0.5),  # acc_norm counts
        "winogrande": result("winogrande", 0.7, 0.0),  # acc counts
        "sciq": result("sciq", 1.0, 1.0),  # not in the average
    }
    assert average_accuracy(results) == pytest.approx(0.6)


def test_every_token_windows_predict_each_token_once():
    from eval.lm_loss import window_rows

    docs = [np.arange(1, n + 1, dtype=np.int32) for n in (1, 2, 9, 10, 11, 25)]
    tokens, counts = window_rows(docs, 4)
    predicted = [int(t) for row, n in zip(tokens, counts, strict=True) for t in row[1 : 1 + n]]
    assert sorted(predicted) == sorted(int(t) for d in docs for t in d[1:])
    assert counts.max() == 4 and len(tokens) == 1 + 1 + 2 + 3 + 3 + 6


def test_position_wise_loss_of_a_constant_model_is_analytic():
    rng = np.random.default_rng(0)
    vocab, seq_len, bucket = 11, 20, 8
    logp = np.log(rng.dirichlet(np.ones(vocab)))
    docs = [rng.integers(0, vocab, n).astype(np.int32) for n in (3, 9, 21, 40, 17, 30)]
    from eval.lm_loss import document_rows

    tokens, counts = document_rows(docs, seq_len)
    nll, mask = token_nll(
        lambda inputs, targets: -logp[targets], tokens, counts, batch_size=4, progress=False
    )
    report = position_report(nll, mask, bucket)
    for b in report["buckets"]:  # positions [start, end): predictions of tokens start+1 .. end
        targets = [
            d[i + 1] for d in docs for i in range(b["start"], b["end"]) if i + 1 < min(len(d), seq_len + 1)
        ]
        assert b["tokens"] == len(targets)
        assert b["loss"] == pytest.approx(-logp[targets].mean())
    full = [d for d in docs if len(d) >= seq_len + 1]
    trailing = [d[i + 1] for d in full for i in range(seq_len - bucket, seq_len)]
    assert report["trailing"]["documents"] == len(full) == 3
    assert report["trailing"]["loss"] == pytest.approx(-logp[trailing].mean())
    every = [d[i + 1] for d in docs for i in range(min(len(d), seq_len + 1) - 1)]
    assert report["loss"] == pytest.approx(-logp[every].mean()) and report["tokens"] == len(every)


def test_power_law_fit_recovers_a_and_b():
    c = np.geomspace(0.01, 10, 6)
    exact = fit_power_law(c, 2.6 * c**-0.063)
    assert exact["a"] == pytest.approx(2.6, rel=1e-9) and exact["b"] == pytest.approx(-0.063, abs=1e-9)
    noisy = 2.6 * c**-0.063 * np.exp(np.random.default_rng(0).normal(0, 0.002, len(c)))
    fit = fit_power_law(c, noisy)
    assert fit["a"] == pytest.approx(2.6, rel=0.02) and fit["b"] == pytest.approx(-0.063, abs=0.005)
    assert 0 < fit["b_stderr"] < 0.01  # and the stated uncertainty covers the truth
    assert abs(fit["b"] + 0.063) < 4 * fit["b_stderr"]


def _train(corpus_dir, run_dir, **extra):
    return run(load_config(None, tiny_overrides(corpus_dir, run_dir, **extra)))


def test_run_saved_on_eight_devices_evaluates_the_same_on_one(tmp_path, corpus_dir):
    run_dir = tmp_path / "run"
    _train(corpus_dir, run_dir, **{"train.steps": 2, "mesh.data": 2, "mesh.fsdp": 2, "mesh.tensor": 2})
    losses = {}
    for sizes in ("2,2,2", "1,1,1", "2,1,1,4"):  # the last splits each document over 4 devices
        mesh = parse_mesh(sizes)
        cfg, graphdef, params = checkpoint.load_params(run_dir, 2, mesh)
        assert {d for leaf in jax.tree.leaves(params) for d in leaf.devices()} == set(mesh.devices.flat)
        losses[sizes] = lm_loss(cfg, graphdef, params, mesh, seq_len=32, bucket=8, progress=False)
    one = losses["1,1,1"]
    for sizes in ("2,2,2", "2,1,1,4"):
        assert losses[sizes]["loss"] == pytest.approx(one["loss"], rel=1e-5)
        assert losses[sizes]["tokens"] == one["tokens"] > 0
        for got, want in zip(losses[sizes]["buckets"], one["buckets"], strict=True):  # positions in order
            assert got["loss"] == pytest.approx(want["loss"], rel=1e-5)
    with pytest.raises(ValueError, match="data,fsdp,tensor"):
        parse_mesh("2,1")


@pytest.fixture(scope="module")
def tiny_runs(tmp_path_factory):
    """Three tiny runs: two MHA of different lengths (a scaling fit), one EG-MLA; every
    checkpoint kept (curves)."""
    from conftest import write_corpus

    root = tmp_path_factory.mktemp("eval_runs")
    corpus = write_corpus(root / "corpus")
    keep = {"checkpoint.every_steps": 2, "checkpoint.keep_every": 2}
    _train(corpus, root / "runs" / "mha_long", **{"train.steps": 4, **keep})
    # a shorter run of the same model: the long one's copy without its last checkpoint
    shutil.copytree(root / "runs" / "mha_long", root / "runs" / "mha_small")
    shutil.rmtree(root / "runs" / "mha_small" / "checkpoints" / "4")
    mla = dict(o.split("=", 1) for o in TINY_MLA if o.startswith(("mla.", "eg_mla.")))
    _train(corpus, root / "runs" / "egmla", **{"train.steps": 2, "attention.kind": "eg_mla", **mla, **keep})
    return root / "runs"


def test_bad_runs_and_steps_fail_with_one_line(tmp_path, tiny_runs, capsys):
    assert eval_main(["lm-loss", "--run", str(tmp_path / "missing")]) == 2
    assert "not a run directory" in capsys.readouterr().err
    assert eval_main(["downstream", "--run", str(tiny_runs / "mha_small"), "--step", "7"]) == 2
    assert "no checkpoint at step 7; kept steps: [2]" in capsys.readouterr().err
    for how in ("flip", "truncate"):  # a step whose manifest is gone is never evaluated, however damaged
        shutil.copytree(tiny_runs / "mha_small", tmp_path / how)
        corrupt_step(tmp_path / how / "checkpoints" / "2", how, drop_manifest=True)
        assert eval_main(["lm-loss", "--run", str(tmp_path / how)]) == 2
        err = capsys.readouterr().err
        assert "step 2 cannot be restored: MissingManifest: no checksums.json" in err, err
        assert len(err.strip().splitlines()) == 1
    # a context too long for this machine is refused before it runs, in one line
    assert eval_main(["lm-loss", "--run", str(tiny_runs / "mha_small"), "--seq-len", "300000"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]  # after the progress bar
    assert err.startswith("error: the loss of a batch needs") and "a smaller --seq-len" in err, err
    shutil.copytree(tiny_runs / "mha_small", tmp_path / "run")
    saved_config = tmp_path / "run" / "checkpoints" / "2" / "config" / "metadata"  # Orbax's JsonSave file
    saved = json.loads(saved_config.read_text())
    saved["model"]["no_such_key"] = 1  # a config this version cannot read
    saved_config.write_text(json.dumps(saved))
    assert eval_main(["lm-loss", "--run", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert (
        "cannot read the run's config" in err and "no_such_key" in err and len(err.strip().splitlines()) == 1
    )


def test_figure_commands_write_png_and_data(tmp_path, tiny_runs, capsys):
    runs = tiny_runs
    tasks = ["--tasks", "piqa,winogrande", "--limit", "3"]

    assert (
        eval_main(["downstream", "--run", str(runs / "mha_long"), *tasks, "--json", str(tmp_path / "d.json")])
        == 0
    )
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("avg_acc=") and " tasks=2 continuations=12 seconds=" in last
    d = json.loads((tmp_path / "d.json").read_text())
    assert [(t["task"], t["split"], t["questions"]) for t in d["tasks"]] == [
        ("piqa", "validation", 3),
        ("winogrande", "validation", 3),
    ]
    # per task: accuracy, its standard error and the chance level (PIQA 2 choices, WinoGrande 2)
    assert [(t["chance"], "acc_stderr" in t) for t in d["tasks"]] == [(0.5, True), (0.5, True)]
    assert d["avg_chance"] == 0.5 and last.endswith("avg_chance=0.5000")

    out = tmp_path / "out"
    assert (
        eval_main(["curves", "--runs", f"{runs}/mha_long,{runs}/egmla", *tasks, "--out", str(out / "c")]) == 0
    )
    curves = json.loads((out / "c" / "curves.json").read_text())
    assert {r["label"]: len(r["points"]) for r in curves} == {"mha dense": 2, "eg_mla emb8 dense": 1}
    point = curves[0]["points"][-1]
    assert point["avg_chance"] == 0.5 and sorted(point["tasks"]) == ["piqa", "winogrande"]
    assert {"acc", "acc_stderr", "chance"} <= set(point["tasks"]["piqa"])
    assert eval_main(["scaling", "--runs", f"{runs}/mha_*", "--out", str(out / "s")]) == 0
    scaling = json.loads((out / "s" / "scaling.json").read_text())
    assert set(scaling["fits"]) == {"full", "6nd"}  # both compute axes, both methods
    for compute in ("full", "6nd"):
        means = scaling["fits"][compute]["seed_means"]["mha dense"]  # two lengths: two configurations
        assert means["points"] == 2 and means["b_ci95"] is None  # one seed each: nothing to resample
        assert "mha dense" in scaling["fits"][compute]["envelope"]
    assert scaling["points"][0]["pflops_days_6nd"] < scaling["points"][0]["pflops_days"]
    assert (
        eval_main(["report", "--runs", f"{runs}/*", *tasks, "--context", "64", "--out", str(out / "r")]) == 0
    )
    for path in (
        "c/curves.png",
        "c/curves.csv",
        "s/scaling.png",
        "s/scaling.csv",
        "r/report.png",
        "r/report.md",
    ):
        assert (out / path).stat().st_size > 0, path
    assert "scale:" in (out / "r" / "report.md").read_text()


def test_training_compute_counts_every_matmul_or_6nd():
    from effattn_jax.flops import PFLOPS_DAY, attention_flops_per_token, run_pflops_days

    cfg = load_config(None, ["attention.core=moba", "moba.block_size=64", "moba.top_k=2"])
    tokens = 10 * cfg.data.batch_size * cfg.data.seq_len
    assert run_pflops_days(cfg, 1000, 10, compute="6nd") == pytest.approx(6 * 1000 * tokens / PFLOPS_DAY)
    moba, dense = attention_flops_per_token(cfg), attention_flops_per_token(cfg.with_full_attention())
    assert 0 < moba < dense
    head = cfg.model.d_model * cfg.model.vocab_size  # the output head is a matmul too
    assert run_pflops_days(cfg, 1000, 10) == pytest.approx((6 * (1000 + head) + moba) * tokens / PFLOPS_DAY)
    # a MoBA -> dense switch at step 4: 4 steps sparse, 6 dense
    switched = load_config(
        None, ["attention.core=moba", "moba.block_size=64", "moba.top_k=2", "moba.full_attention_from_step=4"]
    )
    per_step = cfg.data.batch_size * cfg.data.seq_len
    expected = (6 * (1000 + head) * 10 * per_step + (4 * moba + 6 * dense) * per_step) / PFLOPS_DAY
    assert run_pflops_days(switched, 1000, 10) == pytest.approx(expected)
    with pytest.raises(ValueError, match="allowed: full, 6nd"):
        run_pflops_days(cfg, 1000, 10, compute="attention")
