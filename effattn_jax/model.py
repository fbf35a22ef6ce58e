"""Decoder-only Transformer LM: token embedding, pre-norm blocks (attention from
the registry + SwiGLU), final RMSNorm, tied or separate output projection.

The model never branches on the attention kind: each block asks the registry
for its (kind, core) through `Config.layer_spec`, so hybrids are config only.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from flax.nnx import traversals
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from effattn_jax.attention import CORES, KINDS
from effattn_jax.attention.indexer import sown_indexer_kl
from effattn_jax.config import Config
from effattn_jax.layers import RMSNorm, SwiGLU, param
from effattn_jax.ops.context_parallel import context_shards
from effattn_jax.ops.moba import SCHEDULE_NAME
from effattn_jax.ops.segments import segment_positions
from effattn_jax.sharding import constrain, logical_to_spec, sharding_rules

# Remat recomputes a layer's activations in the backward but keeps MoBA's routing tables and
# schedule (small int arrays, no gradient): rebuilding them adds a sort, scatters and gathers
# to the program, which libtpu compiles slowly (BENCHMARKS.md, dry runs).
REMAT_POLICY = jax.checkpoint_policies.save_only_these_names(SCHEDULE_NAME)


class Block(nnx.Module):
    def __init__(self, cfg: Config, layer: int, *, rngs: nnx.Rngs):
        m = cfg.model
        kind, core = cfg.layer_spec(layer)
        self.rules = sharding_rules(cfg)
        dtype = jnp.dtype(m.dtype)
        self.attn_norm = RMSNorm(m.d_model, eps=m.norm_eps)
        self.attn = KINDS[kind](cfg, core=CORES[core](cfg), rngs=rngs)
        self.mlp_norm = RMSNorm(m.d_model, eps=m.norm_eps)
        self.mlp = SwiGLU(
            m.d_model,
            m.mlp_dim,
            rngs=rngs,
            std=m.init_std,
            out_std=m.init_std / math.sqrt(2 * m.num_layers),
            dtype=dtype,
        )

    def with_token_table(self, x, token_ids):
        """h + W_l E_l[x] where the attention owns a non-gating token table (MLA's
        `mla.token_table_dim`, EG-MLA's parameter-matched control), else h."""
        table = getattr(self.attn, "token_table", None)
        return x if table is None else x + table(token_ids).astype(x.dtype)

    def __call__(self, x, positions, segment_ids, token_ids):
        x = self.with_token_table(x, token_ids)
        x = x + self.attn(
            self.attn_norm(x), positions=positions, segment_ids=segment_ids, token_ids=token_ids
        )
        x = x + self.mlp(self.mlp_norm(x))
        return constrain(x, ("batch", "length", "embed"), self.rules)

    def decode(self, x, positions, token_ids, cache, **kw):
        x = self.with_token_table(x, token_ids)
        h, cache = self.attn.decode(
            self.attn_norm(x), positions=positions, token_ids=token_ids, cache=cache, **kw
        )
        x = x + h
        return x + self.mlp(self.mlp_norm(x)), cache


def layer_groups(cfg: Config) -> list[tuple[int, int, list[tuple[int, int]]]]:
    """Scanned layers: (first layer, count, core runs) per run of layers of one attention kind
    (and one parameter structure: a DSA layer owns an indexer); the core runs, (offset in the
    group, count), are scanned one after another. Grouping by kind keeps the parameter tree the
    same when a MoBA -> dense switch changes the cores."""
    specs = [cfg.layer_spec(i) for i in range(cfg.model.num_layers)]
    params = [(kind, core == "dsa") for kind, core in specs]
    groups = []
    for i, (_, core) in enumerate(specs):
        if not groups or params[i - 1] != params[i]:
            groups.append((i, 0, []))
        start, n, runs = groups[-1]
        if not runs or specs[i - 1][1] != core:
            runs.append((i - start, 0))
        runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        groups[-1] = (start, n + 1, runs)
    return groups


def _stacked_blocks(cfg: Config, layer: int, n: int, rngs: nnx.Rngs) -> Block:
    """n Blocks like layer `layer`, their parameters stacked on a new leading axis."""

    @nnx.split_rngs(splits=n)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def create(rngs):
        return Block(cfg, layer, rngs=rngs)

    return create(rngs)


def _block_graphdef(cfg: Config, layer: int):
    """The structure of one layer's Block (its kind and core), to merge with a slice of a stack."""
    return nnx.graphdef(nnx.eval_shape(lambda: Block(cfg, layer, rngs=nnx.Rngs(0))))


def _layer(i: int, a):
    """Layer i of a stacked parameter (of its shape, for an abstract model)."""
    return jax.ShapeDtypeStruct(a.shape[1:], a.dtype) if isinstance(a, jax.ShapeDtypeStruct) else a[i]


def _through(block, carry, args, indexed: bool):
    """carry through one block: x, or (x, the indexers' KL loss per token summed so far) where
    `indexed` (what the block's indexer sows is captured, `nnx.capture`: the model keeps none)."""
    if not indexed:
        return block(carry, *args)
    x, kl = carry
    x, sown = nnx.capture(block, nnx.Intermediate)(x, *args)
    return x, kl + sown_indexer_kl(sown)


def _scan(graphdef, layers, carry, args, remat: bool, indexed: bool):
    """carry (see `_through`) through the stacked layers in order: one traced layer, not one per
    layer (compile time)."""

    def body(carry, layer):
        return _through(nnx.merge(graphdef, layer), carry, args, indexed), None

    return jax.lax.scan(jax.checkpoint(body, policy=REMAT_POLICY) if remat else body, carry, layers)[0]


class Transformer(nnx.Module):
    def __init__(self, cfg: Config, *, rngs: nnx.Rngs):
        m = cfg.model
        self.embed = param(rngs, (m.vocab_size, m.d_model), ("vocab", "embed"), m.init_std)
        self.scan_layers = m.scan_layers
        if m.scan_layers:
            groups = layer_groups(cfg)
            self.blocks = nnx.List([_stacked_blocks(cfg, start, n, rngs) for start, n, _ in groups])
            self.runs = tuple(
                tuple((_block_graphdef(cfg, start + offset), offset, n) for offset, n in runs)
                for start, _, runs in groups
            )
        else:
            self.blocks = nnx.List([Block(cfg, i, rngs=rngs) for i in range(m.num_layers)])
        self.final_norm = RMSNorm(m.d_model, eps=m.norm_eps)
        self.lm_head = (
            None
            if m.tie_embeddings
            else param(rngs, (m.d_model, m.vocab_size), ("embed", "vocab"), m.init_std)
        )
        self.dtype = jnp.dtype(m.dtype)
        self.remat = m.remat
        self.loss_chunk_tokens = m.loss_chunk_tokens
        self.dsa_layers = sum(cfg.layer_spec(i)[1] == "dsa" for i in range(m.num_layers))
        self.rules = sharding_rules(cfg)

    def __call__(self, tokens: jax.Array, segment_ids: jax.Array | None = None, positions=None) -> jax.Array:
        """tokens, segment_ids: [B, S] int -> float32 logits [B, S, vocab]."""
        return constrain(
            self.logits(self.features(tokens, segment_ids, positions)),
            ("batch", "length", "vocab"),
            self.rules,
        )

    def features(self, tokens: jax.Array, segment_ids: jax.Array | None = None, positions=None) -> jax.Array:
        """tokens, segment_ids: [B, S] int -> the last block's output [B, S, d_model] (before the
        final norm): what the output head reads (`logits`, or the chunked training loss).
        `positions` [B, S]: in-document positions (default: from the segment ids); over a
        `context` mesh axis the batch is in the balanced layout and must bring them
        (`ops.context_parallel.balanced_batch`)."""
        return self.features_and_indexer_kl(tokens, segment_ids, positions)[0]

    def features_and_indexer_kl(self, tokens, segment_ids=None, positions=None):
        """(`features`, the DSA indexers' KL loss per token [B, S] float32 summed over the DSA
        layers, or None without one)."""
        if segment_ids is None:
            segment_ids = jnp.ones_like(tokens)
        if positions is None:
            if context_shards() > 1:
                raise ValueError(
                    "over a context mesh axis the model needs the batch's positions: "
                    "lay it out with effattn_jax.ops.context_parallel.balanced_batch"
                )
            positions = segment_positions(segment_ids)
        x = jnp.take(self.embed[...], tokens, axis=0).astype(self.dtype)
        x = constrain(x, ("batch", "length", "embed"), self.rules)

        indexed, args = self.dsa_layers > 0, (positions, segment_ids, tokens)
        carry = (x, jnp.zeros(tokens.shape, jnp.float32)) if indexed else x
        if self.scan_layers:
            for group, runs in zip(self.blocks, self.runs, strict=True):
                state = nnx.state(group)
                for graphdef, offset, n in runs:
                    layers = jax.tree.map(lambda a: a[offset : offset + n], state)  # noqa: B023
                    carry = _scan(graphdef, layers, carry, args, self.remat, indexed)
            return carry if indexed else (carry, None)

        def run(block, carry):
            return _through(block, carry, args, indexed)

        if self.remat:
            run = nnx.remat(run, policy=REMAT_POLICY)
        for block in self.blocks:
            carry = run(block, carry)
        return carry if indexed else (carry, None)

    def layers(self) -> list[Block]:
        """One Block per layer, in order (with scanned layers: views of the stacked parameters),
        for the per-layer work of decoding."""
        if not self.scan_layers:
            return list(self.blocks)
        out = []
        for group, runs in zip(self.blocks, self.runs, strict=True):
            state = nnx.state(group)
            for graphdef, offset, n in runs:
                out += [
                    nnx.merge(graphdef, jax.tree.map(functools.partial(_layer, offset + i), state))
                    for i in range(n)
                ]
        return out

    def logits(self, x):
        return jnp.dot(self.final_norm(x), self.output_projection(), preferred_element_type=jnp.float32)

    def output_projection(self) -> jax.Array:
        """[d_model, vocab] in the compute dtype: the tied embedding's transpose or the head."""
        w = self.embed[...].T if self.lm_head is None else self.lm_head[...]
        return w.astype(self.dtype)

    def decode(self, tokens: jax.Array, positions: jax.Array, caches: list[dict], **kw):
        """tokens, positions [B, T] (one document per row) -> (float32 logits [B, T, vocab], caches).
        Writes the tokens' cache entries, then attends over everything cached so far. kw
        (e.g. absorb=False for MLA) goes to the attention modules that take it."""
        x, caches = self.decode_hidden(tokens, positions, caches, **kw)
        return self.logits(x), caches

    def decode_hidden(self, tokens: jax.Array, positions: jax.Array, caches: list[dict], **kw):
        """`decode` without the output head: (hidden states [B, T, d_model] before the final norm,
        caches), for callers that need logits at a few positions only (`logits(x)` gives them)."""
        x = jnp.take(self.embed[...], tokens, axis=0).astype(self.dtype)
        ids = None
        if TOKEN_IDS in caches[0]:  # written once, read by every layer that decodes from them
            rows = jnp.arange(tokens.shape[0])[:, None]
            ids = caches[0][TOKEN_IDS].at[rows, positions].set(tokens.astype(jnp.int32))
        new = []
        for block, cache in zip(self.layers(), caches, strict=True):
            seen = {TOKEN_IDS: ids} if block.attn.cached_token_ids else {}
            x, cache = block.decode(x, positions, tokens, cache | seen, **kw)
            new.append({name: a for name, a in cache.items() if name != TOKEN_IDS})
        if ids is not None:
            new[0][TOKEN_IDS] = ids
        return x, new


TOKEN_IDS = "token_ids"  # the cached token ids, once per model: in the first layer's cache


def init_cache(model: Transformer, batch: int, max_len: int, dtype=jnp.float32) -> list[dict]:
    """One preallocated decode cache per layer, as each attention kind defines it; where a kind
    decodes from the cached token ids (EG-MLA), those once for the model, in the first layer's
    dict (decode_hidden passes them to the layers that read them)."""
    layers = model.layers()
    caches = [block.attn.init_cache(batch, max_len, dtype) for block in layers]
    if any(block.attn.cached_token_ids for block in layers):
        caches[0][TOKEN_IDS] = jnp.zeros((batch, max_len), jnp.int32)
    return caches


def ready_for_decoding(model: Transformer) -> Transformer:
    """Readies a model that no longer trains for decoding, in place: stacked layers
    (`model.scan_layers`) become one Block each, sliced out of the stack once rather than at
    every decode step (3-12x a step's time on a CPU), and EG-MLA's projected gates
    (`eg_mla.gate_at=projected`) become one [vocab, d_g] table per layer (attention/eg_mla.py)."""
    if model.scan_layers:
        model.blocks = nnx.List(model.layers())
        model.scan_layers = False
    for block in model.layers():
        if hasattr(block.attn, "fold_gate"):
            block.attn.fold_gate()
    return model


def param_counts(model: Transformer) -> dict[str, int]:
    """Parameter counts: total; embedding (input table and untied output head); embedding_gate
    (EG-MLA's per-layer token tables, the x-axis of the paper's figure); token_table (the
    non-gating tables of `mla.token_table_dim`, EG-MLA's control; their projections are matmuls
    and count as non-embedding); non_embedding (the rest: what a matmul reads)."""
    flat = nnx.to_flat_state(nnx.state(model, nnx.Param))
    total = sum(v.size for _, v in flat)
    gate = sum(v.size for path, v in flat if path[-1] == "gate_table")
    table = sum(v.size for path, v in flat if path[-1] == "token_table")
    emb = sum(v.size for path, v in flat if path in (("embed",), ("lm_head",)))
    return {
        "total": total,
        "embedding": emb,
        "embedding_gate": gate,
        "token_table": table,
        "non_embedding": total - emb - gate - table,
    }


# ---------------------------------------------------------------- parameters over a mesh


def new_model(cfg: Config) -> Transformer:
    """A freshly initialised model (from `train.seed`)."""
    return Transformer(cfg, rngs=nnx.Rngs(params=cfg.train.seed))


def param_specs(cfg: Config, mesh: Mesh) -> tuple[Any, dict]:
    """(graphdef, pure dict of PartitionSpecs) from the Params' logical axes, without allocating."""
    graphdef, state = nnx.split(nnx.eval_shape(lambda: new_model(cfg)))
    rules = sharding_rules(cfg)
    flat = {
        path: logical_to_spec(_axes(var), var.shape, mesh.shape, rules)
        for path, var in nnx.to_flat_state(state)
    }
    return graphdef, traversals.unflatten_mapping(flat)


def _axes(var) -> tuple:
    """A parameter's logical axes; stacked (scanned) layers add a leading, unsharded layer axis."""
    axes = tuple(var.get_metadata()["logical_axes"])
    return (None,) * (len(var.shape) - len(axes)) + axes


def abstract_params(cfg: Config, mesh: Mesh) -> tuple[Any, dict]:
    """(graphdef, pure dict of ShapeDtypeStructs sharded over `mesh`): what a restore targets."""
    graphdef, pspecs = param_specs(cfg, mesh)
    shapes = jax.eval_shape(lambda: nnx.to_pure_dict(nnx.split(new_model(cfg))[1]))
    is_spec = lambda x: isinstance(x, PartitionSpec)
    return graphdef, jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, s)),
        shapes,
        pspecs,
        is_leaf=is_spec,
    )
