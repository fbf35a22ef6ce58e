"""Train state (params, optimizer state, step) and its shardings over the mesh.

Parameters live as a pure dict (the NNX model is rebuilt inside the step with
`nnx.merge`); their shardings come from each Param's `logical_axes` through
`mesh.rules`; the optimizer state mirrors its parameters' shardings.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from effattn_jax.config import Config, check_batch_divides, check_context_split
from effattn_jax.model import Transformer, new_model, param_specs
from effattn_jax.sharding import logical_to_spec, sharding_rules


def make_optimizer(cfg: Config) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """AdamW with linear warmup + cosine decay and global-norm clipping; no decay on vectors (norm
    scales)."""
    t = cfg.train
    schedule = optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=t.lr,
        warmup_steps=t.warmup_steps,
        decay_steps=max(t.steps, t.warmup_steps + 1),
        end_value=t.lr * t.min_lr_ratio,
    )
    decay_mask = lambda params: jax.tree.map(lambda p: p.ndim > 1, params)
    adamw = optax.adamw(schedule, b1=t.b1, b2=t.b2, weight_decay=t.weight_decay, mask=decay_mask)
    if not cfg.uses_dsa:
        clip = [optax.clip_by_global_norm(t.grad_clip)] if t.grad_clip > 0 else []
        return optax.chain(*clip, adamw), schedule
    # DSA (docs/dsa.md, "Training"): the indexers and the rest each clipped by their own norm (a
    # joint clip would let one shrink the other's update); the warm-up freezes the rest
    clip = [clip_indexers_apart(t.grad_clip)] if t.grad_clip > 0 else []
    freeze = [keep_only_indexers()] if cfg.dsa.stage == "warmup" else []
    return optax.chain(*clip, adamw, *freeze), schedule


def in_indexer(path) -> bool:
    """Whether a parameter's path (jax key path, or names as strings) lies in a DSA indexer."""
    return any(str(getattr(key, "key", key)) == "indexer" for key in path)


def _split_by_indexer(tree):
    """(the indexers' leaves, the other leaves), each a list."""
    pairs = jax.tree_util.tree_flatten_with_path(tree)[0]
    return [x for p, x in pairs if in_indexer(p)], [x for p, x in pairs if not in_indexer(p)]


def clip_indexers_apart(max_norm: float) -> optax.GradientTransformation:
    """clip_by_global_norm applied to the indexers' gradients and to the rest's separately."""

    def update(updates, state, params=None):
        norms = [optax.tree.norm(part) for part in _split_by_indexer(updates)]
        factors = [jnp.minimum(1.0, max_norm / jnp.maximum(n, 1e-30)) for n in norms]
        scale = lambda path, g: g * factors[0 if in_indexer(path) else 1].astype(g.dtype)
        return jax.tree_util.tree_map_with_path(scale, updates), state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update)


def keep_only_indexers() -> optax.GradientTransformation:
    """Zero every update outside the DSA indexers (the warm-up stage's frozen model)."""

    def update(updates, state, params=None):
        keep = lambda path, u: u if in_indexer(path) else jnp.zeros_like(u)
        return jax.tree_util.tree_map_with_path(keep, updates), state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update)


@dataclass
class TrainSetup:
    """Everything static about a run's state: model structure, optimizer, shardings."""

    cfg: Config
    mesh: Mesh
    graphdef: Any
    tx: optax.GradientTransformation
    schedule: optax.Schedule
    state_shardings: dict
    abstract_state: dict  # ShapeDtypeStructs with shardings, for restore

    def batch_sharding(self) -> NamedSharding:
        shape = (self.cfg.data.batch_size, self.cfg.data.seq_len)
        spec = logical_to_spec(("batch", "length"), shape, self.mesh.shape, sharding_rules(self.cfg))
        return NamedSharding(self.mesh, spec)

    def abstract_batch(self) -> dict:
        """The shapes, dtypes and sharding of one global batch, for ahead-of-time compiles."""
        shape, sharding = (self.cfg.data.batch_size, self.cfg.data.seq_len), self.batch_sharding()
        dtypes = {
            "inputs": jnp.int32,
            "targets": jnp.int32,
            "segment_ids": jnp.int32,
            "loss_mask": jnp.float32,
        }
        return {k: jax.ShapeDtypeStruct(shape, d, sharding=sharding) for k, d in dtypes.items()}

    def model(self, params) -> Transformer:
        return nnx.merge(self.graphdef, params)


def make_setup(cfg: Config, mesh: Mesh) -> TrainSetup:
    """Raises ConfigError (before anything compiles) when the batch does not split over the mesh
    (rows over the batch axes, each sequence over the context axis)."""
    check_batch_divides(cfg, dict(mesh.shape))
    check_context_split(cfg, dict(mesh.shape))
    graphdef, pspecs = param_specs(cfg, mesh)
    tx, schedule = make_optimizer(cfg)
    params_shape = jax.eval_shape(lambda: nnx.to_pure_dict(nnx.split(new_model(cfg))[1]))
    opt_shape = jax.eval_shape(tx.init, params_shape)
    is_spec = lambda x: isinstance(x, PartitionSpec)
    opt_specs = optax.tree_map_params(
        tx, lambda _, s: s, opt_shape, pspecs, transform_non_params=lambda _: PartitionSpec(), is_leaf=is_spec
    )
    specs = {"params": pspecs, "opt_state": opt_specs, "step": PartitionSpec()}
    shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=is_spec)
    shapes = {"params": params_shape, "opt_state": opt_shape, "step": jax.ShapeDtypeStruct((), jnp.int32)}
    abstract = jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), shapes, shardings
    )
    return TrainSetup(cfg, mesh, graphdef, tx, schedule, shardings, abstract)


def init_state(setup: TrainSetup, params: dict | None = None) -> dict:
    """Fresh, sharded train state (initialised directly into its shardings); with `params`
    (another run's, `train.init_from`) those parameters, a fresh optimizer state and step 0."""
    if params is not None:
        start = lambda p: {"params": p, "opt_state": setup.tx.init(p), "step": jnp.zeros((), jnp.int32)}
        return jax.jit(start, out_shardings=setup.state_shardings)(params)

    def init():
        params = _new_params(setup.cfg)
        return {"params": params, "opt_state": setup.tx.init(params), "step": jnp.zeros((), jnp.int32)}

    return _run_once(setup, init, setup.state_shardings)


def _new_params(cfg: Config) -> dict:
    """A new model's parameters as a pure dict (traced inside the jitted initialisations)."""
    return nnx.to_pure_dict(nnx.split(new_model(cfg))[1])


def fresh_params(setup: TrainSetup) -> dict:
    """A fresh initialization of the parameters alone (no optimizer state), into their shardings."""
    return _run_once(setup, lambda: _new_params(setup.cfg), setup.state_shardings["params"])


def _run_once(setup: TrainSetup, fn, shardings):
    """fn() jitted into `shardings` and run once."""
    init = jax.jit(fn, out_shardings=shardings)
    if setup.mesh.devices.flat[0].platform == "cpu":
        # The program runs once. XLA:CPU's LLVM optimisation of its random draws (a threefry per
        # parameter) took 15 s of compile for the 3-layer test models, against 2.6 s unoptimised;
        # the values agree to within an ulp.
        return init.lower().compile(compiler_options={"xla_backend_optimization_level": 0})()
    return init()
