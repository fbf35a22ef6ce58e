"""Hugging Face models into runs: the converted model's logits and greedy tokens equal the
reference library's (fixtures made once by tests/fixtures/hf/make_fixtures.py), and bad model
directories are refused in one line, exit 2, nothing written."""

import json
import re
import shutil
from pathlib import Path

import jax
import numpy as np
import pytest
from conftest import saved_fresh_run
from flax import nnx

from effattn_jax import checkpoint
from effattn_jax.convert import main
from effattn_jax.data.tokenizer import load_tokenizer
from effattn_jax.generate import Generator

FIXTURES = Path(__file__).parent / "fixtures" / "hf"
FAMILIES = (
    "llama",
    "llama3",
    "mistral",
    "qwen2",
    "qwen3",
    "deepseek_v2",
    "deepseek_v3",
    "deepseek_v2_eps",  # rms_norm_eps 1e-5: MLA's latent norms keep 1e-6; DeepSeek's EOS name
    "deepseek_v32",  # DSA: an indexer per layer, each query on its top-4 of 10 tokens
    "llama_eos_list",  # eos_token_id a list
)


@pytest.mark.parametrize("family", FAMILIES)
def test_converted_model_matches_the_reference(family, tmp_path, capsys):
    """float32 logits within 1e-5 of the reference's on fixed ids, the same 8 greedy tokens, the
    tokenizer recorded in the run. Catches: a transposed or mis-split projection, the wrong RoPE
    layout or base, a tied head taken as untied, the norm's epsilon (MLA's latent norms taking
    rms_norm_eps=1e-5 differ by 2.7e-5 on deepseek_v2_eps)."""
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
    assert logits.shape == want.shape and np.abs(logits - want).max() < 1e-5
    greedy = Generator(model).generate([reference["ids"]], len(reference["greedy"]))
    assert greedy[0] == reference["greedy"]
    tok, _, path = load_tokenizer(cfg.data.tokenizer, cfg.data.eos_ids)
    assert path == out / "tokenizer.json" and tok.get_vocab_size(True) <= cfg.model.vocab_size


def test_deepseek_v32_selects_as_transformers_and_is_dense_with_every_key_selected(tmp_path, monkeypatch):
    """The converted V3.2 model's indexers pick the reference's top-4 on every layer (the slots
    past a query's visible keys aside: -1 here, masked there); with index_topk at least the prompt
    its logits are the reference's dense ones within 1e-5."""
    from effattn_jax.attention.indexer import Indexer
    from effattn_jax.ops.dsa import dsa_select

    fixture = FIXTURES / "deepseek_v32"
    ids = np.asarray([json.loads((fixture / "reference.json").read_text())["ids"]], np.int32)
    seen = []
    call = Indexer.__call__
    monkeypatch.setattr(Indexer, "__call__", lambda self, *a: seen.append(call(self, *a)) or seen[-1])
    assert main(["from-hf", "--model", str(fixture), "--out", str(tmp_path / "run")]) == 0
    cfg, graphdef, params = checkpoint.load_params(tmp_path / "run", 0)
    nnx.merge(graphdef, params)(ids)  # eagerly: each layer's indexer outputs land in `seen`
    want = np.load(fixture / "reference_topk.npy")  # [layers, S, top-k]
    assert len(seen) == cfg.model.num_layers == want.shape[0]
    for layer, (q_idx, k_idx, weights) in enumerate(seen):
        got = np.asarray(dsa_select(q_idx, k_idx, weights, top_k=cfg.dsa.index_topk))[0]
        for t in range(got.shape[0]):
            visible = min(t + 1, got.shape[1])
            assert list(got[t, :visible]) == list(want[layer, t, :visible]), (layer, t)
            assert (got[t, visible:] == -1).all()
    dense = tmp_path / "dense"
    assert main(["from-hf", "--model", str(fixture), "--out", str(dense), "dsa.index_topk=64"]) == 0
    cfg, graphdef, params = checkpoint.load_params(dense, 0)
    logits = np.asarray(jax.jit(lambda m, t: m(t))(nnx.merge(graphdef, params), ids))[0]
    assert np.abs(logits - np.load(fixture / "reference_logits_dense.npy")).max() < 1e-5


EOS = {  # what each model's own files declare (generation_config.json first), recorded as data.eos_ids
    "llama": [2],
    "qwen2": [],  # none declared: the tokenizer's own <|endoftext|>
    "deepseek_v2_eps": [1],  # <｜end▁of▁sentence｜>
    "llama_eos_list": [1, 2],
}


