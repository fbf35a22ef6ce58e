"""Grain input pipeline: tokenized documents -> packed rows with segment ids ->
shuffle -> shard across processes -> batch. The training iterator's state
is checkpointed with the run (Orbax + grain.checkpoint).

A packed row holds `seq_len + 1` tokens cut from the concatenated stream of
documents (stride `seq_len`, so consecutive rows overlap by one token).
Segment ids number the documents inside a row from 1; a target is trained
only when it belongs to the same document as its input (`loss_mask`), so no
target ever crosses into the next document.
"""

from __future__ import annotations

from dataclasses import dataclass

import grain
import numpy as np

from effattn_jax.data.corpus import DataError, load_splits
from effattn_jax.data.tokenizer import load_tokenizer, tokenize_documents


def pack_documents(docs: list[np.ndarray], seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    """Returns (tokens, segments), both int32 [rows, seq_len + 1]; the tail shorter than a row is dropped."""
    if not docs:
        return np.zeros((0, seq_len + 1), np.int32), np.zeros((0, seq_len + 1), np.int32)
    stream = np.concatenate(docs).astype(np.int32)
    doc_index = np.repeat(np.arange(len(docs), dtype=np.int64), [len(d) for d in docs])
    rows = (len(stream) - 1) // seq_len
    idx = np.arange(rows)[:, None] * seq_len + np.arange(seq_len + 1)[None, :]
    tokens, owner = stream[idx], doc_index[idx]
    starts = np.concatenate([np.ones((rows, 1), bool), owner[:, 1:] != owner[:, :-1]], axis=1)
    segments = np.cumsum(starts, axis=1).astype(np.int32)  # 1, 1, ..., 2, 2, ... per row
    return tokens, segments


def row_to_example(tokens: np.ndarray, segments: np.ndarray) -> dict[str, np.ndarray]:
    """One packed row -> model inputs, targets, segment ids and the loss mask (all [seq_len])."""
    return {
        "inputs": tokens[:-1],
        "targets": tokens[1:],
        "segment_ids": segments[:-1],
        "loss_mask": (segments[1:] == segments[:-1]).astype(np.float32),
    }


class PackedRows:
    """Random-access source of packed examples for grain."""

    def __init__(self, tokens: np.ndarray, segments: np.ndarray):
        self.tokens, self.segments = tokens, segments

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        return row_to_example(self.tokens[i], self.segments[i])


@dataclass
class Corpus:
    """Tokenized, packed train and validation rows plus what the unigram baseline needs."""

    train: PackedRows
    val: PackedRows
    train_token_counts: np.ndarray  # [tokenizer vocab] occurrences in the training documents
    eos_id: int

    @property
    def vocab_size(self) -> int:
        return len(self.train_token_counts)


def build_corpus(data_cfg) -> Corpus:
    train_docs, val_docs = load_splits(data_cfg)
    tok, eos, _ = load_tokenizer(data_cfg.tokenizer)
    train_ids = tokenize_documents(train_docs, data_cfg.tokenizer)
    val_ids = tokenize_documents(val_docs, data_cfg.tokenizer)
    counts = np.bincount(np.concatenate(train_ids), minlength=tok.get_vocab_size(with_added_tokens=True))
    train, val = (
        PackedRows(*pack_documents(train_ids, data_cfg.seq_len)),
        PackedRows(*pack_documents(val_ids, data_cfg.seq_len)),
    )
    if len(train) == 0 or len(val) == 0:
        raise DataError(
            f"data.seq_len={data_cfg.seq_len}: the corpus gives {len(train)} training and {len(val)} "
            "validation rows; use shorter sequences or more data"
        )
    if len(train) < data_cfg.batch_size:
        raise DataError(
            f"data.batch_size={data_cfg.batch_size}: the corpus gives only {len(train)} training rows of "
            f"data.seq_len={data_cfg.seq_len} tokens, fewer than one batch; use a smaller batch or more data"
        )
    return Corpus(train, val, counts, eos)


def train_iterator(
    rows: PackedRows, *, batch_size: int, seed: int, process_index: int = 0, process_count: int = 1
):
    """Endless shuffled batches of this process's shard; a grain DatasetIterator (get_state/set_state)."""
    if batch_size % process_count:
        raise DataError(f"data.batch_size={batch_size} is not divisible by the {process_count} processes")
    ds = (
        grain.MapDataset.source(rows)
        .shuffle(seed=seed)
        .repeat(None)[process_index::process_count]
        .batch(batch_size // process_count, drop_remainder=True)
    )
    return iter(ds)


def val_batches(
    rows: PackedRows, *, batch_size: int, max_batches: int, process_index: int = 0, process_count: int = 1
):
    """The first `max_batches` validation batches in fixed order; a short last batch is padded
    with rows whose loss_mask is zero so every batch has the same shape."""
    n = min(len(rows), batch_size * max_batches)
    batches = -(-n // batch_size)
    local = batch_size // process_count
    for b in range(batches):
        ids = [b * batch_size + process_index * local + j for j in range(local)]
        examples = [rows[i] if i < n else {k: np.zeros_like(v) for k, v in rows[0].items()} for i in ids]
        yield {k: np.stack([e[k] for e in examples]) for k in examples[0]}


def unigram_loss(counts: np.ndarray, batches) -> float:
    """Mean negative log-likelihood (nats/token) of a add-one-smoothed unigram model on the masked targets."""
    logp = np.log(counts + 1.0) - np.log(counts.sum() + len(counts))
    total, n = 0.0, 0.0
    for b in batches:
        total -= float((logp[b["targets"]] * b["loss_mask"]).sum())
        n += float(b["loss_mask"].sum())
    return total / n
