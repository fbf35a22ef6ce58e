"""lm-evaluation-harness through `--model effattn`, offline: the task YAMLs under
tests/harness_tasks/ read JSON lines built here from data the project caches. The harness's
figures equal the suite's on the same questions and documents, in one process and in two."""

import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest
from conftest import ROOT, WORDS, saved_fresh_run
from flax import nnx

from effattn_jax import checkpoint

HARNESS_TASKS = ROOT / "tests" / "harness_tasks"
TASKS = "offline_arc_challenge,offline_rolling,offline_generate"
ARC_LIMIT = 40
MAX_GEN, STOPS = 12, (".", "\n")  # offline_generate.yaml's generation_kwargs


def test_the_model_is_registered_and_declared_as_a_plugin():
    from importlib.metadata import entry_points

    from lm_eval.api.registry import get_model

    from eval.harness import EffattnLM

    assert get_model("effattn") is EffattnLM  # importing eval.harness registers it (lm-eval 0.4.13)
    (plugin,) = [e for e in entry_points(group="lm_eval.models") if e.name == "effattn"]
    assert plugin.load() is EffattnLM  # what harness releases with plugin discovery read


def test_generation_settings_follow_the_harness_and_refuse_what_cannot_fit():
    from eval.harness import _generation_settings

    assert _generation_settings({"until": "\n\n", "max_gen_toks": 8}, 32) == (("\n\n",), 8, 0.0, 1.0)
    sampled = {"until": [".", "?"], "do_sample": True, "temperature": 0.7, "top_p": 0.9}
    assert _generation_settings(sampled, 512) == ((".", "?"), 256, 0.7, 0.9)
    assert _generation_settings({"temperature": 0.7}, 512)[2] == 0.0  # greedy unless do_sample
    with pytest.raises(ValueError, match="max_gen_toks=32: .* context of 32 tokens"):
        _generation_settings({"max_gen_toks": 32}, 32)


def test_bad_model_args_are_one_line_and_exit_2(harness_inputs, capsys, monkeypatch):
    from eval.harness.__main__ import main

    root, _, _ = harness_inputs
    monkeypatch.chdir(root / "work")
    base = ["--model", "effattn", "--tasks", "offline_arc_challenge", "--include_path", str(HARNESS_TASKS)]
    run = root / "run"
    for model_args, says in (
        (f"run={run},step=7", "no checkpoint at step 7; kept steps: [0]"),
        (f"run={run},stepp=3", "unknown key ['stepp']; allowed: run, step"),
        ("step=0", "run=RUN_DIR is required"),
        (f"run={root / 'nothing'}", "not a run directory"),
        (f"run={run},batch_size=0", "batch_size=0: must be a positive number of prompts, or auto"),
        (
            f"run={run},mesh=3x3",
            "mesh=3x3: expected DxFxT[xC] sizes (data, fsdp, tensor, context), e.g. 1x1x1",
        ),
        (f"run={run},mesh=0x1x1", "mesh=0x1x1: expected DxFxT[xC] sizes"),
        (f"run={run},step=abc", "--model_args step='abc': expected a step number or latest"),
        (f"run={run},step=all", "--model_args step='all': expected a step number or latest"),
        (f"run={run},run={run}", "run given twice"),
        (f"run={run},batch_size=-1", "batch_size=-1: must be a positive number of prompts"),
    ):
        assert main([*base, "--model_args", model_args]) == 2
        last = capsys.readouterr().err.strip().splitlines()[-1]
        assert last.startswith("error: ") and says in last, last


