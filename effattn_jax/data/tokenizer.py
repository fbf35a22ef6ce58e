"""Tokenizer loading: built-in names or a tokenizers JSON file, and its EOS id."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from tokenizers import Tokenizer

from effattn_jax import storage
from effattn_jax.data.corpus import DataError
from effattn_jax.data.fetch import cache_root, neox_tokenizer_path
from effattn_jax.data.small_bpe import SMALL_BPE, small_bpe_path

# name -> function returning the .json path
BUILTIN = {"gpt-neox-olmo": neox_tokenizer_path} | {n: (lambda n=n: small_bpe_path(n)) for n in SMALL_BPE}
EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>")


def load_tokenizer(name: str, eos_ids: Sequence[int] = ()) -> tuple[Tokenizer, int, Path]:
    """(tokenizer, eos id, local file) for a built-in name or a tokenizers .json path (local, or
    gs:// as a converted run's is: fetched into the cache). The EOS id: the first of `eos_ids`
    (`data.eos_ids`, a converted model's own, each checked to be in the vocabulary), else the
    first of EOS_CANDIDATES the vocabulary has (a bare tokenizer file)."""
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
    if eos_ids:
        if missing := [i for i in eos_ids if tok.id_to_token(i) is None]:
            raise DataError(
                f"data.eos_ids={list(eos_ids)}: id {missing[0]} is not in the vocabulary of {path} "
                f"({tok.get_vocab_size(True)} tokens)"
            )
        return tok, eos_ids[0], path
    for cand in EOS_CANDIDATES:
        if (eos := tok.token_to_id(cand)) is not None:
            return tok, eos, path
    raise DataError(f"{path}: no end-of-text token among {EOS_CANDIDATES}; set data.eos_ids")


def stop_ids(eos: int, eos_ids: Sequence[int] = ()) -> frozenset[int]:
    """The ids generation stops at: every one of `data.eos_ids` (a model may declare several),
    else the tokenizer's EOS."""
    return frozenset(eos_ids) or frozenset((eos,))
