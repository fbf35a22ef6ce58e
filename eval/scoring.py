"""Log-likelihood of (context, continuation) requests, batched and prefix-shared.

Requests that share a context (the choices of one question) form a unit: its context runs
once through the model, filling the KV cache (`Transformer.decode_hidden`), the cache rows
are copied once per continuation, and every continuation runs over its copy. The output head
runs only at the positions that predict a continuation token, in chunks, so the
[tokens, vocab] logits are never materialised for a whole batch.

Shapes are bucketed (contexts and continuations padded to powers of two, a fixed token budget
per batch), so a whole task compiles a handful of programs, not one per question. Padding is
harmless: a row's cache slots past its own tokens are either overwritten by its continuation
or lie after every position it queries (attention is causal by position).

Tokenization: context and continuation are encoded separately (the continuation starts with
its leading space, where the GPT-NeoX pre-tokenizer splits anyway); a context longer than the
model's length is cut from the left, as lm-evaluation-harness does; an empty one is the EOS.
"""

from __future__ import annotations

import functools
import math
from collections import defaultdict
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm import tqdm

from effattn_jax.memory import fit_checked
from effattn_jax.model import init_cache
from eval.processes import share, total

TOKEN_BUDGET = 8192  # context (and continuation) tokens per batch, padding included
CHOICES = 4  # the usual number of choices per context: sizes context rows against continuation rows
HEAD_CHUNK = 1024  # output-head rows per step
VOCAB_TILE = 2048  # output-head columns per step: [1024, <=2048] float32 logits at a time
HEAD_ROWS = 4 * HEAD_CHUNK  # continuation positions per output-head call


@dataclass
class Scores:
    """Per request: sum of log-probs of the continuation, its token count, and whether every
    continuation token is the model's greedy choice."""

    logprob: np.ndarray  # [requests] float64
    tokens: np.ndarray  # [requests] int
    greedy: np.ndarray  # [requests] bool
    context_tokens: int  # real (unpadded) context tokens run, shared contexts counted once
    truncated: int  # contexts cut from the left to fit the model's length


def _bucket(n: int, minimum: int) -> int:
    """The padded length of n: the smallest power of two >= n (few shapes: finer steps cost more
    compiles than their padding saves, measured on the seven tasks)."""
    return max(minimum, 1 << math.ceil(math.log2(max(n, 1))))


def encode_requests(tokenizer, eos: int, pairs: list[tuple[str, str]]) -> list[tuple[tuple, tuple]]:
    """(context, continuation) strings -> token id tuples; each distinct string encoded once."""
    texts = sorted({t for pair in pairs for t in pair})
    ids = dict(
        zip(texts, (e.ids for e in tokenizer.encode_batch(texts, add_special_tokens=False)), strict=True)
    )
    return [(tuple(ids[c]) or (eos,), tuple(ids[x])) for c, x in pairs]


def _units(requests, max_len: int):
    """Groups request indices by identical context; cuts contexts to fit max_len."""
    by_context: dict[tuple, list[int]] = defaultdict(list)
    for i, (ctx, cont) in enumerate(requests):
        if not cont:
            raise ValueError(f"request {i}: the continuation has no tokens")
        by_context[ctx].append(i)
    units, truncated = [], 0
    for ctx, members in by_context.items():
        longest = max(len(requests[i][1]) for i in members)
        keep = max(1, max_len - longest)
        truncated += len(ctx) > keep
        units.append((ctx[-keep:], members))
    return units, truncated


def _batches(units, requests):
    """Yields (Lc, Tc, P, R, units of one batch). Units are grouped by their padded context and
    continuation lengths; a batch's shape depends on (Lc, Tc) only, so every task and checkpoint
    reuses the same few compiled programs (`_batch_rows`), filled until P contexts or R
    continuations."""
    groups = defaultdict(list)
    for ctx, members in units:
        tc = _bucket(max(len(requests[i][1]) for i in members), 8)
        groups[(_bucket(len(ctx), 32), tc)].append((ctx, members))
    _merge_small_groups(groups)
    for (lc, tc), group in sorted(groups.items()):
        p, r = _batch_rows(lc, tc)
        batch, rows = [], 0
        for unit in group:
            if batch and (len(batch) == p or rows + len(unit[1]) > r):
                yield lc, tc, p, r, batch
                batch, rows = [], 0
            batch.append(unit)
            rows += len(unit[1])
        yield lc, tc, p, r, batch


