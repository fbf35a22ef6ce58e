"""This project's models in lm-evaluation-harness: `--model effattn --model_args run=DIR[,step=N|latest]
[,mesh=DxFxT[xC]][,batch_size=N|auto]` (batch_size there wins over the harness's --batch_size).

The harness finds the model by the `lm_eval.models` entry point (harness releases with plugin
discovery), or by importing this module, which registers it (`python -m eval.harness` does, for
lm-eval 0.4.13, the newest on PyPI, which has no plugin discovery).

The three request kinds run through the suite's own code, so the harness and `python -m eval`
score alike:
- `loglikelihood`: (context, continuation) strings tokenized and scored as `eval downstream`
  scores them (eval/scoring.py: batched, each context run once for all its continuations).
- `loglikelihood_rolling`: the harness's rolling windows of the model's context (`data.seq_len`),
  EOS standing before the first token (the tokenizer has no BOS), each window scored as a
  (context, continuation) request.
- `generate_until`: `effattn_jax.generate.Generator`, greedy unless the task asks to sample, up to
  `max_gen_toks` tokens, cut at the first stop sequence or EOS; the prompt keeps its last
  `data.seq_len - max_gen_toks` tokens, as the harness's own models do.

Multi-process (effattn_jax.launch): the harness runs whole in every process and sees one rank;
the scoring and generation are split over processes as the suite splits its work
(eval/processes.py), so every process returns every result and the harness's figures agree.
`python -m eval.harness` keeps processes other than 0 quiet and writing nothing.
"""

from __future__ import annotations

import re
import sys

import jax
import numpy as np
from lm_eval.api.model import LM
from lm_eval.api.registry import register_model
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from eval.processes import persistent_compilation_cache, platform_line, share, total, writes

DEFAULT_GENERATE_BATCH = 16  # prompts generated together for batch_size=auto
DEFAULT_MAX_GEN_TOKS = 256  # the harness's default for a task that does not say
STOP_CHECK_EVERY = 16  # decode steps between checks whether every row has reached a stop


def _parse_mesh(spec: str | None):
    """`mesh=DxFxT[xC]` (the harness splits model_args at commas) -> this process's mesh."""
    from eval.lm_loss import parse_mesh

    if spec is not None and not re.fullmatch(r"[1-9]\d*(x[1-9]\d*){2,3}", str(spec)):
        raise ValueError(
            f"--model_args mesh={spec}: expected DxFxT[xC] sizes (data, fsdp, tensor, context), "
            "e.g. 1x1x1 or 1x1x1x4"
        )
    return parse_mesh(str(spec or "1x1x1").replace("x", ","))


def _batch_size(value) -> int:
    if value is None or str(value).startswith("auto"):  # also "auto:N", the harness's re-detection
        return DEFAULT_GENERATE_BATCH
    size = int(value) if str(value).isdigit() else 0
    if size < 1:
        shown = int(value) if isinstance(value, float) and value.is_integer() else value  # the harness's -1.0
        raise ValueError(f"batch_size={shown!r}: must be a positive number of prompts, or auto")
    return size


