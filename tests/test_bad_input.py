"""Every bad input of the README's table gets one line naming the thing and what is allowed, exit
status 2, and leaves nothing half-written (the run directory is not even created)."""

import importlib.util

import pytest
from conftest import ROOT, tiny_overrides

from eval.__main__ import main as eval_main
from eval.bench.efficiency import main as efficiency_main
from eval.tasks import TaskError, load_task

_spec = importlib.util.spec_from_file_location("train_cli", ROOT / "train.py")
train_cli = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(train_cli)


def _files(tmp_path):
    """Bad files and configs, by name."""
    (tmp_path / "empty.txt").write_text(" \n")
    (tmp_path / "binary.txt").write_bytes(b"abc\x00\x01\x02def")
    (tmp_path / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    (tmp_path / "notjson.jsonl").write_text('{"text": "ok"}\nnot json\n')
    (tmp_path / "nofield.jsonl").write_text('{"text": "ok"}\n{"body": "x"}\n')
    (tmp_path / "tokenizer.json").write_text('{"not": "a tokenizer"}')
    (tmp_path / "malformed.yaml").write_text("model: [unclosed\n")
    (tmp_path / "a.yaml").write_text(f"base: {tmp_path}/b.yaml\n")
    (tmp_path / "b.yaml").write_text(f"base: {tmp_path}/a.yaml\n")
    (tmp_path / "a_file").write_text("x")
    (tmp_path / "base_dir.yaml").write_text(f"base: {tmp_path}\n")
    (tmp_path / "latin1.yaml").write_bytes("# caf\xe9\nmodel:\n  d_model: 32\n".encode("latin-1"))
    (tmp_path / "utf16.yaml").write_text("model:\n  d_model: 32\n", encoding="utf-16")


# (case, extra train.py overrides or ["--config", path], what the one line must say)
TRAIN_CASES = [
    ("unknown key", ["model.bogus=1"], "model.bogus"),
    ("wrong type", ["model.d_model=abc"], "model.d_model='abc'"),
    ("impossible sizes", ["model.num_heads=3"], "model.num_heads=3"),
    ("missing YAML", ["--config", "{tmp}/missing.yaml"], "file does not exist"),
    ("malformed YAML", ["--config", "{tmp}/malformed.yaml"], "not valid YAML"),
    ("base: loop", ["--config", "{tmp}/a.yaml"], "inheritance cycle"),
    ("more devices than exist", ["mesh.data=16"], "only 8 devices are available"),  # not the batch of 4
    ("batch that does not split over the mesh", ["mesh.data=3"], "multiple of the batch's mesh shards"),
    (
        "sequence that does not split over the context axis",
        ["mesh.data=1", "mesh.context=4", "data.seq_len=36"],
        "data.seq_len=36: with mesh.context=4 it must split into 2 x 4 equal chunks",
    ),
    (
        "MoBA chunks of the context axis not whole blocks",
        ["mesh.data=1", "mesh.context=2", "data.seq_len=48", "attention.core=moba", "moba.block_size=8"],
        "with mesh.context=2 it splits into 4 chunks of 12 tokens, which must each be a multiple of moba",
    ),
    ("DSA top-k not positive", ["attention.core=dsa", "dsa.index_topk=0"], "dsa.index_topk=0: must be > 0"),
    (
        "DSA indexer head dim odd",
        ["attention.core=dsa", "dsa.index_head_dim=33"],
        "dsa.index_head_dim=33: must be even and at least",
    ),
    (
        "DSA indexer head dim below its RoPE width",
        ["attention.core=dsa", "dsa.index_head_dim=8", "mla.qk_rope_head_dim=16"],
        "the indexer's RoPE width mla.qk_rope_head_dim=16",
    ),
    (
        "DSA's reference over a context axis",
        ["attention.core=dsa", "dsa.impl=reference", "mesh.data=1", "mesh.context=2"],
        "dsa.impl='reference': with mesh.context=2: auto, xla, pallas_triton or pallas_tpu",
    ),
    ("DSA stage unknown", ["attention.core=dsa", "dsa.stage=dense"], "dsa.stage='dense': allowed: warmup"),
    (
        "DSA absorbed on a kind without a latent",
        ["attention.core=dsa", "dsa.absorb=true"],
        "dsa.absorb=True: needs every DSA layer to absorb W_UK into its latent",
    ),
    (
        "two mesh axes filling the devices",
        ["mesh.data=-1", "mesh.context=-1"],
        "config error: mesh.data=-1 mesh.context=-1: at most one of data, fsdp, context, tensor may be -1",
    ),
    ("config path a directory", ["--config", "{tmp}"], "is a directory, not a YAML file"),
    ("base: a directory", ["--config", "{tmp}/base_dir.yaml"], "config error: base="),
    ("Latin-1 config", ["--config", "{tmp}/latin1.yaml"], "not UTF-8 text (byte 0xe9"),
    ("UTF-16 config", ["--config", "{tmp}/utf16.yaml"], "not UTF-8 text (byte 0xff"),
    ("override without =value", ["model.d_model"], "config error: model.d_model: '=value' is missing"),
    ("glob matching nothing", ["data.train_files=[{tmp}/nothing*.txt]"], "no files match"),
    ("empty file", ["data.train_files=[{tmp}/empty.txt]"], "empty file"),
    ("binary file", ["data.train_files=[{tmp}/binary.txt]"], "binary file"),
    ("non-UTF-8 file", ["data.train_files=[{tmp}/latin1.txt]"], "not valid UTF-8"),
    (
        ".jsonl line not JSON",
        ["data.train_files=[{tmp}/notjson.jsonl]"],
        "notjson.jsonl:2: not a JSON object",
    ),
    (".jsonl line without the field", ["data.train_files=[{tmp}/nofield.jsonl]"], "nofield.jsonl:2"),
    ("tokenizer path missing", ["data.tokenizer={tmp}/none.json"], "nor an existing file"),
    ("tokenizer JSON not a tokenizer", ["data.tokenizer={tmp}/tokenizer.json"], "not a tokenizers JSON file"),
    ("batch larger than the corpus", ["data.batch_size=4096"], "fewer than one batch"),
    ("run_dir is a file", ["train.run_dir={tmp}/a_file"], "cannot be written"),
    ("sequences longer than the corpus", ["data.seq_len=100000"], "the corpus gives 0 training"),
    ("a run that cannot fit in memory", ["model.mlp_dim=20000000"], "memory error: the train step needs"),
    (
        "multi-process settings incomplete",
        ["distributed.coordinator=127.0.0.1:1234"],
        "distributed.num_processes",
    ),
]


@pytest.mark.parametrize("case, extra, needle", TRAIN_CASES, ids=[c[0] for c in TRAIN_CASES])
def test_train_cli(tmp_path, corpus_dir, capsys, case, extra, needle):
    """Each bad input ends in one line naming it, exit status 2, no traceback. Catches: a validation
    removed (the error would surface later as a traceback)."""
    _files(tmp_path)
    extra = [e.format(tmp=tmp_path) for e in extra]
    config = extra[1] if extra[:1] == ["--config"] else None
    overrides = tiny_overrides(corpus_dir, tmp_path / "run")
    overrides += [e for e in extra if e != "--config" and e != config]
    argv = (["--config", config] if config else []) + overrides
    assert train_cli.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and needle in err[0], err
    assert not (tmp_path / "run").exists()


def test_train_init_from_a_corrupt_step(tmp_path, corpus_dir, capsys):
    """train.init_from a step that fails its checksum: one line naming it, exit 2, and no new run
    directory. Catches: the source verified only when it is restored, after the run is created."""
    from conftest import corrupt_step, saved_fresh_run

    saved_fresh_run(tmp_path / "source", [])
    corrupt_step(tmp_path / "source" / "checkpoints" / "0", "flip")
    overrides = tiny_overrides(corpus_dir, tmp_path / "run") + [f"train.init_from={tmp_path / 'source'}"]
    assert train_cli.main(overrides) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "train.init_from" in err[0] and "does not match its checksum" in err[0], err
    assert not (tmp_path / "run").exists()


def _exit_status(main, argv) -> int:
    try:
        return main(argv)
    except SystemExit as e:  # argparse's errors
        return e.code


def test_eval_and_efficiency_cli(tmp_path, capsys):
    """Catches: a missing run reported as a traceback."""
    for argv, needle in (
        (["lm-loss", "--run", str(tmp_path / "missing")], "not a run directory"),
        (["lm-loss", "--run", str(tmp_path)], "not a run directory"),  # a directory, but not a run
        (
            ["downstream", "--run", str(tmp_path), "--limit", "abc"],
            "--limit: 'abc': must be a positive integer",
        ),
        (["downstream", "--run", str(tmp_path), "--tasks", "piqa,nosuch"], "unknown task"),
    ):
        assert _exit_status(eval_main, argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and needle in err[0], err
    with pytest.raises(SystemExit) as e:
        efficiency_main(
            ["decode-latency", "--config", str(ROOT / "configs/cpu/default.yaml"), "--context", "abc"]
        )
    err = capsys.readouterr().err.strip().splitlines()
    assert (
        e.value.code == 2 and len(err) == 1 and "--context: 'abc': must be comma-separated positive" in err[0]
    )
    with pytest.raises(TaskError, match="task piqa: request file missing"):  # exit 2 through eval's CLI
        load_task("piqa", root=tmp_path)