@pytest.mark.parametrize("family", sorted(EOS))
def test_the_end_of_text_ids_come_from_the_models_files(family, tmp_path, capsys):
    """data.eos_ids of a converted run: the model's declared ids, every one of a list; the
    tokenizer's EOS is the first (what separates documents); exported back as eos_token_id."""
    out = tmp_path / "run"
    assert main(["from-hf", "--model", str(FIXTURES / family), "--out", str(out)]) == 0
    cfg = checkpoint.load_run_config(out, 0)
    assert cfg.data.eos_ids == EOS[family]
    _, eos, _ = load_tokenizer(cfg.data.tokenizer, cfg.data.eos_ids)
    assert eos == (EOS[family] or [0])[0]
    assert main(["to-hf", "--run", str(out), "--out", str(tmp_path / "hf")]) == 0
    declared = json.loads((tmp_path / "hf" / "config.json").read_text()).get("eos_token_id")
    assert declared == (EOS[family][0] if len(EOS[family]) == 1 else EOS[family] or None)


def _without_declared_eos(model: Path) -> None:
    (model / "generation_config.json").unlink()
    _edit_config(eos_token_id=None)(model)


def test_the_eos_token_of_tokenizer_config_when_no_id_is_declared(tmp_path, capsys):
    """No eos_token_id anywhere: tokenizer_config.json's eos_token names it (DeepSeek's name,
    which no fixed list of names holds)."""
    model, out = _broken(tmp_path, _without_declared_eos, "deepseek_v2_eps"), tmp_path / "run"
    assert main(["from-hf", "--model", str(model), "--out", str(out)]) == 0
    assert checkpoint.load_run_config(out, 0).data.eos_ids == [1]


@pytest.mark.parametrize("family", ["llama", "deepseek_v2_eps"])
def test_stacked_layers_import_and_export_bit_for_bit(family, tmp_path, capsys):
    """from-hf with model.scan_layers=true: each stack holds the layers the unstacked run holds,
    bit for bit; to-hf of it writes the fixture's tensors bit for bit; importing that stacked
    again gives the same stacks."""
    from effattn_jax.convert.weights import Unstacked, stacked_layers
    from effattn_jax.sharding import leaves_by_path

    fixture = FIXTURES / family
    flat, stacked, exported, again = (tmp_path / n for n in ("flat", "stacked", "hf", "again"))
    assert main(["from-hf", "--model", str(fixture), "--out", str(flat)]) == 0
    for source, out in ((fixture, stacked), (exported, again)):
        if source == exported:
            assert main(["to-hf", "--run", str(stacked), "--out", str(exported)]) == 0
        assert main(["from-hf", "--model", str(source), "--out", str(out), "model.scan_layers=true"]) == 0
    cfg, _, params = checkpoint.load_params(stacked, 0)
    assert cfg.model.scan_layers and np.shape(params["blocks"][0]["attn_norm"]["scale"])[0] == 2
    by_layer = Unstacked(leaves_by_path(params), stacked_layers(cfg))
    for key, value in leaves_by_path(checkpoint.load_params(flat, 0)[2]).items():
        assert np.array_equal(by_layer[key], value), key
    theirs, ours = _tensors(fixture), _tensors(exported)
    assert sorted(ours) == sorted(theirs)
    assert all(np.array_equal(ours[name], theirs[name]) for name in theirs)
    a, b = checkpoint.load_params(stacked, 0)[2], checkpoint.load_params(again, 0)[2]
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        assert np.array_equal(x, y)


def _tensors(model_dir: Path) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    return load_file(str(model_dir / "model.safetensors"))


@pytest.mark.parametrize("family", FAMILIES)
def test_export_writes_the_familys_files_and_imports_back_bit_for_bit(family, tmp_path, capsys):
    """to-hf of a converted model: the fixture's own tensor names, shapes and bytes, its config's
    keys and values; importing the export gives every parameter back bit for bit."""
    fixture = FIXTURES / family
    run_dir, exported, again = tmp_path / "run", tmp_path / "hf", tmp_path / "again"
    assert main(["from-hf", "--model", str(fixture), "--out", str(run_dir)]) == 0
    assert main(["to-hf", "--run", str(run_dir), "--out", str(exported)]) == 0
    theirs, ours = _tensors(fixture), _tensors(exported)
    assert sorted(ours) == sorted(theirs)
    for name, value in theirs.items():
        assert ours[name].dtype == value.dtype and np.array_equal(ours[name], value), name
    want = json.loads((fixture / "config.json").read_text())
    got = json.loads((exported / "config.json").read_text())
    assert {k: got.get(k) for k in want} == want
    assert main(["from-hf", "--model", str(exported), "--out", str(again)]) == 0
    a, b = checkpoint.load_params(run_dir, 0)[2], checkpoint.load_params(again, 0)[2]
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        assert np.array_equal(x, y)


