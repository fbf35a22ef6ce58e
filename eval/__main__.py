"""`python -m eval <command> ...`: evaluate runs' checkpoints and draw the papers' figures.

    lm-loss     validation loss: overall, by in-document position, trailing
    downstream  zero-shot accuracy on the seven tasks of the EG-MLA paper's average (+ SciQ, LAMBADA)
    curves      accuracy and validation loss against training tokens, every kept checkpoint
    scaling     loss against training compute, power-law fits per attention kind
    report      the EG-MLA four-panel figure and its table

The benchmark and measurement scripts are modules of their own under `eval/bench/`
(`python -m eval.bench.<name>`: attention, train, efficiency, aot_compile, gpu_suite, ...).

Multi-process (as train.py: JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID, or a
cluster jax detects): every process evaluates its share on its own devices; process 0 prints
and writes (eval/processes.py). Locally: `python -m effattn_jax.launch --processes 2 --module
eval -- downstream --run DIR`.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys

COMMANDS = {
    "lm-loss": "eval.lm_loss",
    "downstream": "eval.downstream",
    "curves": "eval.curves",
    "scaling": "eval.scaling",
    "report": "eval.report",
}


def main(argv=None) -> int:
    import importlib

    from effattn_jax.cli import ArgumentParser

    parser = ArgumentParser(prog="python -m eval", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    modules = {}
    for name, module in COMMANDS.items():
        modules[name] = importlib.import_module(module)
        doc = (modules[name].__doc__ or "").strip().splitlines()[0]
        modules[name].add_arguments(
            sub.add_parser(
                name,
                help=doc,
                description=modules[name].__doc__,
                formatter_class=argparse.RawDescriptionHelpFormatter,
            )
        )
    args = parser.parse_args(argv)
    from effattn_jax.config import ConfigError, DistributedConfig
    from effattn_jax.launch import initialize

    try:
        initialize(DistributedConfig())
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    from eval.processes import persistent_compilation_cache, platform_line, writes

    persistent_compilation_cache()

    if writes():
        print(platform_line(), flush=True)
    from absl import logging as absl_logging

    absl_logging.set_verbosity(absl_logging.ERROR)  # Orbax's read-only notices: not the user's concern
    from effattn_jax.checkpoint import CheckpointError
    from effattn_jax.data.corpus import DataError
    from eval.tasks import TaskError

    try:
        with contextlib.ExitStack() as quiet:
            if not writes():  # processes other than 0 print nothing but errors
                quiet.enter_context(contextlib.redirect_stdout(quiet.enter_context(open(os.devnull, "w"))))
            return modules[args.command].command(args)
    except (CheckpointError, ConfigError, DataError, TaskError, ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
