"""The training loop: resume, step, log, validate, checkpoint, handle preemption.

The last line printed by a completed run is
`val_loss=<float> unigram_loss=<float> run_dir=<path>`; a run stopped by
SIGTERM/SIGINT finishes its step, checkpoints, prints
`preempted step=<n> run_dir=<path>` and exits with status 143.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from tqdm import tqdm

from effattn_jax import checkpoint, storage
from effattn_jax.checkpoint.store import unwritable
from effattn_jax.config import MESH_AXES, Config, ConfigError
from effattn_jax.data.pipeline import build_corpus, train_iterator, unigram_loss, val_batches
from effattn_jax.flops import peak_flops, train_flops_per_token
from effattn_jax.memory import DoesNotFit, check_fits
from effattn_jax.model import param_counts
from effattn_jax.sharding import config_mesh
from effattn_jax.storage import AnyPath
from effattn_jax.train import run_dir as run_guard
from effattn_jax.train.gpu_kernels import check_gpu_kernels, runs_gpu_kernels
from effattn_jax.train.init_from import checked_source, init_params
from effattn_jax.train.metrics import ScalarWriter
from effattn_jax.train.nonfinite import FiniteCheck, NonFiniteError
from effattn_jax.train.notices import start_notices
from effattn_jax.train.preemption import Preempted, StopFlag, exit_preempted
from effattn_jax.train.profile import Profiler
from effattn_jax.train.provenance import record_provenance
from effattn_jax.train.state import init_state, make_setup
from effattn_jax.train.step import make_eval_step, make_train_step
from effattn_jax.train.throughput import FinishedStepBar, Throughput

# NonFiniteError and Preempted end a run from here: train.py and the tests catch them by this module
__all__ = ["NonFiniteError", "Preempted", "compile_train_step", "evaluate", "final_line", "run"]


def _to_global(batch: dict, sharding) -> dict:
    return {k: jax.make_array_from_process_local_data(sharding, v) for k, v in batch.items()}


def evaluate(eval_step, params, batches, sharding) -> float:
    """Mean token NLL over the validation batches."""
    total, count = 0.0, 0.0
    for batch in batches:
        loss_sum, tokens = eval_step(params, _to_global(batch, sharding))
        total, count = total + float(loss_sum), count + float(tokens)
    return total / max(count, 1.0)


@dataclass
class _Phase:
    """The compiled steps and model FLOPs of one attention setting: the configured cores,
    or every MoBA layer dense after a schedule switch (same parameter tree)."""

    train_step: Callable
    eval_step: Callable
    flops_per_token: float


def _phase_schedule(cfg: Config, setup, train_step, non_embedding_params: int) -> Callable[[int], _Phase]:
    """step -> the phase that runs it (one phase unless `moba.full_attention_from_*` is set)."""
    configured = _Phase(train_step, make_eval_step(setup), train_flops_per_token(cfg, non_embedding_params))
    switch_at = cfg.full_attention_from_step
    if not switch_at:
        return lambda step: configured
    dense_cfg = cfg.with_full_attention()
    dense_setup = make_setup(dense_cfg, setup.mesh)
    dense = _Phase(
        make_train_step(dense_setup),
        make_eval_step(dense_setup),
        train_flops_per_token(dense_cfg, non_embedding_params),
    )
    return lambda step: dense if step >= switch_at else configured


def run(cfg: Config, *, stop_at: int | None = None) -> dict:
    """Trains (or resumes) the run in `cfg.train.run_dir`; returns its final metrics.

    `stop_at`: behave as if preempted after that step (for tests and external schedulers).
    The directory is locked for the run (one writer) and a resumed run must keep its config
    (effattn_jax/train/run_dir.py), both checked before anything in it is written."""
    run_dir = storage.path(cfg.train.run_dir)
    if why := storage.unreachable(run_dir):  # in seconds, before anything compiles
        raise ConfigError("train.run_dir", str(run_dir), why)
    corpus = build_corpus(cfg.data)
    if corpus.vocab_size > cfg.model.vocab_size:
        raise ConfigError(
            "model.vocab_size", cfg.model.vocab_size, f"must be >= the tokenizer's {corpus.vocab_size} tokens"
        )
    try:
        mesh = config_mesh(cfg.mesh)
    except ValueError as e:
        sizes = "x".join(str(getattr(cfg.mesh, axis)) for axis in MESH_AXES)
        raise ConfigError(f"mesh ({'x'.join(MESH_AXES)})", sizes, str(e)) from None
    if runs_gpu_kernels(cfg.moba.impl):  # before anything compiles: one line if they cannot run
        check_gpu_kernels(cfg, jax.devices()[0], interpret=jax.default_backend() != "gpu")
    setup = make_setup(cfg, mesh)
    init = checked_source(cfg, setup)
    train_step = compile_train_step(setup)  # DoesNotFit before the run directory is touched
    if why := unwritable(run_dir):
        raise ConfigError("train.run_dir", str(run_dir), f"cannot be written ({why})")
    checkpoint.check_writable(run_dir / "checkpoints")
    with run_guard.exclusive(run_dir) if jax.process_index() == 0 else contextlib.nullcontext():
        if not cfg.train.resume and jax.process_index() == 0:
            run_guard.set_aside(run_dir)
        checkpoint.sync("old run set aside")
        run_guard.check_resumable(checkpoint.saved_config(run_dir), cfg)
        if jax.process_index() == 0:
            record_provenance(run_dir, cfg)
        checkpoint.sync("run directory ready")
        return _train(cfg, corpus, setup, train_step, run_dir, stop_at, init)


def compile_train_step(setup) -> Callable:
    """The configured train step, compiled ahead of time and checked against the memory of its
    devices (DoesNotFit, one line naming the knobs, when it cannot fit)."""
    cfg = setup.cfg
    knobs = (
        f"a smaller data.batch_size ({cfg.data.batch_size}; train.grad_accum keeps the global batch) or "
        f"data.seq_len ({cfg.data.seq_len}), model.remat=true, or more devices in mesh.fsdp / mesh.tensor"
    )
    try:
        compiled = make_train_step(setup).lower(setup.abstract_state, setup.abstract_batch()).compile()
    except jax.errors.JaxRuntimeError as e:  # an accelerator's compiler may refuse it outright
        if "RESOURCE_EXHAUSTED" not in str(e):
            raise
        raise DoesNotFit(
            f"the train step does not fit: {str(e).splitlines()[0][:200]}; to fit: {knobs}"
        ) from None
    local = [d for d in setup.mesh.devices.flat if d.process_index == jax.process_index()]
    check_fits(compiled, local, "the train step", knobs)
    return compiled


def _start_state(checkpoints, setup, data_iter, init: tuple[str, int] | None) -> tuple[int, dict, bool]:
    """(step, state, resumed): the run's newest good checkpoint (parameters only, as a converted
    model's step 0: with a fresh optimizer state), else step 0 from `train.init_from`'s
    parameters or a fresh initialization."""
    step, state = checkpoints.restore_latest(setup.abstract_state, data_iter)
    if state is None:
        return 0, init_state(setup, init_params(setup, init) if init else None), False
    if state["opt_state"] is None:
        state = init_state(setup, state["params"]) | {"step": jnp.asarray(step, jnp.int32)}
    return step, state, True


def _train(
    cfg: Config,
    corpus,
    setup,
    train_step,
    run_dir: AnyPath,
    stop_at: int | None,
    init: tuple[str, int] | None,
) -> dict:
    train_cfg, data_cfg, ckpt_cfg = cfg.train, cfg.data, cfg.checkpoint
    mesh = setup.mesh

    process = {"process_index": jax.process_index(), "process_count": jax.process_count()}
    data_iter = train_iterator(corpus.train, batch_size=data_cfg.batch_size, seed=data_cfg.seed, **process)
    val = list(
        val_batches(corpus.val, batch_size=data_cfg.batch_size, max_batches=cfg.eval.max_batches, **process)
    )
    checkpoints = checkpoint.Checkpoints(
        run_dir, keep_last=ckpt_cfg.keep_last, keep_every=ckpt_cfg.keep_every, async_save=ckpt_cfg.async_save
    )
    step, state, resumed = _start_state(checkpoints, setup, data_iter, init)

    counts = param_counts(setup.model(state["params"]))
    phase_at = _phase_schedule(cfg, setup, train_step, counts["non_embedding"])
    lead = jax.process_index() == 0  # logs, progress and TensorBoard come from process 0 only
    log = (lambda msg: print(msg, file=sys.stderr)) if lead else (lambda msg: None)
    log(
        f"params: {counts['total']:,} ({counts['non_embedding']:,} non-embedding); "
        f"{phase_at(step).flops_per_token / 1e6:.1f} MFLOP/token; mesh {dict(mesh.shape)}"
        + (f"; {jax.process_count()} processes" if jax.process_count() > 1 else "")
    )
    for line in start_notices(cfg):
        log(line)
    batch_sharding = setup.batch_sharding()
    device_peak = peak_flops(mesh.devices.flat[0].device_kind)  # MFU: the whole mesh's peak, where known
    peak = device_peak * mesh.devices.size if device_peak else None
    writer = ScalarWriter(run_dir, enabled=lead)
    stop = StopFlag()
    stop.install()  # before the "resumed" line: a signal from then on is a clean preemption
    if resumed:
        log(f"resumed from step {step} in {run_dir}")
    elif init:
        log(f"started from the parameters of {init[0]} step {init[1]} (train.init_from)")
    bar = tqdm(
        total=train_cfg.steps,
        initial=step,
        disable=not (train_cfg.progress and lead),
        dynamic_ncols=True,
        desc="train",
        file=sys.stderr,
    )
    profiler = Profiler(train_cfg.profile_steps, run_dir)
    finite = FiniteCheck(train_cfg.nonfinite, run_dir / "checkpoints", last_saved=step)

    def save() -> None:
        finite.check(step, state)  # what is saved is finite
        checkpoints.save(step, state, data_iter, cfg.to_dict())
        finite.last_saved = step

    try:
        throughput = Throughput(step, data_cfg.batch_size * data_cfg.seq_len, peak, writer, bar)
        finished = FinishedStepBar(bar)
        while step < train_cfg.steps:
            profiler.before(step)
            phase = phase_at(step)
            state, metrics = phase.train_step(state, _to_global(next(data_iter), batch_sharding))
            step += 1
            finite.add(step, metrics["nonfinite"])
            finished.dispatched(metrics["loss"])
            profiler.after(step, state)
            if step % train_cfg.log_every == 0 or step == train_cfg.steps:
                finished.finish()
                finite.check(step)
                skipped = len(corpus.train.skipped | corpus.val.skipped)
                counters = {"nonfinite_steps": finite.steps, "skipped_records": skipped}
                throughput.log(step, metrics, phase.flops_per_token, counters)
            if step % cfg.eval.every_steps == 0 and step < train_cfg.steps:
                val_loss = evaluate(phase_at(step).eval_step, state["params"], val, batch_sharding)
                writer.scalars(step, {"val_loss": val_loss})
                writer.flush()
                throughput.pause_ended(step)
            preempt = stop.reached(step) or step == stop_at
            if step % ckpt_cfg.every_steps == 0 or step == train_cfg.steps or preempt:
                save()
            if preempt:
                finished.finish()
                checkpoints.finish()
                bar.close()
                writer.close()
                exit_preempted(step, run_dir)
        bar.close()  # the last step logged and saved inside the loop
        val_loss = evaluate(phase_at(step).eval_step, state["params"], val, batch_sharding)
        writer.scalars(step, {"val_loss": val_loss})
        # on the whole validation set (the same rows as val_loss), not this process's share
        val_rows = val_batches(corpus.val, batch_size=data_cfg.batch_size, max_batches=cfg.eval.max_batches)
        unigram = unigram_loss(corpus.train_token_counts, val_rows)
        checkpoints.finish()
    finally:
        stop.restore()
        writer.close()
        checkpoints.close()
    return {
        "val_loss": val_loss,
        "unigram_loss": unigram,
        "run_dir": str(run_dir),
        "step": step,
        "flops_per_token": phase_at(step).flops_per_token,
    }


def final_line(result: dict) -> str:
    losses = f"val_loss={result['val_loss']:.4f} unigram_loss={result['unigram_loss']:.4f}"
    return f"{losses} run_dir={result['run_dir']}"
