"""Train a language model: `python train.py --config configs/<file>.yaml key.sub=value ...`

Rerunning the same command resumes from the run directory's last checkpoint. Several processes
(a TPU pod slice, multi-GPU hosts, or `python -m effattn_jax.launch` here) join through
jax.distributed: see effattn_jax/launch.py.
Exit status: 0 done, 1 non-finite loss (train.nonfinite=stop) or a dry run that does not fit its
chips, 2 bad config or data (or a run that cannot fit in memory), 3 a checkpoint that cannot be
written (no space, no permission: fix the directory and rerun to resume from the last good step),
143 preempted (SIGTERM/SIGINT).
"""

from __future__ import annotations

import os
import sys

SAVE_FAILED = 3


def main(argv: list[str] | None = None) -> int:
    from effattn_jax.cli import ArgumentParser

    parser = ArgumentParser(description=__doc__)
    parser.add_argument("--config", help="YAML config (may name a `base:` file)")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.steps=100")
    args = parser.parse_args(argv)

    from effattn_jax.config import ConfigError, load_config
    from effattn_jax.data.corpus import DataError

    def user_error(e) -> int:
        print(str(e) if isinstance(e, ConfigError) else f"data error: {e}", file=sys.stderr)
        return 2

    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as e:
        return user_error(e)
    if cfg.train.dry_run:
        from effattn_jax.train.dry_run import dry_run

        try:
            report = dry_run(cfg)
        except ConfigError as e:
            return user_error(e)
        return 0 if report.get("fits", True) else 1
    from effattn_jax import launch
    from effattn_jax.checkpoint import SaveError
    from effattn_jax.memory import DoesNotFit
    from effattn_jax.train.loop import NonFiniteError, final_line, run

    try:
        launch.initialize(cfg.distributed)
        result = run(cfg)
    except (ConfigError, DataError) as e:
        return user_error(e)
    except DoesNotFit as e:
        print(f"memory error: {e}", file=sys.stderr)
        return 2
    except NonFiniteError as e:
        print(f"stopped: {e}", file=sys.stderr)
        return 1
    except SaveError as e:
        print(f"checkpoint error: {e}", file=sys.stderr)
        return SAVE_FAILED
    import jax

    if jax.process_index() == 0:
        print(final_line(result), flush=True)
    return 0


if __name__ == "__main__":
    status = main()
    if status == SAVE_FAILED:
        # Orbax's threads may still retry the failed write and would hold the exit for minutes;
        # the run's lock, metrics and checkpoints are already closed, so nothing of theirs is wanted
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)
    sys.exit(status)