@register_model("effattn")
class EffattnLM(LM):
    """A kept checkpoint of a run, on this process's devices (`mesh`, default one device)."""

    def __init__(
        self,
        run: str | None = None,
        step: int | str = "latest",
        mesh: str | None = None,
        batch_size: int | str | None = None,
        max_batch_size: int | None = None,
        device: str | None = None,
        **unknown,
    ) -> None:
        super().__init__()
        if unknown or run is None:
            what = f"unknown key {sorted(unknown)}" if unknown else "run=RUN_DIR is required"
            raise ValueError(
                f"--model_args for effattn: {what}; allowed: run, step (N or latest), mesh (DxFxT[xC]), "
                "batch_size (N or auto)"
            )
        from absl import logging as absl_logging
        from flax import nnx

        from effattn_jax import checkpoint
        from effattn_jax.config import DistributedConfig
        from effattn_jax.data.tokenizer import load_tokenizer, stop_ids
        from effattn_jax.launch import initialize

        if not jax.distributed.is_initialized():
            initialize(DistributedConfig())
        absl_logging.set_verbosity(absl_logging.ERROR)  # Orbax's read-only notices
        persistent_compilation_cache()  # as `python -m eval`: a rerun compiles nothing
        if writes():
            print(platform_line(), flush=True)
        del max_batch_size, device  # the harness passes them to every model; jax places by mesh
        self.run = str(run)
        (self.step,) = checkpoint.select_steps(self.run, step, option="--model_args step", allow_all=False)
        cfg, graphdef, params = checkpoint.load_params(self.run, self.step, _parse_mesh(mesh))
        self.model = nnx.merge(graphdef, params)
        self.tokenizer, self.eos, _ = load_tokenizer(cfg.data.tokenizer, cfg.data.eos_ids)
        self.stop_ids = stop_ids(self.eos, cfg.data.eos_ids)  # a model may declare several
        self.max_length = cfg.data.seq_len
        self.generate_batch = _batch_size(batch_size)
        self._generator = None

    @classmethod
    def create_from_arg_string(cls, arg_string: str, additional_config: dict | None = None):
        """As the harness's, except that a key given in --model_args (batch_size=N) wins over the
        harness's own (--batch_size), instead of being passed twice."""
        from lm_eval.utils import simple_parse_args_string

        return cls.create_from_arg_obj(simple_parse_args_string(arg_string), additional_config)

    @classmethod
    def create_from_arg_obj(cls, arg_dict: dict, additional_config: dict | None = None):
        extra = {k: v for k, v in (additional_config or {}).items() if v is not None and k not in arg_dict}
        return cls(**arg_dict, **extra)

    # -- the three request kinds ------------------------------------------------------------

    def loglikelihood(self, requests) -> list[tuple[float, bool]]:
        from eval.scoring import encode_requests, score_requests

        pairs = [tuple(r.args) for r in requests]
        if not pairs:
            return []
        scores = score_requests(
            self.model,
            encode_requests(self.tokenizer, self.eos, pairs),
            max_len=self.max_length,
            desc="loglikelihood",
            progress=writes(),
        )
        out = [(float(lp), bool(g)) for lp, g in zip(scores.logprob, scores.greedy, strict=True)]
        for pair, result in zip(pairs, out, strict=True):
            self.cache_hook.add_partial("loglikelihood", pair, result)
        return out

    def loglikelihood_rolling(self, requests) -> list[float]:
        from eval.scoring import score_requests

        texts = [r.args[0] for r in requests]
        windows, owner = [], []
        for i, text in enumerate(texts):
            ids = self.tokenizer.encode(text, add_special_tokens=False).ids if text else []
            for window in get_rolling_token_windows(ids, self.eos, self.max_length, 1):
                context, continuation = make_disjoint_window(window)
                windows.append((tuple(context), tuple(continuation)))
                owner.append(i)
        totals = np.zeros(len(texts))
        if windows:
            # a window's context and continuation together are max_length + 1 tokens: the last
            # continuation token is fed but predicts nothing, so the model sees max_length at most
            scores = score_requests(
                self.model, windows, max_len=self.max_length + 1, desc="rolling", progress=writes()
            )
            np.add.at(totals, owner, scores.logprob)
        out = [float(t) for t in totals]
        for text, result in zip(texts, out, strict=True):
            self.cache_hook.add_partial("loglikelihood_rolling", (text,), result)
        return out

    def generate_until(self, requests) -> list[str]:
        settings = [_generation_settings(r.args[1], self.max_length) for r in requests]
        groups: dict[tuple, list[int]] = {}
        for i in share(len(requests)):  # this process's share, grouped by settings
            groups.setdefault(settings[i], []).append(int(i))
        generated: dict[int, list[int]] = {}
        for (until, max_gen, temperature, top_p), members in groups.items():
            for start in range(0, len(members), self.generate_batch):
                batch = members[start : start + self.generate_batch]
                prompts = [self._prompt(requests[i].args[0], max_gen) for i in batch]
                ids = self._generate(prompts, until, max_gen, temperature, top_p)
                generated.update(zip(batch, ids, strict=True))
        out = []
        for r, s, ids in zip(requests, settings, _gather(generated, len(requests)), strict=True):
            text = self.tokenizer.decode(ids)
            for stop in s[0]:  # the harness's rule: the text before the first of each stop in turn
                text = text.split(stop)[0]
            self.cache_hook.add_partial("generate_until", r.args, text)
            out.append(text)
        return out

    # -- generation ---------------------------------------------------------------------------

    def _prompt(self, context: str, max_gen: int) -> list[int]:
        """The context's last max_length - max_gen tokens (EOS for an empty context)."""
        ids = self.tokenizer.encode(context, add_special_tokens=False).ids
        return ids[-(self.max_length - max_gen) :] if ids else [self.eos]

    def _generate(self, prompts, until, max_gen, temperature, top_p) -> list[list[int]]:
        """Token ids generated for a batch of prompts, each up to its EOS (not included)."""
        from effattn_jax.generate import Generator

        if self._generator is None:
            self._generator = Generator(self.model)
        rows = prompts + [[self.eos]] * (self.generate_batch - len(prompts))  # one shape per batch size
        width = max(32, 1 << (max(len(p) for p in rows) - 1).bit_length())  # few prefill shapes

        def done(ids: np.ndarray) -> bool:  # every real row has reached EOS or a stop sequence
            return all(self._reached_stop(row.tolist(), until) for row in ids[: len(prompts)])

        generated = self._generator.generate(
            rows,
            max_gen,
            temperature=temperature,
            top_p=top_p,
            prompt_width=width,
            stop=done,
            stop_every=STOP_CHECK_EVERY,
        )
        return [ids[: self._end(ids)] for ids in generated[: len(prompts)]]

    def _end(self, ids: list[int]) -> int:
        """Where a row's text ends: its first end-of-text id (any the model declares), else its length."""
        return next((i for i, t in enumerate(ids) if t in self.stop_ids), len(ids))

    def _reached_stop(self, ids: list[int], until: tuple[str, ...]) -> bool:
        if self._end(ids) < len(ids):
            return True
        text = self.tokenizer.decode(ids)
        return any(stop in text for stop in until)


