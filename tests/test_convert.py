"""Hugging Face models into runs: the converted model's logits and greedy tokens equal the
reference library's (fixtures made once by tests/fixtures/hf/make_fixtures.py), and bad model
directories are refused in one line, exit 2, nothing written."""

import json
import shutil
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx

from effattn_jax import checkpoint
from effattn_jax.convert import main
from effattn_jax.data.tokenizer import load_tokenizer
from effattn_jax.generate import Generator

FIXTURES = Path(__file__).parent / "fixtures" / "hf"
FAMILIES = ("llama", "mistral")


@pytest.mark.parametrize("family", FAMILIES)
def test_converted_model_matches_the_reference(family, tmp_path, capsys):
    """float32 logits within 1e-4 of the reference's on fixed ids, the same 8 greedy tokens, the
    tokenizer recorded in the run. Catches: a transposed or mis-split projection, the wrong RoPE
    layout or base, a tied head taken as untied, the norm's epsilon."""
    fixture = FIXTURES / family
    reference = json.loads((fixture / "reference.json").read_text())
    out = tmp_path / "run"
    assert main(["from-hf", "--model", str(fixture), "--out", str(out)]) == 0
    assert checkpoint.kept_steps(out) == [0]
    cfg, graphdef, params = checkpoint.load_params(out, 0)
    model = nnx.merge(graphdef, params)
    ids = np.asarray([reference["ids"]], np.int32)
    logits = np.asarray(jax.jit(lambda m, t: m(t))(model, ids))[0]
    want = np.load(fixture / "reference_logits.npy")
    assert logits.shape == want.shape and np.abs(logits - want).max() < 1e-4
    greedy = Generator(model).generate([reference["ids"]], len(reference["greedy"]))
    assert greedy[0] == reference["greedy"]
    tok, _, path = load_tokenizer(cfg.data.tokenizer)
    assert path == out / "tokenizer.json" and tok.get_vocab_size(True) <= cfg.model.vocab_size


def _broken(tmp_path, change) -> Path:
    model = tmp_path / "model"
    shutil.copytree(FIXTURES / "llama", model)
    change(model)
    return model


def _edit_config(**keys):
    def change(model):
        cfg = json.loads((model / "config.json").read_text()) | keys
        (model / "config.json").write_text(json.dumps(cfg))

    return change


@pytest.mark.parametrize(
    "change, says",
    [
        (lambda m: (m / "config.json").unlink(), "no config.json"),
        (lambda m: (m / "model.safetensors").unlink(), "no \\*.safetensors weights"),
        (_edit_config(architectures=["GPT2LMHeadModel"]), "architecture 'GPT2LMHeadModel' is not one"),
        (_edit_config(intermediate_size=96), "does not match its config"),
        (_edit_config(vocab_size=256), "more than the model's 256 vocabulary rows"),
        (_edit_config(rope_parameters={"rope_type": "llama3", "factor": 8.0}), "rope scaling"),
    ],
    ids=["no-config", "no-weights", "architecture", "shape", "tokenizer", "rope-scaling"],
)
def test_bad_model_directories_are_refused_in_one_line(tmp_path, capsys, change, says):
    out = tmp_path / "out"
    assert main(["from-hf", "--model", str(_broken(tmp_path, change)), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("error: ")
    assert pytest.importorskip("re").search(says, err), err
    assert not out.exists()


@pytest.mark.slow
def test_a_converted_model_trains_on_as_moba(tmp_path, corpus_dir, capsys):
    """The paper's continual path on a converted model: a new run from its parameters
    (train.init_from) with MoBA layers (no parameters of their own) on the model's tokenizer."""
    from conftest import tiny_overrides

    from effattn_jax.config import load_config
    from effattn_jax.train.loop import run

    converted = tmp_path / "converted"
    assert main(["from-hf", "--model", str(FIXTURES / "llama"), "--out", str(converted)]) == 0
    keys = {
        "train.init_from": str(converted),
        "train.steps": 2,
        "model.vocab_size": 320,
        "model.tie_embeddings": "false",
        "data.tokenizer": str(converted / "tokenizer.json"),
        "attention.core": "moba",
        "moba.block_size": 8,
        "moba.top_k": 2,
    }
    result = run(load_config(None, tiny_overrides(corpus_dir, tmp_path / "moba", **keys)))
    assert result["step"] == 2 and np.isfinite(result["val_loss"])
    assert f"started from the parameters of {converted} step 0" in capsys.readouterr().err
