import numpy as np
import pytest
from conftest import tiny_overrides

from effattn_jax.config import load_config
from effattn_jax.data.corpus import SOTU_VALIDATION, DataError, config_inputs, iter_documents
from effattn_jax.data.pipeline import build_corpus, train_iterator, unigram_loss, val_batches
from effattn_jax.data.shards import PackedRows, ShardWriter, TokenStream, row_to_example


def pack_documents(docs, seq_len):
    """The in-memory packing the streamed rows must equal: rows of seq_len + 1 tokens at stride
    seq_len from the concatenated documents, segment ids numbering each row's documents from 1."""
    stream = np.concatenate(docs)
    owner = np.repeat(np.arange(len(docs)), [len(d) for d in docs])
    rows = (len(stream) - 1) // seq_len
    idx = np.arange(rows)[:, None] * seq_len + np.arange(seq_len + 1)[None, :]
    starts = np.concatenate([np.ones((rows, 1), bool), owner[idx][:, 1:] != owner[idx][:, :-1]], axis=1)
    return stream[idx], np.cumsum(starts, axis=1)


def stream_of(tmp_path, docs, chunk=7, shard_tokens=30):
    """Token ids written as shards (records of `chunk` ids, a new shard after `shard_tokens`)."""
    w, shards = ShardWriter(tmp_path, "train", np.dtype("<u2"), chunk), []
    for d in docs:
        w.add(np.asarray(d))
        if w.tokens >= shard_tokens:
            shards.append(w.close_shard())
    shards.append(w.close_shard())
    return TokenStream(tmp_path, [s for s in shards if s], np.dtype("<u2"), chunk)


def test_streamed_rows_equal_the_in_memory_packing(tmp_path):
    docs = [np.arange(1, 6), np.arange(10, 13), np.arange(20, 51), np.arange(60, 61), np.arange(70, 95)]
    stream = stream_of(tmp_path, docs)
    assert [list(d) for d in stream.documents()] == [list(d) for d in docs]  # round trip
    for seq_len in (4, 7, 16):
        tokens, segments = pack_documents(docs, seq_len)
        rows = PackedRows(stream, seq_len)
        assert len(rows) == len(tokens)
        for i in range(len(rows)):
            want = row_to_example(tokens[i], segments[i])
            assert all((rows[i][k] == want[k]).all() for k in want), (seq_len, i)


def test_packing_never_crosses_documents(tmp_path):
    docs = [np.arange(1, 6), np.arange(10, 13), np.arange(20, 31)]  # 5 + 3 + 11 tokens
    rows = PackedRows(stream_of(tmp_path, docs, chunk=4, shard_tokens=6), seq_len=4)
    assert len(rows) == 4
    for i in range(len(rows)):
        ex = rows[i]
        assert ex["segment_ids"][0] == 1 and (np.diff(ex["segment_ids"]) >= 0).all()
        for inp, tgt, m in zip(ex["inputs"], ex["targets"], ex["loss_mask"], strict=True):
            same_doc = any(inp in d and tgt in d for d in docs)
            assert bool(m) == same_doc  # trained exactly on within-document targets


def test_pipeline_is_deterministic_and_resumable(tmp_path):
    rows = PackedRows(stream_of(tmp_path, [np.arange(i * 100, i * 100 + 57) for i in range(10)]), seq_len=8)
    a, b = train_iterator(rows, batch_size=4, seed=3), train_iterator(rows, batch_size=4, seed=3)
    first = [next(a)["inputs"] for _ in range(5)]
    assert all((x == next(b)["inputs"]).all() for x in first)
    state = a.get_state()
    later = [next(a)["inputs"] for _ in range(30)]  # past the end of the 71-row epoch
    c = train_iterator(rows, batch_size=4, seed=3)
    c.set_state(state)
    assert all((x == next(c)["inputs"]).all() for x in later)
    # two processes: disjoint halves of each global batch, together the whole epoch
    shares = [train_iterator(rows, batch_size=4, seed=3, process_index=p, process_count=2) for p in range(2)]
    seen = [tuple(r) for _ in range(len(rows) // 4) for it in shares for r in next(it)["inputs"]]
    assert len(seen) == len(set(seen)) == len(rows) // 4 * 4
    assert set(seen) <= {tuple(rows[i]["inputs"]) for i in range(len(rows))}
    tail = {tuple(r) for it in shares for r in next(it)["inputs"]}  # the 71st row, then epoch 2
    assert len(set(seen) | tail) == len(rows)


def test_val_batches_pad_with_masked_rows(tmp_path):
    rows = PackedRows(stream_of(tmp_path, [np.arange(50)]), seq_len=8)  # 6 rows
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
            list(iter_documents(tmp_path / name))
    cfg = load_config(None, ["data.source=files", f"data.train_files=[{tmp_path}/nothing*.txt]"])
    with pytest.raises(DataError, match="no files match"):
        config_inputs(cfg.data)
    (tmp_path / "one").mkdir()
    (tmp_path / "one" / "a.txt").write_text("a single document")
    cfg = load_config(None, ["data.source=files", f"data.train_files=[{tmp_path}/one/*.txt]"])
    with pytest.raises(DataError, match=r"(1 training and 0|0 training and 1) validation documents"):
        build_corpus(cfg.data)


def test_user_files_and_jsonl(tmp_path, corpus_dir):
    (tmp_path / "a.jsonl").write_text('{"text": "one two"}\n\n{"text": "three"}\n')
    assert [d.text for d in iter_documents(tmp_path / "a.jsonl")] == ["one two", "three"]
    cfg = load_config(None, tiny_overrides(corpus_dir, tmp_path / "run"))
    corpus = build_corpus(cfg.data)
    assert len(corpus.train) > 0 and len(corpus.val) > 0 and corpus.eos_id == 50279
    # every document ends with EOS: the stream has as many EOS as documents
    assert corpus.train_token_counts[50279] == 8


def test_builtin_corpus_split_is_fixed():
    inputs = config_inputs(load_config(None).data)
    assert sorted(p.stem for p in inputs.val_files) == sorted(SOTU_VALIDATION)
    assert len(inputs.files) == 249 and all(p in inputs.files for p in inputs.val_files)