def _exports_and_imports_back(tmp_path: Path, name: str) -> dict:
    """to-hf of run `name`, then from-hf of that: every parameter back bit for bit; the config.json."""
    run_dir, exported, back = tmp_path / name, tmp_path / f"{name}_hf", tmp_path / f"{name}_back"
    assert main(["to-hf", "--run", str(run_dir), "--out", str(exported)]) == 0
    assert main(["from-hf", "--model", str(exported), "--out", str(back)]) == 0
    a, b = checkpoint.load_params(run_dir, 0)[2], checkpoint.load_params(back, 0)[2]
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        assert np.array_equal(x, y)
    return json.loads((exported / "config.json").read_text())


def test_runs_of_this_project_export_and_import_back(tmp_path, capsys):
    """Models of this project: MoBA exports as Llama with its MoBA settings recorded and a note,
    MLA as DeepSeek-V2, DSA on MLA as DeepSeek-V3.2; each imports back bit for bit; EG-MLA, and
    DSA without a query latent, are refused in one line."""
    from conftest import TINY_MLA

    moba = ["attention.core=moba", "moba.block_size=8", "moba.top_k=2", "model.tie_embeddings=false"]
    saved_fresh_run(tmp_path / "moba", moba)  # an output head of its own, as the Llama fixture has
    hf = _exports_and_imports_back(tmp_path, "moba")
    assert "MoBA is an attention pattern the target library will not apply" in capsys.readouterr().err
    llama = json.loads((FIXTURES / "llama" / "config.json").read_text())
    assert hf["architectures"] == ["LlamaForCausalLM"] and hf["effattn_moba"]["top_k"] == 2
    assert {"hidden_size", "num_key_value_heads", "rms_norm_eps", "intermediate_size"} <= set(hf) & set(llama)
    assert sorted(_tensors(tmp_path / "moba_hf")) == sorted(_tensors(FIXTURES / "llama"))

    mla = [o for o in TINY_MLA if o.startswith(("mla.", "eg_mla."))]
    saved_fresh_run(tmp_path / "mla", ["attention.kind=mla", "mla.q_lora_rank=12", *mla])
    assert _exports_and_imports_back(tmp_path, "mla")["architectures"] == ["DeepseekV2ForCausalLM"]

    saved_fresh_run(tmp_path / "eg", ["attention.kind=eg_mla", *mla])
    capsys.readouterr()
    assert main(["to-hf", "--run", str(tmp_path / "eg"), "--out", str(tmp_path / "eg_hf")]) == 2
    assert "EG-MLA has no Hugging Face equivalent" in capsys.readouterr().err
    assert not (tmp_path / "eg_hf").exists()

    dsa = ["attention.kind=mla", *mla, "attention.core=dsa", "dsa.index_head_dim=8"]
    saved_fresh_run(tmp_path / "dsa", [*dsa, "mla.q_lora_rank=12"])
    hf = _exports_and_imports_back(tmp_path, "dsa")
    assert hf["architectures"] == ["DeepseekV32ForCausalLM"] and hf["index_head_dim"] == 8

    saved_fresh_run(tmp_path / "dsa_no_q_latent", dsa)  # V3.2's indexer reads the query latent
    capsys.readouterr()
    assert main(["to-hf", "--run", str(tmp_path / "dsa_no_q_latent"), "--out", str(tmp_path / "x_hf")]) == 2
    assert "DSA exports as DeepSeek-V3.2" in capsys.readouterr().err
    assert not (tmp_path / "x_hf").exists()


