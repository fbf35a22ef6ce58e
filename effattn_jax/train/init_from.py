"""`train.init_from`: a new run starting from another run's parameters. The source step is checked
before anything is written (its parameters must have this model's shapes), and a dense source
may start a DSA model, whose indexers it lacks: those keep their fresh initialization."""

from __future__ import annotations

import jax

from effattn_jax import checkpoint
from effattn_jax.config import Config, ConfigError
from effattn_jax.sharding import leaves_by_path
from effattn_jax.train.state import fresh_params, in_indexer


def checked_source(cfg: Config, setup) -> tuple[str, int] | None:
    """(run dir, step) of `train.init_from`, checked before anything is written: the step exists
    and its model's parameters have this config's shapes (the contract; one line if not)."""
    spec = cfg.train.init_from
    if not spec:
        return None
    try:
        source = checkpoint.init_source(spec)
        changes = checkpoint.shape_changes(*source, setup.abstract_state["params"], fresh=in_indexer)
    except checkpoint.CheckpointError as e:
        raise ConfigError("train.init_from", spec, str(e)) from None
    if changes:
        more = f" (and {len(changes) - 3} more)" if len(changes) > 3 else ""
        raise ConfigError(
            "train.init_from",
            spec,
            f"its parameters do not fit this model: {'; '.join(changes[:3])}{more}; "
            "a continued run may change the attention core (DSA adds fresh indexers), context length "
            "and RoPE base, not shapes",
        )
    return source


def init_params(setup, init: tuple[str, int]) -> dict:
    """`train.init_from`'s parameters (the step was verified by `checked_source`); DSA indexers the
    source lacks keep this model's fresh initialization."""
    abstract = setup.abstract_state["params"]
    saved = leaves_by_path(checkpoint.saved_params(*init))
    fresh = {path for path in leaves_by_path(abstract) if path not in saved and in_indexer(path)}
    if not fresh:
        return checkpoint.restore_params(*init, abstract, verified=True)
    restored = leaves_by_path(checkpoint.restore_params(*init, _drop(abstract, fresh), verified=True))
    pick = lambda path, x: restored.get(tuple(str(getattr(k, "key", k)) for k in path), x)
    return jax.tree_util.tree_map_with_path(pick, fresh_params(setup))


def _drop(tree: dict, paths: set, prefix=()) -> dict:
    """A nested dict without the leaves at `paths` (tuples of keys as strings)."""
    out = {}
    for key, value in tree.items():
        path = (*prefix, str(key))
        if isinstance(value, dict):
            if kept := _drop(value, paths, path):
                out[key] = kept
        elif path not in paths:
            out[key] = value
    return out
