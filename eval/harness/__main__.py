"""`python -m eval.harness [run] --model effattn --model_args run=DIR[,step=N] --tasks ...`:
lm-evaluation-harness's own command line (every option of `lm_eval`) with this project's model
registered first (importing this package registers it). With a harness release that discovers
plugins, plain `lm_eval` finds the model by its entry point; lm-eval 0.4.13 (the newest on PyPI)
does not, so this runs it.

Multi-process (`python -m effattn_jax.launch --processes N --module eval.harness -- ...`): every
process evaluates (eval/harness/__init__.py splits the work); processes other than 0 print
nothing and write their --output_path files to a temporary directory, so one process writes
the results.
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile


def _output_path_to(argv: list[str], directory: str) -> list[str]:
    """argv with --output_path (if given) pointing at `directory` instead."""
    out, replace_next = [], False
    for arg in argv:
        if replace_next:
            arg, replace_next = directory, False
        elif arg in ("--output_path", "-o"):
            replace_next = True
        elif arg.startswith("--output_path="):
            arg = f"--output_path={directory}"
        out.append(arg)
    return out


@contextlib.contextmanager
def _index_only_include_path_when_it_suffices(argv: list[str]):
    """The harness's command line indexes its ~15,000 built-in task YAMLs on every run (8 s on a
    2-core VM); when every task asked for is a task defined under --include_path, index only
    that (the harness's own `TaskManager(include_defaults=False)`). Anything else (a built-in
    task, a group, a YAML path) gets the harness's full index, as plain `lm_eval` does."""
    import argparse

    import lm_eval.tasks

    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--tasks", "-t", nargs="+", default=[])
    p.add_argument("--include_path", default=None)
    known, _ = p.parse_known_args(argv)
    names = [n.strip() for arg in known.tasks for n in arg.split(",") if n.strip()]
    harness_manager = lm_eval.tasks.TaskManager
    local = (
        harness_manager(include_path=known.include_path, include_defaults=False)
        if known.include_path
        else None
    )
    if local is None or not names or not set(names) <= set(local.all_subtasks):
        yield
        return

    class LocalTasks(harness_manager):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **{**kwargs, "include_defaults": False})

    lm_eval.tasks.TaskManager = LocalTasks
    try:
        yield
    finally:
        lm_eval.tasks.TaskManager = harness_manager


def _twice_in_model_args(argv: list[str]) -> str | None:
    """The first --model_args key given twice (the harness's parser keeps the last silently)."""
    seen, taking = set(), False
    for arg in argv:
        if arg.startswith("-"):
            taking = arg == "--model_args"
            arg = arg.partition("=")[2] if arg.startswith("--model_args=") else ""
            taking = taking or bool(arg)
        if not taking:
            continue
        for item in filter(None, arg.split(",")):
            key = item.partition("=")[0]
            if key in seen:
                return key
            seen.add(key)
    return None


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if key := _twice_in_model_args(argv):
        print(f"error: --model_args: {key} given twice; give each key once", file=sys.stderr)
        return 2
    from effattn_jax.checkpoint import CheckpointError
    from effattn_jax.config import ConfigError, DistributedConfig
    from effattn_jax.data.corpus import DataError
    from effattn_jax.launch import initialize

    initialize(DistributedConfig())  # before anything touches a jax backend
    from lm_eval.__main__ import cli_evaluate

    from eval.processes import writes

    with contextlib.ExitStack() as quiet:
        quiet.enter_context(_index_only_include_path_when_it_suffices(argv))
        if not writes():  # the same run, its files dropped (--log_samples needs a path)
            argv = _output_path_to(argv, quiet.enter_context(tempfile.TemporaryDirectory()))
            quiet.enter_context(contextlib.redirect_stdout(quiet.enter_context(open(os.devnull, "w"))))
        saved, sys.argv = sys.argv, ["lm_eval", *argv]
        try:
            cli_evaluate()
        except (CheckpointError, ConfigError, DataError, ValueError, FileNotFoundError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        finally:
            sys.argv = saved
    return 0


if __name__ == "__main__":
    sys.exit(main())