def test_mla_with_a_token_table_is_refused_in_one_line(tmp_path, capsys):
    """EG-MLA's control (mla.token_table_dim) has no Hugging Face equivalent."""
    from conftest import TINY_MLA

    mla = [o for o in TINY_MLA if o.startswith("mla.")]
    saved_fresh_run(tmp_path / "table", ["attention.kind=mla", "mla.token_table_dim=8", *mla])
    capsys.readouterr()
    assert main(["to-hf", "--run", str(tmp_path / "table"), "--out", str(tmp_path / "table_hf")]) == 2
    err = capsys.readouterr().err
    assert "mla.token_table_dim has no Hugging Face equivalent" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "table_hf").exists()


def _broken(tmp_path, change, family="llama") -> Path:
    model = tmp_path / "model"
    shutil.copytree(FIXTURES / family, model)
    change(model)
    return model


def _edit_config(**keys):
    def change(model):
        cfg = json.loads((model / "config.json").read_text()) | keys
        (model / "config.json").write_text(json.dumps(cfg))

    return change


def _without(key):
    def change(model):
        cfg = json.loads((model / "config.json").read_text())
        del cfg[key]
        (model / "config.json").write_text(json.dumps(cfg))

    return change


def _cut(path: Path, size: int) -> None:
    path.write_bytes(path.read_bytes()[:size])


def _eos_token(token):
    """No eos_token_id declared; tokenizer_config.json's eos_token `token` (None: no such file), and
    a tokenizer whose only special token has a name outside the fixed list."""

    def change(model):
        _without_declared_eos(model)
        (model / "tokenizer_config.json").unlink(missing_ok=True)
        if token is not None:
            (model / "tokenizer_config.json").write_text(json.dumps({"eos_token": token}))
        tok = json.loads((model / "tokenizer.json").read_text())
        tok["added_tokens"][0]["content"] = "<|eot|>"
        tok["model"]["vocab"] = {
            ("<|eot|>" if t == "<|endoftext|>" else t): i for t, i in tok["model"]["vocab"].items()
        }
        (model / "tokenizer.json").write_text(json.dumps(tok))

    return change