def _generation_settings(kwargs: dict | None, max_length: int) -> tuple:
    """A request's (stop sequences, max_gen_toks, temperature, top_p) from the task's
    generation_kwargs; greedy unless it says do_sample."""
    kwargs = dict(kwargs or {})
    until = kwargs.pop("until", None) or ()
    until = (until,) if isinstance(until, str) else tuple(until)
    max_gen = int(kwargs.pop("max_gen_toks", DEFAULT_MAX_GEN_TOKS))
    sample = bool(kwargs.pop("do_sample", False))
    temperature = float(kwargs.pop("temperature", 0.0) or 0.0) if sample else 0.0
    top_p = float(kwargs.pop("top_p", 1.0) or 1.0) if sample else 1.0
    if not 0 < max_gen < max_length:
        raise ValueError(
            f"max_gen_toks={max_gen}: must be positive and leave room for the prompt in the model's "
            f"context of {max_length} tokens (its data.seq_len)"
        )
    if kwargs and _unused_warned.isdisjoint(kwargs):
        _unused_warned.update(kwargs)
        print(f"effattn: generation_kwargs not used: {', '.join(sorted(kwargs))}", file=sys.stderr)
    return until, max_gen, temperature, top_p


_unused_warned: set[str] = set()


def _gather(generated: dict[int, list[int]], n: int) -> list[list[int]]:
    """Every request's generated ids on every process (each generated its share)."""
    lengths = np.zeros(n)
    for i, ids in generated.items():
        lengths[i] = len(ids)
    lengths = total(lengths).astype(np.int64)
    grid = np.zeros((n, int(lengths.max(initial=0))))
    for i, ids in generated.items():
        grid[i, : len(ids)] = ids
    grid = total(grid).astype(np.int64)
    return [grid[i, : lengths[i]].tolist() for i in range(n)]
