"""What decoding costs, measured on this process's devices: the decode cache's size per token
(counted from the arrays the attention modules allocate) and the time of a decode step over a
synthetic cache, for the EG-MLA models, MoBA against dense, and the absorbed latent kernels.
The eval commands (report, sweep), the benchmark scripts and the GPU suite call these."""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
from flax import nnx

from effattn_jax.config import load_config
from effattn_jax.memory import check_fits
from effattn_jax.model import Transformer, init_cache, param_counts, ready_for_decoding
from effattn_jax.ops.moba_decode import prefill_block_means
from eval.timing import Carry, alternated, carried

PAPER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "configs", "egmla", "paper")


def kv_cache_report(cfg) -> dict:
    model = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
    dtype = jnp.dtype(cfg.model.dtype)
    caches = jax.eval_shape(lambda: init_cache(model, batch=1, max_len=1, dtype=dtype))
    leaves = jax.tree.leaves(caches)
    floats = [x for x in leaves if jnp.issubdtype(x.dtype, jnp.floating)]
    ints = [x for x in leaves if not jnp.issubdtype(x.dtype, jnp.floating)]
    counts = param_counts(model)
    return {
        "attention_kind": cfg.attention.kind,
        "layers": cfg.model.num_layers,
        "cache_dtype": str(dtype),
        "kv_elements_per_token": int(sum(x.size for x in floats)),
        "kv_bytes_per_token": int(sum(x.size * x.dtype.itemsize for x in floats)),
        "integer_entries_per_token": int(sum(x.size for x in ints)),
        "params_total": counts["total"],
        "params_embedding": counts["embedding"],
        "params_embedding_gate": counts["embedding_gate"],
        "params_token_table": counts["token_table"],
        "params_non_embedding": counts["non_embedding"],
    }


def compiled_decode_step(cfg, context: int, *, absorb: bool):
    """(compiled decode step, its arguments): one new token at position `context` over a cache
    of `context` earlier tokens filled with random entries (batch 1). The step returns (logits,
    cache) and donates the cache, as generation does (else each step would copy it)."""
    model = ready_for_decoding(Transformer(cfg, rngs=nnx.Rngs(0)))  # as generation does
    graphdef, params = nnx.split(model)
    step = jax.jit(
        lambda p, t, pos, c: nnx.merge(graphdef, p).decode(t, pos, c, absorb=absorb), donate_argnums=3
    )
    caches = synthetic_caches(model, 1, context + 1, jnp.dtype(cfg.model.dtype), seed=context)
    args = (params, jnp.ones((1, 1), jnp.int32), jnp.full((1, 1), context, jnp.int32), caches)
    compiled = step.lower(*args).compile()
    check_fits(compiled, jax.local_devices()[:1], f"decoding at context {context}", "a shorter context")
    return compiled, args


def _decode_steps(step, tokens, pos, cache: Carry, *, turn: int = 1):
    """A contender for the timer (eval/timing.py): the seconds of the last of `turn` decode steps of
    `step` (over (tokens, positions, cache), donating the cache); the cache it returns is carried in
    `cache` to the next call (each step writes the same slot)."""

    def decode(caches):
        logits, caches = step(tokens, pos, caches)
        return caches, logits

    return carried(decode, cache, untimed=turn - 1)


def _check_fits(step: functools.partial, what: str, *args) -> None:
    """DoesNotFit before a timed decode step (a partial of a jit over its parameters) first runs;
    jit then reuses the executable the check compiled, and the timed calls take its fast path."""
    compiled = step.func.lower(*step.args, *args).compile()
    check_fits(compiled, jax.local_devices()[:1], what, "a shorter context")


def synthetic_caches(model, batch: int, length: int, dtype=jnp.float32, *, seed: int = 0) -> list[dict]:
    """Every cache array of `init_cache` filled with random entries: normal floats, token ids
    drawn from the vocabulary (what a filled cache holds, without running a prefill)."""
    key = jax.random.key(seed)
    vocab = model.embed[...].shape[0]
    fill = lambda x, key: (
        jax.random.normal(key, x.shape, x.dtype)
        if jnp.issubdtype(x.dtype, jnp.floating)
        else jax.random.randint(key, x.shape, 0, vocab, x.dtype)
    )
    caches = init_cache(model, batch, length, dtype)
    return [
        {name: fill(x, jax.random.fold_in(key, 64 * layer + i)) for i, (name, x) in enumerate(c.items())}
        for layer, c in enumerate(caches)
    ]


def decode_bytes_accessed(cfg, context: int, *, absorb: bool) -> float:
    """Bytes one decode step moves, from XLA's cost analysis of the compiled step."""
    compiled, _ = compiled_decode_step(cfg, context, absorb=absorb)
    return float(compiled.cost_analysis()["bytes accessed"])


def decode_latency(cfg, contexts: list[int], *, absorb: bool, repeats: int = 5) -> dict[int, float]:
    """Median ms per decode step at each context length (synthetic cache, batch 1)."""
    out = {}
    for ctx in contexts:  # one at a time: a long context's cache is large
        step, (params, tokens, pos, caches) = compiled_decode_step(cfg, ctx, absorb=absorb)
        measure = _decode_steps(functools.partial(step, params), tokens, pos, Carry(caches))
        out[ctx] = alternated({ctx: measure}, repeats)[ctx] * 1e3
    return out


