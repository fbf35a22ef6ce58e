"""Text generation with a preallocated KV cache, for every attention kind.

    python -m effattn_jax.generate --run runs/cpu_default --prompt "Fellow citizens" \
        [--prompt "..."] --max-new-tokens 40 [--temperature 0.8 --top-p 0.9] [--seed 0] [--naive]

Prompts of different lengths share one batch: they are right-padded and every
row keeps its own position, so a row's padding slots are never attended
(causal by position) and are overwritten as the row generates. One prefill
call per prompt length (through the training attention: MoBA's sub-quadratic op)
and one decode step (compiled once) per token. What is cached is each kind's own
(`init_cache`): K/V for MHA, the latent and RoPE key for MLA, plus token ids for
EG-MLA (once per model), plus MoBA's block means, so a MoBA step reads only its selected blocks.
MLA and EG-MLA (gate_at=latent) decode with absorbed weights unless --naive.

In a multi-process launch (as train.py's: JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES /
JAX_PROCESS_ID, or a cluster jax detects) every process generates the same text on its own
first device (same seed, same tokens) and process 0 prints it.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from effattn_jax.cli import ArgumentParser, non_negative_float, positive_int, probability
from effattn_jax.memory import fit_checked
from effattn_jax.model import Transformer, init_cache, ready_for_decoding
from effattn_jax.ops.cache import cache_length


def sample(logits: jax.Array, key, temperature: float = 0.0, top_p: float = 1.0) -> jax.Array:
    """logits [B, V] -> tokens [B]: greedy at temperature 0, else nucleus sampling."""
    if temperature <= 0.0:
        return jnp.argmax(logits, axis=-1)
    logits = logits / temperature
    order = jnp.argsort(-logits, axis=-1)
    probs = jax.nn.softmax(jnp.take_along_axis(logits, order, axis=-1), axis=-1)
    keep = jnp.cumsum(probs, axis=-1) - probs < top_p  # smallest prefix reaching top_p (never empty)
    choice = jax.random.categorical(key, jnp.where(keep, jnp.log(probs), -jnp.inf), axis=-1)
    return jnp.take_along_axis(order, choice[:, None], axis=-1)[:, 0]


class Generator:
    """Jitted prefill and decode step for one model; `generate` runs a batch of prompts."""

    def __init__(self, model: Transformer, *, absorb: bool = True, cache_dtype=jnp.float32):
        ready_for_decoding(model)  # layers unstacked, projected gates folded (the model is not trained)
        self.graphdef, self.params = nnx.split(model)
        self.model = model
        self.cache_dtype = cache_dtype

        def decode(params, tokens, positions, caches, prefill=False):
            model = nnx.merge(self.graphdef, params)
            return model.decode(tokens, positions, caches, absorb=absorb, prefill=prefill)

        self._decode = fit_checked(
            jax.jit(decode, donate_argnums=3, static_argnames="prefill"),
            "the decode step",
            "fewer or shorter prompts, or fewer --max-new-tokens",
            static_argnames=("prefill",),
        )

    def generate(
        self,
        prompts: list[list[int]],
        max_new_tokens: int,
        *,
        temperature: float = 0.0,
        top_p: float = 1.0,
        seed: int = 0,
        prompt_width: int = 0,
        stop: Callable[[np.ndarray], bool] | None = None,
        stop_every: int = 16,
    ) -> list[list[int]]:
        """`max_new_tokens` tokens per prompt, or fewer when `stop(tokens so far [B, t])`,
        asked every `stop_every` tokens, says every row is done. Prompts are right-padded to
        `prompt_width` if wider than the longest (fewer prefill shapes to compile)."""
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt needs at least one token")
        lens = np.array([len(p) for p in prompts])
        b, lp = len(prompts), max(int(lens.max()), prompt_width)
        tokens = np.zeros((b, lp), np.int32)
        for i, p in enumerate(prompts):
            tokens[i, : len(p)] = p
        length = cache_length(lp + max_new_tokens)
        caches = init_cache(self.model, b, length, self.cache_dtype)
        positions = np.broadcast_to(np.arange(lp, dtype=np.int32), (b, lp))
        logits, caches = self._decode(
            self.params, jnp.asarray(tokens), jnp.asarray(positions), caches, prefill=True
        )
        last = logits[jnp.arange(b), jnp.asarray(lens - 1)]
        key = jax.random.key(seed)
        out, pos = [], jnp.asarray(lens, jnp.int32)
        for step in range(max_new_tokens):
            key, sub = jax.random.split(key)
            nxt = sample(last, sub, temperature, top_p)
            out.append(nxt)
            if stop is not None and (step + 1) % stop_every == 0 and stop(np.stack(out, axis=1)):
                break
            if step + 1 < max_new_tokens:
                logits, caches = self._decode(self.params, nxt[:, None], pos[:, None], caches)
                last, pos = logits[:, 0], pos + 1
        return np.stack([np.asarray(t) for t in out], axis=1).tolist() if out else [[] for _ in prompts]


def load_run(run_dir: str) -> tuple[Transformer, object]:
    """The newest checkpoint's model (parameters only, on this process's first local device) and config."""
    from effattn_jax import checkpoint

    step = checkpoint.kept_steps(run_dir)[-1]
    cfg, graphdef, params = checkpoint.load_params(run_dir, step)
    return nnx.merge(graphdef, params), cfg


def main(argv=None) -> int:
    p = ArgumentParser(description=__doc__)
    p.add_argument("--run", required=True, help="run directory with checkpoints")
    p.add_argument("--prompt", action="append", required=True, help="repeat for a batch of prompts")
    p.add_argument("--max-new-tokens", type=positive_int, default=32)
    p.add_argument("--temperature", type=non_negative_float, default=0.0, help="0: greedy")
    p.add_argument("--top-p", type=probability, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--naive", action="store_true", help="MLA: rebuild per-head K/V instead of weight absorption"
    )
    args = p.parse_args(argv)
    from absl import logging as absl_logging

    from effattn_jax.checkpoint import CheckpointError
    from effattn_jax.config import ConfigError, DistributedConfig
    from effattn_jax.data.tokenizer import load_tokenizer, stop_ids
    from effattn_jax.launch import initialize

    absl_logging.set_verbosity(absl_logging.ERROR)  # Orbax's read-only notices: not the user's concern
    try:
        initialize(DistributedConfig())
        model, cfg = load_run(args.run)
    except (CheckpointError, ConfigError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    from effattn_jax.memory import DoesNotFit

    tok, eos, _ = load_tokenizer(cfg.data.tokenizer, cfg.data.eos_ids)
    stops = stop_ids(eos, cfg.data.eos_ids)
    prompts = [tok.encode(t, add_special_tokens=False).ids for t in args.prompt]
    longest = max(len(ids) for ids in prompts)
    if longest == 0:
        p.error("--prompt: an empty prompt has no token to continue from")
    if longest + args.max_new_tokens > cfg.data.seq_len:
        p.error(
            f"--max-new-tokens={args.max_new_tokens}: the longest prompt ({longest} tokens) plus the new "
            f"tokens must fit the model's context of {cfg.data.seq_len} tokens (its data.seq_len)"
        )
    try:
        outs = Generator(model, absorb=not args.naive).generate(
            prompts, args.max_new_tokens, temperature=args.temperature, top_p=args.top_p, seed=args.seed
        )
    except DoesNotFit as e:
        print(f"memory error: {e}", file=sys.stderr)
        return 2
    if jax.process_index() == 0:
        for text, ids in zip(args.prompt, outs, strict=True):
            end = next((i for i, t in enumerate(ids) if t in stops), len(ids))  # up to its end of text
            print(f"{text}{tok.decode(ids[:end])}")
            print("---")
    return 0


if __name__ == "__main__":
    sys.exit(main())
