"""Prepared corpora on disk: ArrayRecord shards of token ids with document boundaries, and a
manifest (`manifest.json`) that says what they hold. Written by `effattn_jax.data.prepare`,
read here by random access, so training never holds the corpus in memory.

A split (train or validation) is one token stream: every document's ids followed by EOS,
documents back to back, cut into records of `chunk_tokens` ids (the last record of each shard
may be shorter). A record is

    uint32 n | uint32 starts[n] | ids[...] (uint16 when the vocabulary fits, else uint32)

little-endian, where `starts` are the offsets inside the record at which a document begins.
Shards end at document ends, so a shard (and a resumed prepare) never splits a document.
"""

from __future__ import annotations

import hashlib
import io
import json
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from effattn_jax import storage
from effattn_jax.config import DataConfig
from effattn_jax.data.corpus import DataError
from effattn_jax.data.shard_files import shard_files

MANIFEST = "manifest.json"
FORMAT = 1
RECORD_OPTIONS = "group_size:1,uncompressed"  # one record per read: random access costs one seek
DEFAULT_CACHE_BYTES = int(DataConfig.shard_cache_gb * 2**30)


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype("<u2") if vocab_size <= 1 << 16 else np.dtype("<u4")


def encode_record(ids: np.ndarray, starts: list[int], dtype: np.dtype) -> bytes:
    head = np.asarray([len(starts), *starts], "<u4")
    return head.tobytes() + np.asarray(ids, dtype).tobytes()


def decode_record(record: bytes, dtype: np.dtype) -> tuple[np.ndarray, np.ndarray]:
    """(ids int32 [n], document starts int64 [k]) of one record."""
    n = int(np.frombuffer(record, "<u4", count=1)[0])
    starts = np.frombuffer(record, "<u4", count=n, offset=4).astype(np.int64)
    return np.frombuffer(record, dtype, offset=4 * (n + 1)).astype(np.int32), starts


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 22):
            h.update(block)
    return h.hexdigest()


