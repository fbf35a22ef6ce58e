"""`python -m effattn_jax.convert from-hf | to-hf`: one line and exit 2 for what cannot be
converted, nothing written."""

from __future__ import annotations

import sys

from effattn_jax.cli import ArgumentParser
from effattn_jax.convert.hf_config import ConvertError
from effattn_jax.convert.runs import from_hf, to_hf


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(
        prog="python -m effattn_jax.convert",
        description=__doc__,
    )
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("from-hf", help="a Hugging Face model directory -> a run directory")
    p.add_argument("--model", required=True, help="the Hugging Face model directory")
    p.add_argument("--out", required=True, help="the new run directory")
    p.add_argument("overrides", nargs="*", help="config overrides, key=value")
    p = sub.add_parser("to-hf", help="a run's checkpoint -> a Hugging Face model directory")
    p.add_argument("--run", required=True, help="the run directory")
    p.add_argument("--step", default="latest", help="a kept step (default: the newest)")
    p.add_argument("--out", required=True, help="the new model directory")
    args = parser.parse_args(argv)
    from effattn_jax.config import ConfigError
    from effattn_jax.data.corpus import DataError

    try:
        if args.command == "from-hf":
            out = from_hf(args.model, args.out, args.overrides)
            print(f"converted {args.model} -> {out} (step 0)")
        else:
            for note in to_hf(args.run, args.out, args.step):
                print(f"note: {note}", file=sys.stderr)
            print(f"exported {args.run} -> {args.out}")
    except (ConvertError, ConfigError, DataError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0
