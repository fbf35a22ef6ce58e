"""`python -m effattn_jax.data.prepare`: tokenized shards on disk, their manifest, resume and bad input."""

import importlib.util
import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard
from conftest import ROOT, WORDS, tiny_overrides

from effattn_jax.config import load_config
from effattn_jax.data import prepare as prep
from effattn_jax.data.corpus import DataError, Inputs, iter_documents
from effattn_jax.data.pipeline import build_corpus
from effattn_jax.data.shards import Manifest
from effattn_jax.data.small_bpe import train_small_bpe
from effattn_jax.data.tokenizer import load_tokenizer
from effattn_jax.train.loop import Preempted, run
from effattn_jax.train.metrics import read_scalars

SMALL = {"tokenizer": "gpt-neox-olmo", "chunk_tokens": 16, "shard_tokens": 120, "progress": False}


def texts(n, seed=0):
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(WORDS, int(rng.integers(3, 60)))) for _ in range(n)]


def jsonl_corpus(root, n_files=3, docs=12):
    root.mkdir(parents=True, exist_ok=True)
    for f in range(n_files):
        lines = [json.dumps({"text": t, "id": i}) for i, t in enumerate(texts(docs, seed=f))]
        (root / f"part{f}.jsonl").write_text("\n".join(lines) + "\n")
    return Inputs(tuple(sorted(root.glob("*.jsonl"))), val_fraction=0.2)


def expected_ids(inputs):
    tok, eos, _ = load_tokenizer("gpt-neox-olmo")
    out = {"train": [], "val": []}
    for p in inputs.files:
        for d in iter_documents(p, inputs.field):
            ids = tok.encode(d.text, add_special_tokens=False).ids + [eos]
            out["val" if inputs.is_validation(p, d) else "train"].append(ids)
    return out


def shard_bytes(out):
    return {p.name: p.read_bytes() for p in sorted(out.glob("*.arrayrecord"))}


def test_shards_round_trip_and_are_deterministic(tmp_path):
    inputs = jsonl_corpus(tmp_path / "corpus")
    m = prep.prepare(inputs, tmp_path / "a", **SMALL)
    want = expected_ids(inputs)
    for split in ("train", "val"):
        assert [list(d) for d in m.stream(split).documents()] == want[split]
        assert m.data[split]["documents"] == len(want[split]) > 0
    assert len(m.data["train"]["shards"]) > 2 and m.data["dtype"] == "<u2"
    counts = np.bincount(np.concatenate(want["train"]), minlength=len(m.token_counts()))
    assert (m.token_counts() == counts).all()
    # worker processes give the same bytes; the checksums verify
    again = prep.prepare(inputs, tmp_path / "b", **SMALL, workers=2)
    assert shard_bytes(tmp_path / "a") == shard_bytes(tmp_path / "b")
    again.verify()
    (tmp_path / "b" / m.data["train"]["shards"][1]["file"]).write_bytes(b"\0" * 64)
    with pytest.raises(DataError, match="bytes, the manifest says"):
        Manifest.load(tmp_path / "b").stream("train")


def test_interrupted_prepare_resumes_and_finished_is_not_redone(tmp_path, monkeypatch):
    """A prepare stopped after two shards resumes to the same shards as an uninterrupted one, and a
    finished prepare is not redone; a half-written shard left behind is ignored. Catches: a resume
    that starts over or skips documents, a finished prepare run again."""
    inputs = jsonl_corpus(tmp_path / "corpus")
    prep.prepare(inputs, tmp_path / "whole", **SMALL)
    saves, real_save = [], prep._save_progress

    def interrupt_after_two(*args):
        real_save(*args)
        saves.append(1)
        if len(saves) == 2:
            raise KeyboardInterrupt

    monkeypatch.setattr(prep, "_save_progress", interrupt_after_two)
    with pytest.raises(KeyboardInterrupt):
        prep.prepare(inputs, tmp_path / "cut", **SMALL)
    assert not (tmp_path / "cut" / "manifest.json").exists()
    done = json.loads((tmp_path / "cut" / "progress.json").read_text())["state"]["documents"]
    (tmp_path / "cut" / "train-00009.arrayrecord.tmp").write_bytes(b"half a shard")
    monkeypatch.setattr(prep, "_save_progress", real_save)
    encoded = []
    monkeypatch.setattr(prep, "_encode", lambda t: encoded.append(len(t)) or real_encode(t))
    m = prep.prepare(inputs, tmp_path / "cut", **SMALL)
    assert shard_bytes(tmp_path / "cut") == shard_bytes(tmp_path / "whole")
    assert sum(encoded) == 36 - done["train"] - done["val"] < 30  # the first shards' documents: not again
    assert m.data["train"] == Manifest.load(tmp_path / "whole").data["train"]
    encoded.clear()
    prep.prepare(inputs, tmp_path / "cut", **SMALL)
    assert encoded == []  # finished: nothing redone
    with pytest.raises(DataError, match="another request .*shard_tokens"):
        prep.prepare(inputs, tmp_path / "cut", **{**SMALL, "shard_tokens": 500})