class ShardWriter:
    """Appends documents to one split's stream; `close_shard()` (at a document end) finishes the
    current shard file and returns its manifest entry (None when it holds nothing)."""

    def __init__(self, out: Path, split: str, dtype: np.dtype, chunk_tokens: int, first_shard: int = 0):
        self.out, self.split, self.dtype, self.chunk = out, split, dtype, chunk_tokens
        self.index = first_shard
        self._writer = None
        self._ids: list[np.ndarray] = []
        self._buffered = 0
        self._starts: list[int] = []
        self.tokens = self.records = self.documents = 0

    @property
    def name(self) -> str:
        return f"{self.split}-{self.index:05d}.arrayrecord"

    def add(self, ids: np.ndarray) -> None:
        if self._writer is None:
            from array_record.python.array_record_module import ArrayRecordWriter

            self._writer = ArrayRecordWriter(str(self.out / (self.name + ".tmp")), RECORD_OPTIONS)
        self._starts.append(self._buffered)
        self._ids.append(ids)
        self._buffered += len(ids)
        self.tokens += len(ids)
        self.documents += 1
        if self._buffered >= self.chunk:
            self._flush(final=False)

    def _flush(self, final: bool) -> None:
        """Writes the full records buffered (and, when `final`, the short rest)."""
        flat = np.concatenate(self._ids)
        cut = len(flat) if final else len(flat) // self.chunk * self.chunk
        for a in range(0, cut, self.chunk):
            b = min(a + self.chunk, cut)
            self._writer.write(
                encode_record(flat[a:b], [s - a for s in self._starts if a <= s < b], self.dtype)
            )
            self.records += 1
        self._ids, self._buffered = [flat[cut:]], len(flat) - cut
        self._starts = [s - cut for s in self._starts if s >= cut]

    def close_shard(self) -> dict | None:
        if self._writer is None:
            return None
        if self._buffered:
            self._flush(final=True)
        self._writer.close()
        self._writer = None
        path = self.out / self.name
        (self.out / (self.name + ".tmp")).rename(path)
        entry = {
            "file": self.name,
            "tokens": self.tokens,
            "records": self.records,
            "documents": self.documents,
            "bytes": path.stat().st_size,
            "sha256": file_sha256(path),
        }
        self.index += 1
        self._ids, self._buffered, self._starts = [], 0, []
        self.tokens = self.records = self.documents = 0
        return entry

    def abandon(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None


@dataclass(frozen=True)
class Manifest:
    root: Path
    data: dict

    @classmethod
    def load(cls, root: str | Path) -> Manifest:
        root = storage.path(root)
        try:
            data = json.loads(storage.read_text(root / MANIFEST))
        except FileNotFoundError:
            raise DataError(  # noqa: B904 - the missing file is the whole story
                f"{root}: no {MANIFEST}; not a prepared corpus (python -m effattn_jax.data.prepare)"
            )
        except (OSError, json.JSONDecodeError) as e:
            raise DataError(f"{root / MANIFEST}: unreadable ({e})") from None
        if data.get("format") != FORMAT:
            raise DataError(f"{root}: prepared corpus format {data.get('format')}, this code reads {FORMAT}")
        return cls(root, data)

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(self.data["dtype"])

    def token_counts(self) -> np.ndarray:
        """[vocab] occurrences of each id in the training split."""
        return np.load(io.BytesIO(storage.read_bytes(self.root / self.data["train_token_counts"])))

    def stream(self, split: str, cache_bytes: int = DEFAULT_CACHE_BYTES) -> TokenStream:
        """`cache_bytes`: of a corpus on an object store, the most shard bytes kept locally."""
        shards = self.data[split]["shards"]
        return TokenStream(self.root, shards, self.dtype, self.data["chunk_tokens"], cache_bytes)

    def verify(self) -> None:
        """Checks every shard's checksum (reads the whole corpus)."""
        for split in ("train", "val"):
            for s in self.data[split]["shards"]:
                if storage.size_and_sha256(self.root / s["file"])[1] != s["sha256"]:
                    raise DataError(f"{self.root / s['file']}: checksum differs from the manifest; corrupt")


class CorruptRecord(DataError):
    """A record of a prepared shard that fails the reader's checksum; `where` names it."""

    def __init__(self, where: str, why: str):
        self.where = where
        fix = "prepare the corpus again, or set data.on_corrupt=skip to train past it"
        super().__init__(f"{where} is corrupt ({why}); {fix}")


class TokenStream:
    """Random access to one split's token stream; reads only the records a span covers (of a
    corpus on an object store, from a bounded local cache of its shards: shard_files.py)."""

    def __init__(
        self,
        root,
        shards: list[dict],
        dtype: np.dtype,
        chunk_tokens: int,
        cache_bytes: int = DEFAULT_CACHE_BYTES,
    ):
        self.dtype, self.chunk = dtype, chunk_tokens
        self.shard_start = np.cumsum([0] + [s["tokens"] for s in shards])
        self.record_start = np.cumsum([0] + [s["records"] for s in shards])
        self.tokens = int(self.shard_start[-1])
        self._files = shard_files(root, shards, self.record_start, cache_bytes)

    def span(self, start: int, length: int) -> tuple[np.ndarray, np.ndarray]:
        """(ids int32 [length], document starts bool [length]) of tokens start .. start + length."""
        ids, starts, pos, end = [], np.zeros(length, bool), start, start + length
        if start < 0 or end > self.tokens:
            raise IndexError(f"tokens {start}..{end} outside a stream of {self.tokens}")
        while pos < end:
            shard = int(np.searchsorted(self.shard_start, pos, side="right")) - 1
            local = pos - int(self.shard_start[shard])
            rec_ids, rec_starts = decode_record(self._record(shard, local // self.chunk), self.dtype)
            first = local % self.chunk
            take = rec_ids[first : first + end - pos]
            at = rec_starts[(rec_starts >= first) & (rec_starts < first + len(take))] - first + (pos - start)
            starts[at] = True
            ids.append(take)
            pos += len(take)
        return np.concatenate(ids), starts

    def _record(self, shard: int, record: int) -> bytes:
        try:
            return self._files.read(shard, record)
        except RuntimeError as e:  # the reader's own words: "Corrupted Riegeli/records file: ..."
            raise CorruptRecord(
                f"{self._files.paths[shard]}: record {record}", str(e).splitlines()[0][:120]
            ) from None

    def documents(self) -> list[np.ndarray]:
        """Every document's ids (int32, ending with EOS), in order; for the small validation split."""
        ids, starts = self.span(0, self.tokens) if self.tokens else (np.zeros(0, np.int32), np.zeros(0, bool))
        return np.split(ids, np.flatnonzero(starts)[1:])


class PackedRows:
    """Random-access source of packed training examples cut from a token stream: row i holds
    tokens i·L .. i·L + L (L + 1 tokens, so consecutive rows overlap by one), with segment ids
    numbering its documents from 1. A row over a corrupt record raises CorruptRecord, or with
    `on_corrupt="skip"` comes back with a zero loss mask (it trains nothing; the batch keeps its
    shape and the iterator its order), reported once per record and counted in `skipped`."""

    def __init__(self, stream: TokenStream, seq_len: int, on_corrupt: str = "stop"):
        self.stream, self.seq_len, self.on_corrupt = stream, seq_len, on_corrupt
        self.skipped: set[str] = set()  # the corrupt records met so far (grain's threads add to it)
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return max(self.stream.tokens - 1, 0) // self.seq_len

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        if not 0 <= i < len(self):
            raise IndexError(i)
        try:
            ids, starts = self.stream.span(i * self.seq_len, self.seq_len + 1)
        except CorruptRecord as e:
            if self.on_corrupt != "skip":
                raise
            return self._skipped(e.where)
        starts[0] = True
        return row_to_example(ids, np.cumsum(starts, dtype=np.int32))

    def _skipped(self, record: str) -> dict[str, np.ndarray]:
        with self._lock:
            first = record not in self.skipped
            self.skipped.add(record)
        if first:
            print(f"data: {record} is corrupt; its rows are skipped (data.on_corrupt=skip)", file=sys.stderr)
        example = row_to_example(np.zeros(self.seq_len + 1, np.int32), np.ones(self.seq_len + 1, np.int32))
        example["loss_mask"][:] = 0.0
        return example


def row_to_example(tokens: np.ndarray, segments: np.ndarray) -> dict[str, np.ndarray]:
    """One packed row -> model inputs, targets, segment ids and the loss mask (all [seq_len])."""
    return {
        "inputs": tokens[:-1],
        "targets": tokens[1:],
        "segment_ids": segments[:-1],
        "loss_mask": (segments[1:] == segments[:-1]).astype(np.float32),
    }
