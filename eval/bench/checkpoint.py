"""What checkpointing costs: save (blocking part and total), the checksum manifest, verify +
restore, the non-finite check before each save, and training throughput with checkpoints every
N steps against none, alternated in one process.

    python -m eval.bench.checkpoint --config configs/cpu/default.yaml [key=value ...] [--every 10]

Saves go to a temporary directory on the same disk as the system temp dir. Throughput is
measured on synthetic batches with the real train step; each setting runs `--steps` steps,
the two settings alternate `--repeats` times, medians are reported. The last save is `--every`
steps before the end, and the time includes waiting for it to complete, as a run's next save
would.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp

from effattn_jax import checkpoint, checksums
from effattn_jax.cli import ArgumentParser, positive_int
from effattn_jax.config import load_config
from effattn_jax.model import param_counts
from effattn_jax.sharding import make_mesh
from effattn_jax.train.state import init_state, make_setup
from effattn_jax.train.step import all_finite, make_train_step
from eval.bench.common import synthetic_batch


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def _size(step_dir: Path) -> int:
    return sum(p.stat().st_size for p in step_dir.rglob("*") if p.is_file())


def _filled(state):
    """The state with its all-zero float arrays (a fresh optimizer's moments) made random, so the
    checkpoint is as large as a trained run's (zeros compress to almost nothing)."""
    keys = iter(jax.random.split(jax.random.key(0), len(jax.tree.leaves(state))))

    def fill(x):
        key = next(keys)
        if jnp.issubdtype(x.dtype, jnp.floating) and x.size > 1 and not bool(jnp.any(x)):
            return (1e-3 * jnp.abs(jax.random.normal(key, x.shape))).astype(x.dtype)  # nu >= 0
        return x

    return jax.tree.map(fill, state)


def save_restore_times(cfg, setup, state, root: Path, repeats: int) -> dict[str, float]:
    """Seconds (medians): save call, save to checksummed, manifest alone, verify alone, restore."""
    rows = {k: [] for k in ("all_finite", "save_blocking", "save_total", "manifest", "verify", "restore")}
    finite = jax.jit(all_finite)
    finite(state).block_until_ready()
    for r in range(repeats):
        ckpts = checkpoint.Checkpoints(root / f"r{r}", keep_last=1, async_save=True)
        rows["all_finite"].append(_timed(lambda: bool(finite(state))))
        t = time.perf_counter()
        ckpts.save(1, state, None, cfg.to_dict())
        rows["save_blocking"].append(time.perf_counter() - t)
        ckpts.finish()
        rows["save_total"].append(time.perf_counter() - t)
        step_dir = root / f"r{r}" / "checkpoints" / "1"
        rows["manifest"].append(_timed(lambda d=step_dir: checksums.write_manifest(d)))
        rows["verify"].append(_timed(lambda d=step_dir: checksums.verify(d)))
        rows["restore"].append(
            _timed(lambda c=ckpts: jax.block_until_ready(c.restore_latest(setup.abstract_state)))
        )
        ckpts.close()
    out = {k: statistics.median(v) for k, v in rows.items()}
    out["bytes"] = _size(root / "r0" / "checkpoints" / "1")
    return out


def throughput(cfg, setup, state, root: Path, steps: int, every: int, repeats: int) -> dict[str, float]:
    """Median steps/s without checkpoints and with one every `every` steps (async), alternated."""
    step_fn = make_train_step(setup)
    batch = jax.device_put(synthetic_batch(cfg.data.batch_size, cfg.data.seq_len), setup.batch_sharding())
    state, _ = step_fn(state, batch)  # compiled
    jax.block_until_ready(state)
    rates = {"none": [], "every": []}
    for r in range(repeats):
        for mode in ("none", "every"):
            ckpts = checkpoint.Checkpoints(root / f"t{r}{mode}", keep_last=2, async_save=True)
            t = time.perf_counter()
            for i in range(1, steps + 1):
                state, metrics = step_fn(state, batch)
                if mode == "every" and i % every == 0 and i < steps:  # a save overlaps the steps after it
                    assert bool(all_finite(state))
                    ckpts.save(i, state, None, cfg.to_dict())
            jax.block_until_ready(state)
            ckpts.finish()
            rates[mode].append(steps / (time.perf_counter() - t))
            ckpts.close()
    return {k: statistics.median(v) for k, v in rates.items()}


def main(argv=None) -> int:
    p = ArgumentParser(prog="python -m eval.bench.checkpoint", description=__doc__)
    p.add_argument("--config", required=True)
    p.add_argument("--every", type=positive_int, default=10, help="checkpoint every N steps")
    p.add_argument(
        "--steps", type=positive_int, default=40, help="steps per throughput measurement (0: skip)"
    )
    p.add_argument("--repeats", type=positive_int, default=3)
    p.add_argument("--no-throughput", action="store_true", help="save/restore times only")
    p.add_argument("overrides", nargs="*")
    args = p.parse_args(argv)
    cfg = load_config(args.config, args.overrides)
    setup = make_setup(cfg, make_mesh(1, 1, 1))
    state = _filled(init_state(setup))
    counts = param_counts(setup.model(state["params"]))
    print(
        f"{args.config} {' '.join(args.overrides)}: {counts['total'] / 1e6:.1f}M params; "
        f"jax {jax.__version__}"
    )
    with tempfile.TemporaryDirectory(prefix="effattn-bench-ckpt-") as tmp:
        t = save_restore_times(cfg, setup, state, Path(tmp), args.repeats)
        print(
            f"checkpoint {t['bytes'] / 1e6:.1f} MB | all_finite {t['all_finite'] * 1e3:.1f} ms | "
            f"save blocking {t['save_blocking'] * 1e3:.0f} ms | save total {t['save_total'] * 1e3:.0f} ms | "
            f"manifest {t['manifest'] * 1e3:.0f} ms | verify {t['verify'] * 1e3:.0f} ms | "
            f"verify+restore {t['restore'] * 1e3:.0f} ms",
            flush=True,
        )
        if not args.no_throughput:
            r = throughput(cfg, setup, state, Path(tmp), args.steps, args.every, args.repeats)
            print(
                f"steps/s: no checkpoints {r['none']:.3f} | every {args.every} steps {r['every']:.3f} | "
                f"cost {100 * (1 - r['every'] / r['none']):.1f}%"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
