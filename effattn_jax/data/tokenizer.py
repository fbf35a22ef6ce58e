"""Tokenizer loading and cached corpus tokenization (every document ends with EOS)."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from effattn_jax.data.corpus import DataError, Document
from effattn_jax.data.fetch import cache_root, neox_tokenizer_path
from effattn_jax.data.small_bpe import SMALL_BPE, small_bpe_path

# name -> function returning the .json path
BUILTIN = {"gpt-neox-olmo": neox_tokenizer_path} | {n: (lambda n=n: small_bpe_path(n)) for n in SMALL_BPE}
EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>")


def load_tokenizer(name: str) -> tuple[Tokenizer, int, Path]:
    """(tokenizer, eos id, file) for a built-in name or a tokenizers .json path. The EOS id is
    read from the tokenizer's vocabulary (the first of EOS_CANDIDATES it has)."""
    if name in BUILTIN:
        path = BUILTIN[name]()
    else:
        path = Path(name)
        if not path.is_file():
            known = ", ".join(BUILTIN)
            raise DataError(f"data.tokenizer={name!r}: not a built-in ({known}) nor an existing file")
    try:
        tok = Tokenizer.from_file(str(path))
    except Exception as e:  # noqa: BLE001 - the tokenizers library raises a bare Exception
        raise DataError(f"data.tokenizer={name!r}: not a tokenizers JSON file ({str(e)[:120]})") from None
    for cand in EOS_CANDIDATES:
        if (eos := tok.token_to_id(cand)) is not None:
            return tok, eos, path
    raise DataError(f"{path}: no end-of-text token among {EOS_CANDIDATES}")


def tokenize_documents(docs: list[Document], tokenizer_name: str) -> list[np.ndarray]:
    """int32 token arrays, one per document, each ending with EOS; cached on disk by content hash."""
    tok, eos, path = load_tokenizer(tokenizer_name)
    h = hashlib.sha256(path.read_bytes())
    for d in docs:
        h.update(d.doc_id.encode() + b"\0" + d.text.encode() + b"\0")
    cache = cache_root() / "tokens" / f"{h.hexdigest()[:32]}.npz"
    if cache.exists():
        with np.load(cache) as z:
            flat, lengths = z["flat"], z["lengths"]
    else:
        encoded = tok.encode_batch([d.text for d in docs], add_special_tokens=False)
        arrays = [np.asarray(e.ids + [eos], np.int32) for e in encoded]
        flat = np.concatenate(arrays) if arrays else np.zeros(0, np.int32)
        lengths = np.asarray([len(a) for a in arrays], np.int64)
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache.with_suffix(".tmp.npz")
        np.savez(tmp, flat=flat, lengths=lengths)
        tmp.rename(cache)
    return np.split(flat, np.cumsum(lengths)[:-1]) if len(lengths) else []
