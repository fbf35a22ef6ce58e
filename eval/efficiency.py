"""Efficiency measurements of the EG-MLA paper.

    python -m eval.efficiency kv-cache --config configs/egmla/paper/mla_base.yaml [--json]

kv-cache: elements and bytes per token of the decode cache, all layers,
counted from the cache arrays the attention modules actually allocate
(`effattn_jax.model.init_cache`, built abstractly: nothing is materialised).
Floating-point entries are the KV-cache figure; integer entries (EG-MLA's
token ids) are reported on their own line. Also reports the parameter split,
with EG-MLA's gate tables apart.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

from effattn_jax.config import ConfigError, load_config  # noqa: E402
from effattn_jax.model import Transformer, init_cache, param_counts  # noqa: E402


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
        "params_non_embedding": counts["non_embedding"],
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    kv = sub.add_parser("kv-cache", help="KV-cache elements and bytes per token")
    kv.add_argument("--config", required=True)
    kv.add_argument("--json", action="store_true")
    kv.add_argument("overrides", nargs="*")
    args = p.parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as e:
        print(e, file=sys.stderr)
        return 2
    r = kv_cache_report(cfg)
    if args.json:
        print(json.dumps(r))
        return 0
    print(f"{args.config}: attention.kind={r['attention_kind']}, {r['layers']} layers, cache dtype {r['cache_dtype']}")
    print(f"KV cache: {r['kv_elements_per_token']:,} elements/token = {r['kv_bytes_per_token']:,} bytes/token")
    print(f"integer cache entries (token ids): {r['integer_entries_per_token']:,}/token")
    print(f"params: {r['params_total']:,} total, {r['params_embedding']:,} embedding, "
          f"{r['params_embedding_gate']:,} embedding-gate, {r['params_non_embedding']:,} other")
    return 0


if __name__ == "__main__":
    sys.exit(main())