real_encode = prep._encode


def test_parquet_and_zstd_jsonl_read_like_jsonl(tmp_path):
    inputs = jsonl_corpus(tmp_path / "corpus", n_files=1)
    lines = inputs.files[0].read_bytes()
    (tmp_path / "z").mkdir()
    (tmp_path / "z" / "part0.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(lines))
    rows = [json.loads(x) for x in lines.decode().splitlines()]
    pq.write_table(
        pa.table({"id": [r["id"] for r in rows], "text": [r["text"] for r in rows]}), tmp_path / "p.parquet"
    )
    want = [d.text for d in iter_documents(inputs.files[0])]
    assert [d.text for d in iter_documents(tmp_path / "z" / "part0.jsonl.zst")] == want
    assert [d.text for d in iter_documents(tmp_path / "p.parquet")] == want
    assert (
        prep.main(
            ["--input", f"{tmp_path}/z/*.{{zst,nothing}}", "--out", str(tmp_path / "o"), "--workers", "0"]
        )
        == 0
    )
    assert Manifest.load(tmp_path / "o").data["train"]["documents"] + Manifest.load(tmp_path / "o").data[
        "val"
    ]["documents"] == len(want)


def test_bad_inputs_name_the_file_and_row(tmp_path):
    """A directory, non-UTF-8 text, a cut .zst stream, a file that is not Parquet, a Parquet file
    without the field or with a null each stop naming the file (and line or row); the CLI exits 2.
    Catches: a reader that skips or replaces bad input silently."""
    good = json.dumps({"text": "fine"}) + "\n"
    (tmp_path / "latin1.jsonl").write_bytes(good.encode() + '{"text": "caf\xe9"}\n'.encode("latin-1"))
    (tmp_path / "cut.jsonl.zst").write_bytes(
        zstandard.ZstdCompressor().compress(
            "".join(json.dumps({"text": t}) + "\n" for t in texts(400)).encode()
        )[:-99]
    )
    (tmp_path / "fake.parquet").write_bytes(b"not parquet at all")
    pq.write_table(pa.table({"body": ["a", "b"]}), tmp_path / "nofield.parquet")
    pq.write_table(pa.table({"text": ["a", None]}), tmp_path / "null.parquet")
    (tmp_path / "dir.jsonl").mkdir()
    cases = {
        "dir.jsonl": r"dir.jsonl: cannot read",
        "latin1.jsonl": r"latin1.jsonl:2: not valid UTF-8",
        "cut.jsonl.zst": r"cut.jsonl.zst:\d+: corrupt zstd",
        "fake.parquet": r"fake.parquet: not a readable Parquet",
        "nofield.parquet": r"nofield.parquet: no column 'text' \(columns: body\)",
        "null.parquet": r"null.parquet: row 2: 'text' is not a string",
    }
    for name, needle in cases.items():
        with pytest.raises(DataError, match=needle):
            list(iter_documents(tmp_path / name))
    assert (
        prep.main(["--input", str(tmp_path / "null.parquet"), "--out", str(tmp_path / "o"), "--workers", "0"])
        == 2
    )


def test_training_reads_a_prepared_corpus_and_checks_its_tokenizer(tmp_path, corpus_dir):
    files = tiny_overrides(corpus_dir, tmp_path / "run")
    data = load_config(None, files).data
    cached = build_corpus(data)
    inputs = Inputs.of(
        sorted((corpus_dir / "train").glob("*.txt")), sorted((corpus_dir / "val").glob("*.txt")), 0.0, "text"
    )
    assert (
        prep.main(
            [
                "--input",
                f"{corpus_dir}/train/*.txt",
                "--val-input",
                f"{corpus_dir}/val/*.txt",
                "--out",
                str(tmp_path / "p"),
                "--workers",
                "0",
            ]
        )
        == 0
    )
    assert (
        Manifest.load(tmp_path / "p").data["request"]["inputs"]
        == prep.request_of(inputs, prep.tokenizer_info("gpt-neox-olmo"), prep.DEFAULT_SHARD_TOKENS)["inputs"]
    )
    prepared = build_corpus(
        load_config(None, [*files, "data.source=prepared", f"data.path={tmp_path / 'p'}"]).data
    )
    assert (
        len(prepared.train) == len(cached.train)
        and (prepared.train_token_counts == cached.train_token_counts).all()
    )
    assert all(
        (prepared.train[i]["inputs"] == cached.train[i]["inputs"]).all() for i in range(len(cached.train))
    )
    (tmp_path / "tok.json").write_text(train_small_bpe(300, texts(50)))
    other = load_config(
        None,
        [
            *files,
            "data.source=prepared",
            f"data.path={tmp_path / 'p'}",
            f"data.tokenizer={tmp_path / 'tok.json'}",
        ],
    )
    with pytest.raises(DataError, match="prepared with tokenizer 'gpt-neox-olmo', not data.tokenizer='/"):
        build_corpus(other.data)
    with pytest.raises(DataError, match="no manifest.json"):
        build_corpus(load_config(None, [*files, "data.source=prepared", f"data.path={tmp_path}"]).data)


@pytest.mark.slow  # training runs
def test_a_corrupt_shard_stops_in_one_line_or_is_skipped(tmp_path, corpus_dir, capsys):
    """Flipped bytes in the prepared shards: training stops with one line naming the shard file and the
    record (exit status 2), or with data.on_corrupt=skip trains past them, reports each record once,
    counts them in TensorBoard, and a preempted run resumes to the uninterrupted run's result. Catches:
    the reader's bare RuntimeError mid-training, a skip that changes the iterator's order."""
    spec = importlib.util.spec_from_file_location("train_cli", ROOT / "train.py")
    train_cli = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(train_cli)
    inputs = Inputs.of(
        sorted((corpus_dir / "train").glob("*.txt")), sorted((corpus_dir / "val").glob("*.txt")), 0.0, "text"
    )
    prep.prepare(inputs, tmp_path / "p", **SMALL)
    for shard in sorted((tmp_path / "p").glob("train-*.arrayrecord")):  # every shard: some row reads one
        data = bytearray(shard.read_bytes())
        data[len(data) // 2 : len(data) // 2 + 8] = bytes(
            b ^ 0xFF for b in data[len(data) // 2 : len(data) // 2 + 8]
        )
        shard.write_bytes(bytes(data))
    prepared = ["data.source=prepared", f"data.path={tmp_path / 'p'}"]

    assert train_cli.main(tiny_overrides(corpus_dir, tmp_path / "stopped") + prepared) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith(f"data error: {tmp_path / 'p'}/train-") and ": record " in err, err
    assert "is corrupt" in err and "data.on_corrupt=skip" in err

    skip = [*prepared, "data.on_corrupt=skip"]
    full = run(load_config(None, tiny_overrides(corpus_dir, tmp_path / "full") + skip))
    err = capsys.readouterr().err
    reported = [line for line in err.splitlines() if line.startswith("data: ")]
    assert reported and len(reported) == len(set(reported)) and "Traceback" not in err
    # counted at the last logged step; grain's prefetch threads may meet a record or two after it
    assert 0 < read_scalars(tmp_path / "full")["skipped_records"][-1][1] <= len(reported)
    with pytest.raises(Preempted):
        run(load_config(None, tiny_overrides(corpus_dir, tmp_path / "cut") + skip), stop_at=3)
    resumed = run(load_config(None, tiny_overrides(corpus_dir, tmp_path / "cut") + skip))
    assert resumed["val_loss"] == full["val_loss"]


def test_a_declared_eos_separates_documents_and_must_match_the_prepared_corpus(tmp_path):
    """data.eos_ids (a converted model's own EOS) ends every document instead of the tokenizer's,
    is part of the request (another EOS is another corpus; none declared: the request as before),
    and a prepared corpus of another EOS is refused in one line. The CLI takes it as --eos-ids."""
    from effattn_jax.data.pipeline import corpus_manifest

    inputs = jsonl_corpus(tmp_path / "corpus", n_files=1, docs=6)
    small = SMALL | {"tokenizer": prep.tokenizer_info("gpt-neox-olmo", [5, 7])}
    m = prep.prepare(inputs, tmp_path / "declared", **small)
    docs = [list(d) for d in m.stream("train").documents()]
    assert docs and all(d[-1] == 5 for d in docs)
    assert m.data["tokenizer"]["eos_id"] == 5 and m.data["tokenizer"]["eos_ids"] == [5, 7]
    plain = prep.tokenizer_info("gpt-neox-olmo")
    assert "eos_id" not in prep.request_of(inputs, plain, 120) and "eos_ids" not in plain
    assert prep.request_of(inputs, small["tokenizer"], 120)["eos_id"] == 5
    cfg = load_config(None, ["data.source=prepared", f"data.path={tmp_path / 'declared'}"])
    with pytest.raises(DataError, match="prepared with end-of-text id 5, not 50279"):
        corpus_manifest(cfg.data)
    files = [str(p) for p in inputs.files]
    argv = ["--input", *files, "--out", str(tmp_path / "cli"), "--eos-ids", "5,7", "--workers", "0"]
    assert prep.main([*argv, "--shard-tokens", "120"]) == 0
    assert Manifest.load(tmp_path / "cli").data["tokenizer"]["eos_ids"] == [5, 7]
