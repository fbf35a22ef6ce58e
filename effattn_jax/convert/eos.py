"""A Hugging Face model's end-of-text ids, from its own files: what transformers stops
generation at, whatever the token is called (DeepSeek's is `<｜end▁of▁sentence｜>`)."""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer

from effattn_jax.convert.hf_config import ConvertError


def _json_object(path: Path) -> dict:
    try:
        value = json.loads(path.read_text())
    except ValueError as e:
        raise ConvertError(f"{path}: not JSON ({str(e)[:120]})") from None
    if not isinstance(value, dict):
        raise ConvertError(f"{path}: a JSON {type(value).__name__}, not an object")
    return value


def _ids(value, where: str) -> list[int]:
    ids = value if isinstance(value, list) else [value]
    if not ids or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise ConvertError(f"{where}: eos_token_id={value!r}: expected a token id or a list of them")
    return ids


def declared_eos_ids(model_dir: Path, tok: Tokenizer) -> list[int]:
    """The ids of the first that exists: generation_config.json's `eos_token_id`, config.json's
    `eos_token_id` (either may be a list: every id kept), tokenizer_config.json's `eos_token`
    (a string, or an added token's {"content": ...}). Every id must be in the tokenizer's
    vocabulary. [] when none declares one (a bare tokenizer: data/tokenizer.py's fallback)."""
    found: tuple[list[int], Path] | None = None
    for name in ("generation_config.json", "config.json"):
        path = model_dir / name
        if path.exists() and (value := _json_object(path).get("eos_token_id")) is not None:
            found = _ids(value, str(path)), path
            break
    if found is None and (path := model_dir / "tokenizer_config.json").exists():
        token = _json_object(path).get("eos_token")
        token = token.get("content") if isinstance(token, dict) else token
        if isinstance(token, str):
            if (eos := tok.token_to_id(token)) is None:
                raise ConvertError(f"{path}: eos_token {token!r} is not in tokenizer.json's vocabulary")
            found = [eos], path
    if found is None:
        return []
    ids, path = found
    if missing := [i for i in ids if tok.id_to_token(i) is None]:
        raise ConvertError(
            f"{path}: eos_token_id {missing[0]} is not in tokenizer.json's vocabulary "
            f"({tok.get_vocab_size(True)} tokens)"
        )
    return ids
