"""Hugging Face checkpoints into runs of this project, and back.

    python -m effattn_jax.convert from-hf --model DIR --out RUN_DIR [key=value ...]
    python -m effattn_jax.convert to-hf --run RUN_DIR [--step N] --out DIR

`from-hf` reads a Hugging Face model directory (`config.json`, `*.safetensors` with or without
an index, `tokenizer.json`) and writes a run directory whose step-0 checkpoint (parameters only)
train.py, `python -m eval` and `effattn_jax.generate` use like any other, and that
`train.init_from=RUN_DIR` starts new runs from. The config comes from `config.json` (`key=value`
overrides after it); the tokenizer is copied into the run and recorded as `data.tokenizer`.
Weights are read tensor by tensor into their shardings. Families (hf_config.py): Llama (with
Llama 3's RoPE scaling), Mistral (no sliding window), Qwen2 (q/k/v biases), Qwen3 (q/k norms)
and DeepSeek-V2/V3 attention (MLA with YaRN; layers with a dense MLP only). Anything else is
refused in one line, exit 2, nothing written. The end-of-text ids are the model's own
(generation_config.json, config.json or tokenizer_config.json: convert/eos.py), recorded as
`data.eos_ids`. With `model.scan_layers=true` the run's layers are stacked, filled a layer at a
time.

`to-hf` writes a run's step back out: MHA/GQA models as Llama, Qwen2 or Qwen3 by their
architecture (or as the family they came from), MLA models as DeepSeek-V2, MoBA models as their
dense architecture (the weights are the same) with a note; EG-MLA has no Hugging Face
equivalent and is refused. A run of stacked layers is sliced one layer's tensor at a time.
"""

from effattn_jax.convert.cli import main
from effattn_jax.convert.hf_config import ConvertError
from effattn_jax.convert.runs import check_tokenizer, from_hf, to_hf

__all__ = ["ConvertError", "check_tokenizer", "from_hf", "main", "to_hf"]
