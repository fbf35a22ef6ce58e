"""A small byte-level BPE vocabulary trained on the built-in corpus's training speeches, for
CPU-scale sweeps: with GPT-NeoX's 50K rows the output head (and EG-MLA's [vocab, d_e] gate
tables) would dominate a small model's step. Trained once with `tokenizers`, cached as a
tokenizers JSON file; the validation speeches are never seen. Deterministic: the same corpus
gives the same file (a test checks it)."""

from __future__ import annotations

from pathlib import Path

from effattn_jax import storage
from effattn_jax.data.fetch import cache_root

SMALL_BPE = {"sotu-bpe-4k": 4096}  # built-in name -> vocabulary size (incl. <|endoftext|>)


def train_small_bpe(vocab_size: int, texts) -> str:
    """A byte-level BPE of `vocab_size` tokens trained on `texts`, as tokenizers JSON."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    return tok.to_str()


def small_bpe_path(name: str) -> Path:
    """The cached tokenizer file of a built-in small vocabulary, trained on first use."""
    path = cache_root() / "tokenizers" / f"{name}.json"
    if not path.exists():
        from effattn_jax.config import DataConfig
        from effattn_jax.data.corpus import config_inputs

        train = (
            d.text
            for _, _, d, held_out in config_inputs(DataConfig(source="sotu")).documents()
            if not held_out
        )
        path.parent.mkdir(parents=True, exist_ok=True)
        storage.write_atomic(path, train_small_bpe(SMALL_BPE[name], train))
    return path
