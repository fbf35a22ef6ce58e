"""The fit check: a compiled program's memory against what its device has, before it runs."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from effattn_jax import memory
from effattn_jax.memory import DoesNotFit, check_fits, device_capacity, fit_checked, program_bytes
from eval.bench import attention as bench_attention


def _outer_sorted(x):
    return jnp.sort(jnp.outer(x, x).ravel())  # materialises [n, n]


def test_capacity_and_estimate_on_cpu():
    """Catches: a capacity that ignores the CPU devices sharing the host's memory, an estimate that
    misses the temporaries."""
    device = jax.local_devices()[0]
    one, _ = device_capacity(device)
    four, where = device_capacity(device, sharing=4)
    assert 0 < four <= one // 4 * 1.1 and "4 CPU devices" in where
    small = jax.jit(_outer_sorted).lower(jnp.ones(1000)).compile()
    assert program_bytes(small) >= 1000 * 1000 * 4


def test_a_program_larger_than_memory_is_refused_before_it_runs():
    """[200k, 200k] float32 (160 GB) cannot fit this machine: DoesNotFit names the program, the
    estimate, the capacity and the knobs; nothing is allocated. Catches: a check that only runs after
    the allocation fails."""
    big = jax.jit(_outer_sorted).lower(jax.ShapeDtypeStruct((200_000,), jnp.float32)).compile()
    with pytest.raises(
        DoesNotFit, match=r"the sort needs [\d,.]+ GiB per device, more than the .* to fit: less"
    ):
        check_fits(big, jax.local_devices()[:1], "the sort", "less")
    checked = fit_checked(jax.jit(_outer_sorted), "the sort", "less")
    np.testing.assert_array_equal(checked(jnp.arange(3.0)), _outer_sorted(jnp.arange(3.0)))
    with pytest.raises(DoesNotFit):
        checked(jnp.ones(200_000))


def test_a_cpu_program_is_refused_where_its_real_peak_would_not_fit(monkeypatch):
    """On a CPU the resident peak runs up to 1.95x XLA's estimate (BENCHMARKS.md), so an estimate of
    two thirds of the available RAM is refused. Catches: a check against the raw RAM that lets a run
    through to the OOM killer (dense attention at 16K on a 24 GiB machine)."""
    small = jax.jit(_outer_sorted).lower(jnp.ones(1000)).compile()
    need = program_bytes(small)
    monkeypatch.setattr(memory, "_available_ram", lambda: int(1.5 * need))
    with pytest.raises(DoesNotFit, match=r"available RAM / 2.5 \(a CPU's peak exceeds XLA's estimate\)"):
        check_fits(small, jax.local_devices()[:1], "the sort", "less")
    monkeypatch.setattr(memory, "_available_ram", lambda: 3 * need)
    assert check_fits(small, jax.local_devices()[:1], "the sort", "less") == need


def _counting_checks(monkeypatch) -> list:
    seen = []
    real = memory.check_fits
    monkeypatch.setattr(
        memory, "check_fits", lambda compiled, *a: seen.append(compiled) or real(compiled, *a)
    )
    return seen


def test_fit_checked_checks_each_new_dtype(monkeypatch):
    """Catches: a cache keyed on shapes alone, where a wider dtype at the same shape (twice the bytes)
    runs unchecked."""
    seen = _counting_checks(monkeypatch)
    checked = fit_checked(jax.jit(_outer_sorted), "the sort", "less")
    for dtype in (jnp.float32, jnp.bfloat16, jnp.float32):
        checked(jnp.ones(8, dtype))
    assert len(seen) == 2


def test_fit_checked_takes_array_and_static_keywords(monkeypatch):
    """Catches: the cache key's set difference over keyword items, which hashes each value and raised
    TypeError for an array keyword; a static keyword's new value must be checked again."""
    seen = _counting_checks(monkeypatch)
    fn = jax.jit(lambda x, *, y, n: jnp.tile(x + y, n), static_argnames="n")
    checked = fit_checked(fn, "the tile", "less", static_argnames=("n",))
    np.testing.assert_array_equal(checked(jnp.ones(3), y=jnp.ones(3), n=2), 2 * np.ones(6))
    checked(jnp.ones(3), y=jnp.zeros(3), n=2)
    checked(jnp.ones(3), y=jnp.zeros(3), n=3)
    assert len(seen) == 2


@pytest.mark.slow  # compiles MoBA at 128K
def test_bench_attention_skips_a_case_that_cannot_fit(capsys):
    """The case is reported as skipped and the rest of the table prints. Catches: the kernel's OOM
    killer ending the benchmark (dense attention at 128K tokens needs 64 GiB of logits alone)."""
    args = [
        "--seqs",
        "131072,256",
        "--heads",
        "1",
        "--head-dim",
        "8",
        "--block-size",
        "64",
        "--repeats",
        "1",
        "--programs",
        "dense,moba",
    ]
    bench_attention.main(args)
    rows = [r for r in capsys.readouterr().out.splitlines() if r.startswith("| ")]
    assert rows[-2].startswith("| 131072 | skipped: dense at 131072 needs") and "a shorter --seqs" in rows[-2]
    assert rows[-1].startswith("| 256 | ") and "skipped" not in rows[-1]
