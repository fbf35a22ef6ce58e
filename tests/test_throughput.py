"""The tokens/s a run logs: training time only, the steps counted against the time they took."""

import types

from effattn_jax.train import throughput


def test_the_log_after_an_evaluation_counts_only_the_steps_after_it(monkeypatch):
    """Log at step 100; 10 steps of 1 s; an evaluation of 100 s; 10 steps of 1 s; log at step 120: 10
    steps over 10 s, not 20 over 10 s. Catches: the timer reset by the pause but not the step count
    (the first log after each evaluation 2x or more too fast)."""
    clock = iter([0.0, 110.0, 120.0])
    monkeypatch.setattr(throughput.time, "perf_counter", lambda: next(clock))
    logged = {}
    writer = types.SimpleNamespace(scalars=lambda step, s: logged.update(s))
    bar = types.SimpleNamespace(set_postfix=lambda **_: None)
    meter = throughput.Throughput(100, tokens_per_step=1000, peak=None, writer=writer, bar=bar)
    meter.pause_ended(110)  # the evaluation ran from 10 s to 110 s, after step 110
    meter.log(120, {"loss": 1.0, "lr": 0.1, "grad_norm": 1.0}, flops_per_token=1.0, counters={})
    assert logged["tokens_per_sec"] == 1000.0


def test_the_progress_bar_counts_only_finished_steps():
    """Dispatches a chain of slow steps (each a few large matmuls on the last one's output, so jax
    queues them): every step the bar has counted is done. Catches: the bar moved at dispatch, whose
    rate is the queueing rate (10 it/s shown against a real 3 s/it)."""
    import jax
    import jax.numpy as jnp

    @jax.jit
    def step(x):
        for _ in range(4):
            x = jnp.tanh(x @ x)
        return x

    counted = types.SimpleNamespace(n=0)
    bar = throughput.FinishedStepBar(
        types.SimpleNamespace(update=lambda k: setattr(counted, "n", counted.n + k))
    )
    x = step(jnp.eye(768) * 0.5).block_until_ready()  # compiled before the clock matters
    outputs = []
    for _ in range(4):
        x = step(x)
        outputs.append(x)
        bar.dispatched(x)
        assert counted.n == len(outputs) - 1
        assert all(o.is_ready() for o in outputs[: counted.n])
    bar.finish()
    assert counted.n == 4 and outputs[-1].is_ready()