def test_batch_size_in_model_args_wins_over_the_harness_own(monkeypatch):
    """The harness passes its own batch_size to every model: one given in --model_args is taken
    instead of the two colliding (a TypeError before)."""
    from eval.harness import EffattnLM

    seen = {}
    monkeypatch.setattr(EffattnLM, "__init__", lambda self, **kw: seen.update(kw))
    harness_own = {"batch_size": 1, "max_batch_size": None, "device": "cpu"}
    EffattnLM.create_from_arg_string("run=r,batch_size=4", harness_own)
    assert seen == {"run": "r", "batch_size": 4, "device": "cpu"}
    seen.clear()
    EffattnLM.create_from_arg_string("run=r", harness_own)
    assert seen == {"run": "r", "batch_size": 1, "device": "cpu"}


def test_generated_text_ends_at_any_declared_end_of_text():
    """A model declaring several EOS ids (data.eos_ids, e.g. Llama 3 Instruct's two): a row's
    text ends at the first of any of them."""
    from effattn_jax.data.tokenizer import stop_ids
    from eval.harness import EffattnLM

    lm = object.__new__(EffattnLM)
    lm.stop_ids = stop_ids(1, [1, 2])
    assert (lm._end([5, 6, 2, 1]), lm._end([5, 6]), lm._end([1, 5])) == (2, 2, 0)
    assert stop_ids(0) == {0}


def _texts(rng, n, words):
    return [" ".join(WORDS[int(i)] for i in rng.integers(0, len(WORDS), k)).capitalize() for k in words[:n]]


