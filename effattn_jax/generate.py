"""Text generation with a preallocated KV cache, for every attention kind.

    python -m effattn_jax.generate --run runs/cpu_default --prompt "Fellow citizens" \
        [--prompt "..."] --max-new-tokens 40 [--temperature 0.8 --top-p 0.9] [--seed 0] [--naive]

Prompts of different lengths share one batch: they are right-padded and every
row keeps its own position, so a row's padding slots are never attended
(causal by position) and are overwritten as the row generates. One prefill
call per prompt length (through the training attention: MoBA's sub-quadratic op)
and one decode step (compiled once: the model's step and the sampling, over a donated cache)
per token, with no transfer to or from the host between the prompt and the last token.
What is cached is each kind's own
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
    """Jitted prefill and decode step for one model; `generate` runs a batch of prompts.

    Each new token costs one compiled program (`step`: the model's step, then sampling, with the
    key split and the position advanced inside it) over a donated cache, and no host round-trip:
    the tokens stay on the device until the end (or until `stop` asks for them)."""

    def __init__(self, model: Transformer, *, absorb: bool = True, cache_dtype=jnp.float32):
        ready_for_decoding(model)  # layers unstacked, projected gates folded (the model is not trained)
        self.graphdef, self.params = nnx.split(model)
        self.model = model
        self.cache_dtype = cache_dtype

        def decode(params, tokens, positions, caches, prefill=False):
            model = nnx.merge(self.graphdef, params)
            return model.decode(tokens, positions, caches, absorb=absorb, prefill=prefill)

        def prefill(params, tokens, positions, caches, last, key, temperature, top_p):
            """The prompts [B, P] into the cache, and the first new token [B] sampled at `last` [B]
            (logits at those positions only: [B, P, vocab] would not fit at long prompts)."""
            model = nnx.merge(self.graphdef, params)
            x, caches = model.decode_hidden(tokens, positions, caches, absorb=absorb, prefill=True)
            key, sub = jax.random.split(key)
            logits = model.logits(x[jnp.arange(tokens.shape[0]), last])  # [B, vocab]
            return sample(logits, sub, temperature, top_p), caches, key

        def step(params, tokens, positions, caches, key, temperature, top_p):
            """tokens [B] at positions [B] into the cache -> (the next tokens, positions + 1, cache, key)."""
            logits, caches = decode(params, tokens[:, None], positions[:, None], caches)
            key, sub = jax.random.split(key)
            return sample(logits[:, 0], sub, temperature, top_p), positions + 1, caches, key

        sampling = ("temperature", "top_p")
        self._inits = {}
        self._prefill = fit_checked(
            jax.jit(prefill, donate_argnums=3, static_argnames=sampling),
            "the prefill",
            "fewer or shorter prompts, or fewer --max-new-tokens",
            static_argnames=sampling,
        )
        self._step = jax.jit(step, donate_argnums=3, static_argnames=sampling)
        # the memory check of the first step of each shape; later steps call _step directly
        self._checked_step = fit_checked(
            self._step,
            "the decode step",
            "fewer or shorter prompts, or fewer --max-new-tokens",
            static_argnames=sampling,
        )

    def empty_caches(self, batch: int, length: int) -> list[dict]:
        """An empty cache for `batch` rows of `length` slots (`generate` makes one of
        `cache_length(prompt + new tokens)`): init_cache's zeros made on the device (one compiled
        program per shape, kept)."""
        if (batch, length) not in self._inits:
            self._inits[batch, length] = jax.jit(self._cache_maker(batch, length))
        return self._inits[batch, length]()

    def compiled_step(self, batch: int, length: int, *, temperature: float = 0.0, top_p: float = 1.0):
        """The decode step `generate` runs for each new token (the model's step, then sampling),
        compiled for `batch` rows over a cache of `length` slots, without running it: what it
        launches (`as_text()`, `cost_analysis()`). Called as (params, tokens [B], positions [B],
        caches, key) it returns (next tokens, positions + 1, caches, key), the caches donated."""
        tokens = jax.ShapeDtypeStruct((batch,), jnp.int32)
        caches = jax.eval_shape(self._cache_maker(batch, length))
        sampling = dict(temperature=float(temperature), top_p=float(top_p))
        return self._step.lower(self.params, tokens, tokens, caches, jax.random.key(0), **sampling).compile()

    def _cache_maker(self, batch: int, length: int) -> Callable[[], list[dict]]:
        return lambda: init_cache(self.model, batch, length, self.cache_dtype)

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
        if max_new_tokens <= 0:
            return [[] for _ in prompts]
        lens = np.array([len(p) for p in prompts], np.int32)
        b, lp = len(prompts), max(int(lens.max()), prompt_width)
        tokens = np.zeros((b, lp), np.int32)
        for i, p in enumerate(prompts):
            tokens[i, : len(p)] = p
        length = cache_length(lp + max_new_tokens)
        caches = self.empty_caches(b, length)
        positions = np.broadcast_to(np.arange(lp, dtype=np.int32), (b, lp))
        sampling = dict(temperature=float(temperature), top_p=float(top_p))
        tokens, positions, last, pos, seed = jax.device_put(
            (tokens, positions, lens - 1, lens, np.uint32(seed))
        )
        nxt, caches, key = self._prefill(
            self.params, tokens, positions, caches, last, jax.random.key(seed), **sampling
        )
        out, step = [nxt], self._checked_step
        for made in range(1, max_new_tokens):
            if stop is not None and made % stop_every == 0 and stop(jax.device_get(jnp.stack(out, axis=1))):
                break
            nxt, pos, caches, key = step(self.params, nxt, pos, caches, key, **sampling)
            out.append(nxt)
            step = self._step
        return jax.device_get(jnp.stack(out, axis=1)).tolist()  # the one transfer back


def load_run(run_dir: str) -> tuple[Transformer, object]:
    """The newest checkpoint's model (parameters only, on this process's first local device) and config."""
    from effattn_jax import checkpoint

    step = checkpoint.kept_steps(run_dir)[-1]
    cfg, graphdef, params = checkpoint.load_params(run_dir, step)
    return nnx.merge(graphdef, params), cfg


def main(argv=None) -> int:
    p = ArgumentParser(prog="python -m effattn_jax.generate", description=__doc__)
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
