"""What checkpointing costs: save (blocking part and total), the checksum manifest, verify +
restore, the non-finite check before each save, and training throughput with checkpoints every
N steps against none, alternated in one process.

    python -m eval.bench.checkpoint --config configs/cpu/default.yaml [key=value ...] [--every 10] [--json]

Saves go to a temporary directory on the same disk as the system temp dir. Throughput is
measured on synthetic batches with the real train step; each setting runs `--steps` steps,
the two settings alternate `--repeats` times, medians are reported (eval/timing.py). The last
save is `--every` steps before the end, and the time includes waiting for it to complete, as a
run's next save would, and opening and closing the measurement's checkpoint directory (about a
millisecond). `--json` prints {params, save: {bytes, all_finite, save_blocking,
save_total, manifest, verify, restore} (seconds), steps_per_s: {none, every} (absent with
--no-throughput), every}.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp

from effattn_jax import checkpoint, checksums
from effattn_jax.cli import positive_int
from effattn_jax.config import load_config
from effattn_jax.model import param_counts
from effattn_jax.sharding import make_mesh
from effattn_jax.train.state import init_state, make_setup
from effattn_jax.train.step import all_finite, make_train_step
from eval.bench import common
from eval.timing import Carry, alternated, carried


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
    finite = jax.jit(all_finite)
    finite(state).block_until_ready()
    rounds = iter(range(repeats))

    def one_round() -> dict[str, float]:
        r = next(rounds)
        ckpts = checkpoint.Checkpoints(root / f"r{r}", keep_last=1, async_save=True)
        out = {"all_finite": _timed(lambda: bool(finite(state)))}
        t = time.perf_counter()
        ckpts.save(1, state, None, cfg.to_dict())
        out["save_blocking"] = time.perf_counter() - t
        ckpts.finish()
        out["save_total"] = time.perf_counter() - t
        step_dir = root / f"r{r}" / "checkpoints" / "1"
        out["manifest"] = _timed(lambda: checksums.write_manifest(step_dir))
        out["verify"] = _timed(lambda: checksums.verify(step_dir))
        out["restore"] = _timed(lambda: jax.block_until_ready(ckpts.restore_latest(setup.abstract_state)))
        ckpts.close()
        return out

    out = alternated({"save": one_round}, repeats, warmup=0)
    return out | {"bytes": _size(root / "r0" / "checkpoints" / "1")}


def throughput(cfg, setup, state, root: Path, steps: int, every: int, repeats: int) -> dict[str, float]:
    """Median steps/s without checkpoints and with one every `every` steps (async), alternated, the
    train state carried from measurement to measurement."""
    step_fn = make_train_step(setup)
    batch = common.synthetic_batch(cfg.data.batch_size, cfg.data.seq_len)
    batch = jax.device_put(batch, setup.batch_sharding())
    run = Carry(step_fn(state, batch)[0])  # compiled
    jax.block_until_ready(run.value)
    rounds = iter(range(2 * repeats))

    def steps_per_s(mode: str):
        def train(state):
            ckpts = checkpoint.Checkpoints(root / f"t{next(rounds)}{mode}", keep_last=2, async_save=True)
            for i in range(1, steps + 1):
                state, _ = step_fn(state, batch)
                if mode == "every" and i % every == 0 and i < steps:  # a save overlaps the steps after it
                    assert bool(all_finite(state))
                    ckpts.save(i, state, None, cfg.to_dict())
            jax.block_until_ready(state)
            ckpts.finish()
            ckpts.close()
            return state, None  # waited for above

        measure = carried(train, run)
        return lambda: steps / measure()

    return alternated({mode: steps_per_s(mode) for mode in ("none", "every")}, repeats, warmup=0)


def main(argv=None) -> int:
    p = common.parser(__doc__, __file__)
    p.add_argument("--config", required=True)
    p.add_argument("--every", type=positive_int, default=10, help="checkpoint every N steps")
    p.add_argument("--steps", type=positive_int, default=40, help="steps per throughput measurement")
    p.add_argument("--repeats", type=positive_int, default=3)
    p.add_argument("--no-throughput", action="store_true", help="save/restore times only")
    p.add_argument("overrides", nargs="*")
    args = p.parse_args(argv)
    cfg = load_config(args.config, args.overrides)
    with common.report(args, f"{args.config} {' '.join(args.overrides)}".strip()) as emit:
        emit(measure(cfg, args))
    return 0


def measure(cfg, args) -> dict:
    """Every figure, printed as it is known; the dict --json prints."""
    setup = make_setup(cfg, make_mesh(1, 1, 1))
    state = _filled(init_state(setup))
    counts = param_counts(setup.model(state["params"]))
    print(f"{counts['total'] / 1e6:.1f}M params")
    out = {"params": counts["total"], "every": args.every}
    with tempfile.TemporaryDirectory(prefix="effattn-bench-ckpt-") as tmp:
        t = out["save"] = save_restore_times(cfg, setup, state, Path(tmp), args.repeats)
        ms = {k: v * 1e3 for k, v in t.items()}
        print(
            f"checkpoint {t['bytes'] / 1e6:.1f} MB | all_finite {ms['all_finite']:.1f} ms | "
            f"save blocking {ms['save_blocking']:.0f} ms | save total {ms['save_total']:.0f} ms | "
            f"manifest {ms['manifest']:.0f} ms | verify {ms['verify']:.0f} ms | "
            f"verify+restore {ms['restore']:.0f} ms",
            flush=True,
        )
        if not args.no_throughput:
            r = throughput(cfg, setup, state, Path(tmp), args.steps, args.every, args.repeats)
            out["steps_per_s"] = r
            print(
                f"steps/s: no checkpoints {r['none']:.3f} | every {args.every} steps {r['every']:.3f} | "
                f"cost {100 * (1 - r['every'] / r['none']):.1f}%"
            )
    return out


if __name__ == "__main__":
    raise SystemExit(main())