@pytest.fixture(scope="module")
def harness_inputs(tmp_path_factory):
    """A fresh tiny model at context 32 and the offline tasks' JSON lines: 40 ARC-Challenge
    questions, documents of 3-150 words (one to several of the harness's rolling windows), and
    prompts."""
    from eval.harness.offline import write_choice_docs

    root = tmp_path_factory.mktemp("harness")
    saved_fresh_run(root / "run", [])
    work = root / "work"
    work.mkdir()
    assert write_choice_docs("arc_challenge", work / "arc_challenge.jsonl", limit=ARC_LIMIT) == ARC_LIMIT
    rng = np.random.default_rng(0)
    docs = _texts(rng, 5, [3, 20, 45, 90, 150])
    (work / "rolling.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in docs))
    prompts = _texts(rng, 6, [1, 4, 9, 16, 30, 60])
    rows = [{"prompt": p, "target": "the"} for p in prompts]
    (work / "generate.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return root, docs, prompts


def _harness(root, out, *launch) -> subprocess.CompletedProcess:
    """`python -m eval.harness` on the three offline tasks, per-sample outputs logged."""
    args = ["--model", "effattn", "--model_args", f"run={root / 'run'}", "--tasks", TASKS]
    args += ["--include_path", str(HARNESS_TASKS), "--output_path", str(out), "--log_samples"]
    args += ["--batch_size", "4"]
    cmd = [sys.executable, "-m", *(launch or ["eval.harness"]), *args]
    env = os.environ | {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "HF_HOME": str(root / "hf")}
    env["PYTHONPATH"] = str(ROOT)  # the working directory holds the task data, not the project
    p = subprocess.run(cmd, cwd=root / "work", env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-4000:]
    return p


def _outputs(out) -> tuple[dict, dict]:
    """(results per task, per-sample responses per task in document order) of one harness run."""
    (results,) = out.rglob("results_*.json")
    samples = {}
    for f in out.rglob("samples_*.jsonl"):
        lines = sorted((json.loads(line) for line in f.read_text().splitlines()), key=lambda s: s["doc_id"])
        task = next(t for t in TASKS.split(",") if f.name.startswith(f"samples_{t}_"))
        samples[task] = [s["filtered_resps"] for s in lines]
    return json.loads(results.read_text())["results"], samples


@pytest.mark.slow  # a subprocess running the harness
def test_harness_figures_equal_the_suites(harness_inputs):
    from effattn_jax.data.tokenizer import load_tokenizer
    from eval.downstream import run_downstream

    root, docs, prompts = harness_inputs
    p = _harness(root, root / "one")
    assert " on cpu: " in p.stdout.splitlines()[0]  # the start-up line naming the platform
    results, samples = _outputs(root / "one")
    cfg, graphdef, params = checkpoint.load_params(root / "run", 0)
    model = nnx.merge(graphdef, params)

    # ARC-Challenge: the same counts as `python -m eval downstream` on the same questions
    (ours,) = run_downstream(model, cfg, ["arc_challenge"], limit=ARC_LIMIT, progress=False)["tasks"]
    theirs = results["offline_arc_challenge"]
    for metric in ("acc", "acc_norm"):
        assert round(theirs[f"{metric},none"] * ARC_LIMIT) == round(ours[metric] * ARC_LIMIT)
        assert theirs[f"{metric},none"] == pytest.approx(ours[metric], abs=1e-12)
        assert theirs[f"{metric}_stderr,none"] == pytest.approx(ours[f"{metric}_stderr"], rel=1e-9)

    tokenizer, eos, _ = load_tokenizer(cfg.data.tokenizer)
    rolling = [float(r[0]) if isinstance(r, list) else float(r) for r in samples["offline_rolling"]]
    np.testing.assert_allclose(
        rolling, _lm_loss_over_windows(cfg, graphdef, params, tokenizer, eos, docs), rtol=2e-5
    )

    generated = [r[0] for r in samples["offline_generate"]]
    assert generated == _greedy(model, cfg.data.seq_len, tokenizer, eos, prompts)

    # two processes, each scoring and generating its share: the same figures and outputs
    _harness(
        root,
        root / "two",
        "effattn_jax.launch",
        "--processes",
        "2",
        "--devices-per-process",
        "1",
        "--log-dir",
        str(root / "logs"),
        "--module",
        "eval.harness",
        "--",
    )
    results2, samples2 = _outputs(root / "two")
    for task in ("offline_arc_challenge", "offline_generate"):
        assert results2[task] == results[task]
    assert samples2["offline_generate"] == samples["offline_generate"]
    np.testing.assert_allclose(
        [float(r[0]) if isinstance(r, list) else float(r) for r in samples2["offline_rolling"]],
        rolling,
        rtol=1e-6,
    )


def _lm_loss_over_windows(cfg, graphdef, params, tokenizer, eos, docs) -> list[float]:
    """Each document's log-likelihood by `python -m eval lm-loss`'s per-token NLL (a full
    forward pass) over the harness's own rolling windows (EOS before the first token)."""
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

    from effattn_jax.sharding import make_mesh
    from eval.lm_loss import make_nll_fn

    seq = cfg.data.seq_len
    nll_fn = make_nll_fn(cfg, graphdef, params, make_mesh(1, 1, 1, devices=jax.local_devices()), 1, seq)
    out = []
    for text in docs:
        ids = tokenizer.encode(text, add_special_tokens=False).ids
        total = 0.0
        for window in get_rolling_token_windows(ids, eos, seq, 1):
            context, pred = make_disjoint_window(window)
            row = np.zeros(seq + 1, np.int32)
            tokens = [*context, *pred]
            row[: len(tokens)] = tokens
            nll = np.asarray(nll_fn(row[None, :-1], row[None, 1:]))[0]
            total -= nll[len(tokens) - 1 - len(pred) : len(tokens) - 1].sum()
        out.append(total)
    return out


def _greedy(model, seq_len, tokenizer, eos, prompts) -> list[str]:
    """`effattn_jax.generate`'s greedy text for each prompt alone, up to EOS, cut at the stops."""
    from effattn_jax.generate import Generator

    keep = seq_len - MAX_GEN
    generator, out = Generator(model), []
    for prompt in prompts:
        ids = tokenizer.encode(prompt, add_special_tokens=False).ids[-keep:]
        (new,) = generator.generate([ids], MAX_GEN)
        text = tokenizer.decode(new[: new.index(eos)] if eos in new else new)
        for stop in STOPS:
            text = text.split(stop)[0]
        out.append(text)
    return out