def decode_latency_alternated(cfgs: dict[str, object], context: int, *, rounds: int = 30) -> dict[str, float]:
    """name -> median ms per absorbed decode step at `context` (synthetic cache, batch 1). The
    models take turns, so the machine's drift falls on all of them alike (a sub-millisecond step
    measured alone swings by 2x here); each turn is two steps and only the second is timed, as in
    generation, where a step follows a step of the same model (timing the first charges a model
    for the caches its predecessor evicted: 1.5x after a heavy one)."""
    contenders = {}
    for name, cfg in cfgs.items():
        step, (params, tokens, pos, caches) = compiled_decode_step(cfg, context, absorb=True)
        contenders[name] = _decode_steps(functools.partial(step, params), tokens, pos, Carry(caches), turn=2)
    return {name: t * 1e3 for name, t in alternated(contenders, rounds).items()}


MOBA_DECODE_MODEL = [
    "model.num_layers=12",
    "model.d_model=768",
    "model.num_heads=12",
    "model.mlp_dim=3072",
    "model.dtype=float32",
    "moba.block_size=512",
    "moba.top_k=3",
]


def moba_decode_cases(contexts, batches, max_cache_gib: float):
    """(context, batch, fits) for every pair: whether one float32 cache fits the budget."""
    per_token = 2 * 12 * 768 * 4  # K and V, 12 layers, d 768, float32
    return [(c, b, b * (c + 1) * per_token <= max_cache_gib * 2**30) for c in contexts for b in batches]


def moba_vs_dense_decode(
    context: int, batch: int, *, repeats: int = 5, overrides: list[str] = MOBA_DECODE_MODEL
) -> dict:
    """Median ms of a decode step at position `context` for the MoBA and the dense model (built
    from `overrides`), the two alternated over one donated cache (each step writes the same slot)."""
    steps, caches = {}, None
    for core in ("moba", "dense"):
        cfg = load_config(None, overrides + [f"attention.core={core}", f"data.seq_len={context + 1}"])
        model = Transformer(cfg, rngs=nnx.Rngs(0))  # same seed: the same parameters for both
        graphdef, params = nnx.split(model)
        step = jax.jit(lambda p, t, pos, c, g=graphdef: nnx.merge(g, p).decode(t, pos, c), donate_argnums=3)
        steps[core] = functools.partial(step, params)
        if caches is None:  # the MoBA model's cache: K/V plus block means
            caches = _synthetic_moba_caches(model, batch, context + 1, cfg.moba.block_size)
    tokens = jnp.ones((batch, 1), jnp.int32)
    pos = jnp.full((batch, 1), context, jnp.int32)
    for core, step in steps.items():  # compiled and checked before anything runs
        _check_fits(step, f"{core} decoding at context {context}", tokens, pos, caches)
    shared = Carry(caches)  # one donated cache, passed from model to model
    ms = alternated({core: _decode_steps(step, tokens, pos, shared) for core, step in steps.items()}, repeats)
    moba, dense = ms["moba"] * 1e3, ms["dense"] * 1e3
    return {"context": context, "batch": batch, "moba_ms": moba, "dense_ms": dense, "ratio": moba / dense}


LATENT_MODELS = [("MLA-Base", "mla_base.yaml"), ("EG-MLA kv64 emb256", "eg_mla_kv64_emb256.yaml")]


def copy_bandwidth(gib: float = 1.0, repeats: int = 5) -> float:
    """Bytes read + written per second copying a float32 array into a donated buffer."""
    x = jnp.ones((int(gib * 2**28),), jnp.float32)
    copy = jax.jit(lambda x, out: x + 0.0, donate_argnums=1)

    def copy_into(buffer):
        buffer = copy(x, buffer)
        return buffer, buffer

    return 2 * x.nbytes / alternated({"copy": carried(copy_into, Carry(jnp.zeros_like(x)))}, repeats)["copy"]


def latent_decode(
    context: int, batch: int, *, repeats: int = 5, overrides: tuple[str, ...] = ()
) -> list[dict]:
    """Median ms of an absorbed decode step at position `context` for each LATENT_MODELS
    entry (with `overrides`; alternated over their donated caches) and the cache bytes each
    step reads."""
    steps, caches, read = {}, {}, {}
    for label, name in LATENT_MODELS:
        extra = [f"data.seq_len={context + 1}", "model.dtype=float32", *overrides]
        cfg = load_config(os.path.join(PAPER, name), extra)
        model = ready_for_decoding(Transformer(cfg, rngs=nnx.Rngs(0)))
        graphdef, params = nnx.split(model)
        step = jax.jit(lambda p, t, pos, c, g=graphdef: nnx.merge(g, p).decode(t, pos, c), donate_argnums=3)
        steps[label] = functools.partial(step, params)
        caches[label] = synthetic_caches(model, batch, context + 1, seed=context)
        read[label] = sum(x.nbytes for c in caches[label] for x in c.values())
    tokens, pos = jnp.ones((batch, 1), jnp.int32), jnp.full((batch, 1), context, jnp.int32)
    for label, step in steps.items():  # compiled and checked before anything runs
        _check_fits(step, f"{label} decoding at context {context}", tokens, pos, caches[label])
    contenders = {
        label: _decode_steps(step, tokens, pos, Carry(caches[label])) for label, step in steps.items()
    }
    ms = alternated(contenders, repeats)
    return [
        {"model": label, "context": context, "batch": batch, "ms": ms[label] * 1e3,
         "cache_bytes_read": read[label]}
        for label in steps
    ]  # fmt: skip


def _synthetic_moba_caches(model, batch: int, length: int, block_size: int) -> list[dict]:
    """Random K/V for every slot and the block means they imply."""
    caches = synthetic_caches(model, batch, length)
    for c in caches:
        c["block_means"] = prefill_block_means(
            c["block_means"], jnp.swapaxes(c["k"], 1, 2), length, block_size=block_size, dtype=c["k"].dtype
        )
    return caches
