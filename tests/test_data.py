import numpy as np
import pytest
from conftest import tiny_overrides

from effattn_jax.config import load_config
from effattn_jax.data.corpus import SOTU_VALIDATION, DataError, load_splits, read_file
from effattn_jax.data.pipeline import (
    PackedRows,
    build_corpus,
    pack_documents,
    row_to_example,
    train_iterator,
    unigram_loss,
    val_batches,
)


def test_packing_never_crosses_documents():
    docs = [np.arange(1, 6), np.arange(10, 13), np.arange(20, 31)]  # 5 + 3 + 11 tokens
    tokens, segs = pack_documents(docs, seq_len=4)
    stream = np.concatenate(docs)
    assert tokens.shape == (4, 5) and (tokens[:, 0] == stream[0:16:4]).all()
    assert set(range(20, 29)) <= set(tokens.ravel())  # an 11-token document split over rows, not dropped
    for t, s in zip(tokens, segs, strict=True):
        ex = row_to_example(t, s)
        assert ex["segment_ids"][0] == 1 and (np.diff(ex["segment_ids"]) >= 0).all()
        for inp, tgt, m in zip(ex["inputs"], ex["targets"], ex["loss_mask"], strict=True):
            same_doc = any(inp in d and tgt in d for d in docs)
            assert bool(m) == same_doc  # trained exactly on within-document targets


def test_pipeline_is_deterministic_and_resumable():
    rows = PackedRows(*pack_documents([np.arange(i * 100, i * 100 + 57) for i in range(10)], seq_len=8))
    a, b = train_iterator(rows, batch_size=4, seed=3), train_iterator(rows, batch_size=4, seed=3)
    first = [next(a)["inputs"] for _ in range(5)]
    assert all((x == next(b)["inputs"]).all() for x in first)
    state = a.get_state()
    later = [next(a)["inputs"] for _ in range(3)]
    c = train_iterator(rows, batch_size=4, seed=3)
    c.set_state(state)
    assert all((x == next(c)["inputs"]).all() for x in later)
    # two processes see disjoint halves of each global batch
    p0 = next(train_iterator(rows, batch_size=4, seed=3, process_index=0, process_count=2))["inputs"]
    p1 = next(train_iterator(rows, batch_size=4, seed=3, process_index=1, process_count=2))["inputs"]
    assert p0.shape == (2, 8) and not set(map(tuple, p0)) & set(map(tuple, p1))


def test_val_batches_pad_with_masked_rows():
    rows = PackedRows(*pack_documents([np.arange(50)], seq_len=8))  # 6 rows
    batches = list(val_batches(rows, batch_size=4, max_batches=10))
    assert len(batches) == 2 and batches[1]["loss_mask"][2:].sum() == 0
    counts = np.bincount(np.arange(50), minlength=64)
    assert unigram_loss(counts, batches) == pytest.approx(np.log(50 + 64) - np.log(2))


def test_bad_files_are_named(tmp_path):
    (tmp_path / "empty.txt").write_text("  \n")
    (tmp_path / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    (tmp_path / "bad.jsonl").write_text('{"text": "ok"}\n{"body": "no text"}\n')
    for name, needle in (("empty.txt", "empty"), ("latin1.txt", "UTF-8"), ("bad.jsonl", "bad.jsonl:2")):
        with pytest.raises(DataError, match=needle):
            read_file(tmp_path / name)
    cfg = load_config(None, ["data.source=files", f"data.train_files=[{tmp_path}/nothing*.txt]"])
    with pytest.raises(DataError, match="no files match"):
        load_splits(cfg.data)


def test_user_files_and_jsonl(tmp_path, corpus_dir):
    (tmp_path / "a.jsonl").write_text('{"text": "one two"}\n\n{"text": "three"}\n')
    assert [d.text for d in read_file(tmp_path / "a.jsonl")] == ["one two", "three"]
    cfg = load_config(None, tiny_overrides(corpus_dir, tmp_path / "run"))
    corpus = build_corpus(cfg.data)
    assert len(corpus.train) > 0 and len(corpus.val) > 0 and corpus.eos_id == 50279
    # every document ends with EOS: the stream has as many EOS as documents
    assert corpus.train_token_counts[50279] == 8


def test_builtin_corpus_split_is_fixed():
    train, val = load_splits(load_config(None).data)
    assert [d.doc_id for d in val] == sorted(SOTU_VALIDATION)
    assert len(train) + len(val) == 249 and not {d.doc_id for d in train} & set(SOTU_VALIDATION)
