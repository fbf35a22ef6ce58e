"""Grain input pipeline: a prepared corpus (token shards on disk, effattn_jax/data/shards.py)
-> packed rows with segment ids, read by index -> global shuffle -> shard across processes ->
batch, a few batches read ahead by threads. The corpus is never loaded whole. The training
iterator's state is checkpointed with the run (Orbax + grain.checkpoint).

A packed row holds `seq_len + 1` tokens cut from the concatenated stream of
documents (stride `seq_len`, so consecutive rows overlap by one token).
Segment ids number the documents inside a row from 1; a target is trained
only when it belongs to the same document as its input (`loss_mask`), so no
target ever crosses into the next document.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

import grain
import numpy as np

from effattn_jax.data.corpus import DataError, config_inputs
from effattn_jax.data.fetch import cache_root
from effattn_jax.data.prepare import DEFAULT_SHARD_TOKENS, prepare, request_of, tokenizer_info
from effattn_jax.data.shards import Manifest, PackedRows

READ_THREADS = 4  # grain threads reading batches ahead of the train step


def corpus_manifest(data_cfg) -> Manifest:
    """The prepared corpus of `data_cfg`: `data.path` for source=prepared; the built-in corpus and
    user files are prepared once into the cache (keyed by the request and the files' mtimes).
    Fails in one line when it was prepared with another tokenizer than `data.tokenizer`."""
    info = tokenizer_info(data_cfg.tokenizer, data_cfg.eos_ids)
    if data_cfg.source == "prepared":
        manifest = Manifest.load(data_cfg.path)
        theirs = manifest.data["tokenizer"]
        if theirs["sha256"] != info["sha256"]:
            raise DataError(
                f"data.path={data_cfg.path}: prepared with tokenizer {theirs['name']!r}, not "
                f"data.tokenizer={data_cfg.tokenizer!r} (their files differ); set data.tokenizer to match"
            )
        if theirs["eos_id"] != info["eos_id"]:
            raise DataError(
                f"data.path={data_cfg.path}: prepared with end-of-text id {theirs['eos_id']}, not "
                f"{info['eos_id']} (data.eos_ids={data_cfg.eos_ids}); prepare it with --eos-ids to match"
            )
        return manifest
    inputs = config_inputs(data_cfg)
    key = json.dumps(
        [request_of(inputs, info, DEFAULT_SHARD_TOKENS), [p.stat().st_mtime_ns for p in inputs.files]]
    )
    return prepare(
        inputs,
        cache_root() / "prepared" / hashlib.sha256(key.encode()).hexdigest()[:24],
        tokenizer=info,
    )


def cache_bytes(data_cfg) -> int:
    return int(data_cfg.shard_cache_gb * 2**30)


@dataclass
class Corpus:
    """Packed train and validation rows, streamed from a prepared corpus, plus what the unigram
    baseline needs."""

    train: PackedRows
    val: PackedRows
    train_token_counts: np.ndarray  # [tokenizer vocab] occurrences in the training documents
    eos_id: int

    @property
    def vocab_size(self) -> int:
        return len(self.train_token_counts)


def build_corpus(data_cfg) -> Corpus:
    manifest = corpus_manifest(data_cfg)
    docs = {split: manifest.data[split]["documents"] for split in ("train", "val")}
    if not all(docs.values()):
        raise DataError(
            f"the corpus splits into {docs['train']} training and {docs['val']} validation documents; "
            "set data.val_files (prepare: --val-input), change data.val_fraction or add documents"
        )
    train, val = (
        PackedRows(
            manifest.stream(split, cache_bytes(data_cfg)), data_cfg.seq_len, on_corrupt=data_cfg.on_corrupt
        )
        for split in ("train", "val")
    )
    if len(train) == 0 or len(val) == 0:
        raise DataError(
            f"data.seq_len={data_cfg.seq_len}: the corpus gives {len(train)} training and {len(val)} "
            "validation rows; use shorter sequences or more data (or more validation documents)"
        )
    if len(train) < data_cfg.batch_size:
        raise DataError(
            f"data.batch_size={data_cfg.batch_size}: the corpus gives only {len(train)} training rows of "
            f"data.seq_len={data_cfg.seq_len} tokens, fewer than one batch; use a smaller batch or more data"
        )
    return Corpus(train, val, manifest.token_counts(), manifest.data["tokenizer"]["eos_id"])


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
    # a few batches ahead, not grain's default 500 (gigabytes at paper batch sizes)
    return iter(
        ds.to_iter_dataset(grain.ReadOptions(num_threads=READ_THREADS, prefetch_buffer_size=2 * READ_THREADS))
    )


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