@pytest.mark.parametrize(
    "change, says",
    [
        (lambda m: (m / "config.json").unlink(), "no config.json"),
        (lambda m: (m / "model.safetensors").unlink(), "no \\*.safetensors weights"),
        (_edit_config(architectures=["GPT2LMHeadModel"]), "architecture 'GPT2LMHeadModel' is not one"),
        (
            _edit_config(intermediate_size=96),
            "mlp.down_proj.weight is stored as \\(32, 64\\), but config.json implies \\(32, 96\\)",
        ),
        (_edit_config(vocab_size=256), "more than the model's 256 vocabulary rows"),
        (_edit_config(rope_parameters={"rope_type": "longrope", "factor": 8.0}), "rope scaling 'longrope'"),
        (_edit_config(first_k_dense_replace=1), "layers 1-1 are mixture-of-experts layers \\(1 of 2\\)"),
        (
            lambda m: _cut(m / "model.safetensors", 100_000),
            "tensor .* has \\d+ of its \\d+ bytes; the file is truncated",
        ),
        (lambda m: _cut(m / "model.safetensors", 100), "not a safetensors file, or truncated.*not JSON"),
        (lambda m: (m / "config.json").write_text("[]"), "config.json: a JSON list, not an object"),
        (
            lambda m: (m / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 999]})),
            "generation_config.json: eos_token_id 999 is not in tokenizer.json's vocabulary \\(300 tokens\\)",
        ),
        (_eos_token("<nope>"), "eos_token '<nope>' is not in tokenizer.json's vocabulary"),
        (_eos_token(None), "no end-of-text token among .*; nor does the model declare one"),
        (_without("hidden_size"), "config.json: no 'hidden_size'; a LlamaForCausalLM config needs it"),
        (_edit_config(hidden_size="32"), "config.json: hidden_size is '32'; a positive integer is wanted"),
        (
            lambda m: (m / "model.safetensors.index.json").write_text('{"weight_map": {'),
            "model.safetensors.index.json: not JSON; the download was cut short",
        ),
        (
            lambda m: (m / "model.safetensors.index.json").write_text('{"metadata": {}}'),
            "model.safetensors.index.json: no weight_map of tensor names to files",
        ),
    ],
    ids=[
        "no-config",
        "no-weights",
        "architecture",
        "shape",
        "tokenizer",
        "rope-scaling",
        "moe",
        "truncated-weights",
        "weights-cut-to-100-bytes",
        "config-not-an-object",
        "eos-id-not-in-vocabulary",
        "eos-token-not-in-vocabulary",
        "no-eos-at-all",
        "config-without-a-size",
        "config-size-a-string",
        "index-cut-short",
        "index-without-weight-map",
    ],
)
def test_bad_model_directories_are_refused_in_one_line(tmp_path, capsys, change, says):
    out = tmp_path / "out"
    family = "deepseek_v2" if "experts" in says else "llama"
    assert main(["from-hf", "--model", str(_broken(tmp_path, change, family)), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("error: ")
    assert pytest.importorskip("re").search(says, err), err
    assert not out.exists()


def _plant(kind: str):
    """Rewrites layer 0's first non-square attention weight transposed, flattened or reshaped: the
    same elements in another shape, which a layout's transpose and reshape would quietly accept."""
    from safetensors.numpy import load_file, save_file

    def change(model):
        tensors = load_file(model / "model.safetensors")
        name = next(
            k for k, w in sorted(tensors.items())
            if ".layers.0.self_attn." in k and w.ndim == 2 and w.shape[0] != w.shape[1]
        )  # fmt: skip
        w = tensors[name]
        tensors[name] = {"transposed": w.T, "flattened": w.reshape(-1), "reshaped": w.reshape(2, -1)}[kind]
        save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, model / "model.safetensors")

    return change


@pytest.mark.parametrize(
    "family, override", [("llama", "model.d_model=64"), ("qwen3", "attention.kind=eg_mla")]
)
def test_overrides_that_change_the_architecture_are_refused_in_one_line(tmp_path, capsys, family, override):
    """The checkpoint fixes its sizes and attention kind: an override of one names the key, the value
    config.json gives and every key the checkpoint fixes (it blamed a tensor, or a parameter the
    family lacks)."""
    out = tmp_path / "out"
    assert main(["from-hf", "--model", str(FIXTURES / family), "--out", str(out), override]) == 2
    err = capsys.readouterr().err.strip()
    assert (
        len(err.splitlines()) == 1 and f"{override}: " in err and "the checkpoint fixes attention.kind" in err
    )
    assert not out.exists()


def test_a_model_path_at_a_file_is_refused_in_one_line(tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["from-hf", "--model", str(FIXTURES / "llama" / "config.json"), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "config.json: a file; --model takes the model's directory" in err
    assert not out.exists()


@pytest.mark.parametrize("kind", ["transposed", "flattened", "reshaped"])
@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3", "deepseek_v2", "deepseek_v3"])
def test_attention_weights_in_another_shape_are_refused(tmp_path, capsys, family, kind):
    """A weight with the right number of elements in the wrong shape is refused before any transpose
    or reshape, in one line naming the tensor, both shapes and the file; nothing written. Catches:
    the shape compared only after the layout (a wrong model converted with exit 0)."""
    out = tmp_path / "out"
    model = _broken(tmp_path, _plant(kind), family)
    assert main(["from-hf", "--model", str(model), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert re.search(
        r"model.safetensors: tensor model.layers.0.self_attn.\S+ is stored as \(.*\), "
        r"but config.json implies \(",
        err,
    ), err
    assert not out.exists()


@pytest.mark.slow
def test_a_converted_model_resumes_in_place_and_trains_on_as_moba(tmp_path, corpus_dir, capsys):
    """train.py on the converted run directory resumes from its step 0 (parameters only: a fresh
    optimizer state); and the paper's continual path: a new run from its parameters
    (train.init_from) with MoBA layers (no parameters of their own) on the model's tokenizer."""
    from conftest import tiny_overrides

    from effattn_jax.config import load_config
    from effattn_jax.train.loop import run

    converted = tmp_path / "converted"
    keep = ("data.", "train.", "checkpoint.", "mesh.")
    data = [o for o in tiny_overrides(corpus_dir, converted) if o.startswith(keep)]
    data = [o for o in data if not o.startswith(("data.seq_len", "train.run_dir"))]
    assert main(["from-hf", "--model", str(FIXTURES / "llama"), "--out", str(converted), *data]) == 0
    in_place = run(load_config(str(converted / "config.yaml"), ["train.steps=2"]))
    assert in_place["step"] == 2 and "resumed from step 0" in capsys.readouterr().err
    assert checkpoint.kept_steps(converted) == [0, 2]

    keys = {
        "train.init_from": f"{converted}@0",
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


@pytest.mark.parametrize(
    "change, says",
    [
        (_edit_config(q_lora_rank=None), "no 'q_lora_rank'; a DeepseekV32ForCausalLM config needs it"),
        (_edit_config(mlp_layer_types=["dense", "sparse"]), "layers 1-1 are mixture-of-experts layers"),
        (None, "dsa.index_head_dim=16: .*config.json fixes it \\(8\\)"),
    ],
    ids=["no-q-latent", "moe-layer", "indexer-width-override"],
)
def test_deepseek_v32_that_cannot_convert_is_refused_in_one_line(tmp_path, capsys, change, says):
    out = tmp_path / "out"
    if change is None:  # the fixture as it is, an override against its weights' shapes
        args = ["--model", str(FIXTURES / "deepseek_v32"), "--out", str(out), "dsa.index_head_dim=16"]
    else:
        args = ["--model", str(_broken(tmp_path, change, "deepseek_v32")), "--out", str(out)]
    assert main(["from-hf", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and re.search(says, err), err
    assert not out.exists()


@pytest.mark.parametrize("command", ["from-hf", "to-hf"])
@pytest.mark.parametrize("where", ["a file", "read-only"])
def test_an_out_that_cannot_be_written_is_refused_in_one_line(command, where, tmp_path, capsys, monkeypatch):
    """--out an existing file, or in a read-only file system (mkdir raising EROFS): one line,
    exit 2, nothing created. Catches: NotADirectoryError or OSError ending in a traceback."""
    import errno
    import pathlib

    saved_fresh_run(tmp_path / "run", [])
    if where == "a file":
        out = tmp_path / "a_file"
        out.write_text("x")
    else:
        out = tmp_path / "ro" / "out"
        mkdir = pathlib.Path.mkdir

        def read_only(self, *args, **kwargs):
            if str(self).startswith(str(tmp_path / "ro")):
                raise OSError(errno.EROFS, "Read-only file system", str(self))
            return mkdir(self, *args, **kwargs)

        monkeypatch.setattr(pathlib.Path, "mkdir", read_only)
    source = (
        ["--model", str(FIXTURES / "llama")] if command == "from-hf" else ["--run", str(tmp_path / "run")]
    )
    capsys.readouterr()
    assert main([command, *source, "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    says = (
        "a file, not a directory"
        if where == "a file"
        else "cannot be written (Read-only file system (EROFS))"
    )
    assert len(err.splitlines()) == 1 and err.startswith(f"error: --out={out}: {says}"), err
    assert out.read_text() == "x" if where == "a file" else not (tmp_path / "ro").exists()


def test_eos_ids_outside_the_vocabulary_are_refused():
    """data.eos_ids past the model's rows (config), or past the tokenizer's (on loading it)."""
    from effattn_jax.config import ConfigError, load_config
    from effattn_jax.data.corpus import DataError

    with pytest.raises(ConfigError, match=r"data.eos_ids=\[999999\]: token ids in \[0, model.vocab_size="):
        load_config(None, ["data.eos_ids=[999999]"])
    with pytest.raises(
        DataError, match=r"data.eos_ids=\[2, 300\]: id 300 is not in the vocabulary of .*300 tokens"
    ):
        load_tokenizer(str(FIXTURES / "llama" / "tokenizer.json"), [2, 300])
    assert load_tokenizer(str(FIXTURES / "llama" / "tokenizer.json"), [2, 1])[1] == 2


def test_generate_ends_the_text_at_any_declared_end_of_text(tmp_path, capsys, monkeypatch):
    """`python -m effattn_jax.generate` on a model declaring two EOS ids prints each row up to the
    first of either (the generated ids are fixed here: a random model rarely emits one)."""
    from effattn_jax import generate

    run = tmp_path / "run"
    assert main(["from-hf", "--model", str(FIXTURES / "llama_eos_list"), "--out", str(run)]) == 0
    rows = [[40, 41, 2, 42], [43, 1, 44], [45, 46]]
    monkeypatch.setattr(generate.Generator, "generate", lambda self, prompts, n, **kw: rows)
    capsys.readouterr()
    assert generate.main(["--run", str(run), "--max-new-tokens", "4"] + ["--prompt", "the"] * 3) == 0
    tok = load_tokenizer(str(run / "tokenizer.json"), [1, 2])[0]
    texts = capsys.readouterr().out.split("---\n")[:3]
    assert texts == [f"the{tok.decode(ids)}\n" for ids in ([40, 41], [43], [45, 46])]
