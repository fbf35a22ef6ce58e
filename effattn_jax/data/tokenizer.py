"""Tokenizer loading: built-in names or a tokenizers JSON file, and its EOS id."""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer

from effattn_jax import storage
from effattn_jax.data.corpus import DataError
from effattn_jax.data.fetch import cache_root, neox_tokenizer_path
from effattn_jax.data.small_bpe import SMALL_BPE, small_bpe_path

# name -> function returning the .json path
BUILTIN = {"gpt-neox-olmo": neox_tokenizer_path} | {n: (lambda n=n: small_bpe_path(n)) for n in SMALL_BPE}
EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>")


def load_tokenizer(name: str) -> tuple[Tokenizer, int, Path]:
    """(tokenizer, eos id, local file) for a built-in name or a tokenizers .json path (local, or
    gs:// as a converted run's is: fetched into the cache). The EOS id is read from the
    tokenizer's vocabulary (the first of EOS_CANDIDATES it has)."""
    if name in BUILTIN:
        path = BUILTIN[name]()
    else:
        source = storage.path(name)
        if not source.is_file():
            known = ", ".join(BUILTIN)
            raise DataError(f"data.tokenizer={name!r}: not a built-in ({known}) nor an existing file")
        path = storage.local_copy(source, cache_root() / "remote-tokenizers")
    try:
        tok = Tokenizer.from_file(str(path))
    except Exception as e:  # noqa: BLE001 - the tokenizers library raises a bare Exception
        raise DataError(f"data.tokenizer={name!r}: not a tokenizers JSON file ({str(e)[:120]})") from None
    for cand in EOS_CANDIDATES:
        if (eos := tok.token_to_id(cand)) is not None:
            return tok, eos, path
    raise DataError(f"{path}: no end-of-text token among {EOS_CANDIDATES}")