def _batch_rows(lc: int, tc: int) -> tuple[int, int]:
    """(P context rows, R continuation rows) of a batch: each within the token budget, and R
    the continuations of P contexts of CHOICES choices (no rows idle when contexts are long)."""
    p = max(1, min(TOKEN_BUDGET // lc, TOKEN_BUDGET // tc // CHOICES))
    return p, p * CHOICES


def _merge_small_groups(groups: dict) -> None:
    """Moves the units of a group that does not fill one batch into the smallest larger shape
    present (longer context and continuation rows): one compile fewer for some padding."""
    for key in sorted(groups, key=lambda k: len(groups[k])):
        lc, tc = key
        if len(groups[key]) >= _batch_rows(lc, tc)[0]:
            continue
        hosts = [k for k in groups if k != key and k[0] >= lc and k[1] >= tc]
        if hosts:
            groups[min(hosts, key=lambda k: k[0] * k[1])].extend(groups.pop(key))


def _pack(batch, requests, lc, tc, p, r):
    """Host arrays of one batch, padded to (P, Lc) and (R, Tc), plus the continuations' order."""
    ctx = np.zeros((p, lc), np.int32)
    ctx_len = np.ones(p, np.int32)
    cont = np.zeros((r, tc), np.int32)
    prefix = np.zeros(r, np.int32)
    order = []  # request index of each continuation row
    for u, (c, members) in enumerate(batch):
        ctx[u, : len(c)] = c
        ctx_len[u] = len(c)
        for i in members:
            x = requests[i][1]
            cont[len(order), : len(x)] = x
            prefix[len(order)] = u
            order.append(i)
    return (ctx, ctx_len, cont, prefix), order


def _hidden(graphdef, params, ctx, ctx_len, cont, prefix):
    """Hidden states [R, Tc, d] that predict each continuation token. ctx [P, Lc] and cont
    [R, Tc] int32 token rows; prefix [R] the context row of each continuation."""
    m = nnx.merge(graphdef, params)
    p, lc = ctx.shape
    tc = cont.shape[1]
    caches = init_cache(m, p, lc, jnp.float32)  # the context attends over its own slots only
    h_ctx, caches = m.decode_hidden(ctx, jnp.broadcast_to(jnp.arange(lc), ctx.shape), caches, prefill=True)
    # one cache copy per continuation, with Tc free slots after the context's (at the origin:
    # whichever axis an entry keeps its slots on)
    caches = jax.tree.map(
        lambda a, free: jax.lax.dynamic_update_slice(free, a[prefix], (0,) * a.ndim),
        caches,
        init_cache(m, len(prefix), lc + tc),
    )
    positions = ctx_len[prefix][:, None] + jnp.arange(tc)[None, :]
    h_cont, _ = m.decode_hidden(cont, positions, caches)
    # the state predicting continuation token j: the context's last for j = 0, else token j - 1's
    h_first = h_ctx[prefix, ctx_len[prefix] - 1]
    return jnp.concatenate([h_first[:, None], h_cont[:, :-1]], axis=1)


def _vocab_tile(vocab: int) -> int:
    """The largest divisor of the vocabulary up to VOCAB_TILE (the whole vocabulary if small)."""
    tile = max(t for t in range(1, min(vocab, VOCAB_TILE) + 1) if vocab % t == 0)
    return tile if tile >= 256 else vocab


def _head(graphdef, params, h, targets):
    """(log p(target), target is the argmax) per row of h [HEAD_ROWS, d]: HEAD_CHUNK rows at a
    time, the vocabulary in tiles with a running max and sum of exponentials (an online
    logsumexp), so no [rows, vocab] logits are ever held and each tile stays in cache."""
    m = nnx.merge(graphdef, params)
    rows = m.output_projection().T  # [V, d]: the tied embedding itself
    vt = _vocab_tile(rows.shape[0])
    tiles = rows.reshape(-1, vt, rows.shape[1])  # [V / vt, vt, d]

    def chunk(args):
        x, t = args
        x = m.final_norm(x)

        def tile(carry, wt):
            top, total = carry
            logits = jnp.einsum("nd,vd->nv", x, wt, preferred_element_type=jnp.float32)
            new_top = jnp.maximum(top, logits.max(-1))
            total = total * jnp.exp(top - new_top) + jnp.exp(logits - new_top[:, None]).sum(-1)
            return (new_top, total), None

        start = (jnp.full(x.shape[:1], -jnp.inf), jnp.zeros(x.shape[:1]))
        (top, total), _ = jax.lax.scan(tile, start, tiles)
        target = jnp.einsum("nd,nd->n", x, rows[t], preferred_element_type=jnp.float32)
        return target - (top + jnp.log(total)), target >= top

    lp, greedy = jax.lax.map(chunk, (h.reshape(-1, HEAD_CHUNK, h.shape[-1]), targets.reshape(-1, HEAD_CHUNK)))
    return lp.reshape(-1), greedy.reshape(-1)


# compiled for each batch shape and checked to fit the device before it first runs
_KNOBS = "a smaller TOKEN_BUDGET (eval/scoring.py: tokens per batch) or a device with more memory"
_hidden = fit_checked(jax.jit(_hidden, static_argnums=0), "scoring a batch", _KNOBS, static_argnums=(0,))
_head = fit_checked(jax.jit(_head, static_argnums=0), "the output head", _KNOBS, static_argnums=(0,))


class _HeadQueue:
    """Collects the real continuation positions of many batches and runs the output head on
    full blocks of HEAD_ROWS of them (one compiled shape, no padding but the last block's)."""

    def __init__(self, graphdef, params, total: int):
        self.graphdef, self.params = graphdef, params
        self.h, self.t, self.pending = [], [], 0
        self.lp, self.greedy = np.zeros(total), np.zeros(total, bool)
        self.done = 0

    def add(self, h: np.ndarray, targets: np.ndarray) -> None:
        self.h.append(h)
        self.t.append(targets)
        self.pending += len(h)
        while self.pending >= HEAD_ROWS:
            self._run()

    def flush(self) -> tuple[np.ndarray, np.ndarray]:
        while self.pending:
            self._run()
        return self.lp, self.greedy

    def _run(self) -> None:
        h, t = np.concatenate(self.h), np.concatenate(self.t)
        take = min(HEAD_ROWS, len(h))
        hb, tb = np.zeros((HEAD_ROWS, h.shape[1]), h.dtype), np.zeros(HEAD_ROWS, np.int32)
        hb[:take], tb[:take] = h[:take], t[:take]
        lp, greedy = _head(self.graphdef, self.params, hb, tb)
        self.lp[self.done : self.done + take] = np.asarray(lp)[:take]
        self.greedy[self.done : self.done + take] = np.asarray(greedy)[:take]
        self.done += take
        self.h, self.t, self.pending = [h[take:]], [t[take:]], len(h) - take


def score_requests(model, requests, *, max_len: int, desc: str = "score", progress: bool = True) -> Scores:
    """Log-likelihoods of tokenized (context, continuation) requests under `model`. In a
    multi-process run each process scores its share of the contexts (eval/processes.py)."""
    units, truncated = _units(requests, max_len)
    units = [units[i] for i in share(len(units))]
    graphdef, params = nnx.split(model)
    tokens = np.array([len(x) for _, x in requests])
    head = _HeadQueue(graphdef, params, int(tokens.sum()))
    order = []  # request index of each continuation, in the order the head sees them

    def take(h, rows):
        h = np.asarray(h)
        for row, i in enumerate(rows):
            head.add(h[row, : tokens[i]], np.asarray(requests[i][1], np.int32))
        order.extend(rows)

    previous = None  # one batch in flight: the next is packed, compiled and dispatched meanwhile
    for lc, tc, p, r, batch in tqdm(
        list(_batches(units, requests)), desc=desc, disable=not progress, leave=False
    ):
        arrays, rows = _pack(batch, requests, lc, tc, p, r)
        current = (_hidden(graphdef, params, *arrays), rows)
        if previous is not None:
            take(*previous)
        previous = current
    if previous is not None:
        take(*previous)
    lp, greedy = head.flush()
    ends = np.cumsum(tokens[order])
    logprob, all_greedy = np.zeros(len(requests)), np.zeros(len(requests), bool)
    logprob[order] = np.add.reduceat(lp, ends - tokens[order]) if len(lp) else 0.0
    all_greedy[order] = np.logical_and.reduceat(greedy, ends - tokens[order]) if len(lp) else False
    logprob, all_greedy = total(logprob), total(all_greedy) > 0
    context_tokens = int(total(np.array(sum(len(c) for c, _ in units))))
    return Scores(logprob, tokens, all_greedy, context_tokens, truncated)


@functools.partial(jax.jit, static_argnums=0)
def _plain_log_probs(graphdef, params, tokens):
    return jax.nn.log_softmax(nnx.merge(graphdef, params)(tokens), axis=-1)


def direct_loglikelihood(model, context, continuation, *, length: int = 128) -> tuple[float, bool]:
    """The plain reference, one request at a time: a forward pass over context + continuation
    (right-padded to `length`, which causal attention ignores, so one compile serves all) ->
    (sum of the continuation's log-probs, whether each of its tokens is the argmax)."""
    seq = np.zeros((1, length), np.int32)
    seq[0, : len(context) + len(continuation)] = [*context, *continuation]
    lp = np.asarray(_plain_log_probs(*nnx.split(model), jnp.asarray(seq)))[0]
    at = [len(context) - 1 + j for j in range(len(continuation))]
    return float(sum(lp[i, t] for i, t in zip(at, continuation, strict=True))), all(
        int(np.argmax(lp[i])) == t for i, t in zip(at, continuation, strict=True)
    )
