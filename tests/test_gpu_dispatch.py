"""The one GPU kernel dispatch (pallas_kernels/gpu_dispatch.py): what `auto` and `pallas_gpu` take with
the verified table empty, listing a kernel, and saying XLA is faster; what each named kernel does; and
the shipped table."""

import types

import pytest

from pallas_kernels import gpu_dispatch
from pallas_kernels.gpu_dispatch import Verified, choose

RAN = Verified("NVIDIA H200", "2026-12-04", "abc1234")
BOTH = {"mosaic": lambda: None, "triton": lambda: None}
HOPPER = types.SimpleNamespace(platform="gpu", compute_capability="9.0")
AMPERE = types.SimpleNamespace(platform="gpu", compute_capability="8.0")


def pick(family, impl, table, supports=BOTH, device=HOPPER, shape=None):
    return choose(family, impl, supports, table=table, device=device, shape=shape).kernel


@pytest.mark.parametrize("impl", ["auto", "pallas_gpu", "pallas"])
def test_default_takes_only_verified_kernels(impl):
    """Nothing listed: XLA, except MoBA attention, which falls back to the measured Triton kernels; a
    listed kernel is taken, Mosaic GPU first on Hopper, Triton before it; a listed kernel that does
    not take the step gives way to the next."""
    assert pick("moba_routing", impl, {}) is None
    assert pick("mla_decode", impl, {}) is None
    assert pick("moba_attention", impl, {}) == "triton"
    table = {("moba_decode", "triton"): RAN}
    assert pick("moba_decode", impl, table) == "triton"
    table[("moba_decode", "mosaic")] = RAN
    assert pick("moba_decode", impl, table) == "mosaic"
    assert pick("moba_decode", impl, table, device=AMPERE) == "triton"
    refuses = {"mosaic": lambda: "float32", "triton": lambda: None}
    assert pick("moba_decode", impl, table, supports=refuses) == "triton"
    assert pick("moba_decode", impl, {("moba_decode", "mosaic"): RAN}, supports=refuses) is None


def test_why_names_what_was_passed_over():
    choice = choose(
        "moba_routing", "pallas_gpu", BOTH, table={("moba_routing", "triton"): RAN}, device=HOPPER
    )
    assert choice.kernel == "triton"
    assert "mosaic: not verified on a GPU" in choice.why and "NVIDIA H200, 2026-12-04, abc1234" in choice.why


def test_xla_faster_bounds_apply_to_auto_only():
    """`heads` must equal, any other bound is a most; pallas_gpu ignores the bounds."""
    entry = Verified("H200", "-", "-", xla_faster=(dict(heads=16, batch=4, length=8192),))
    table = {("mla_decode", "triton"): entry}
    at = lambda **shape: pick("mla_decode", "auto", table, shape=shape)
    assert at(heads=16, batch=4, length=8192) is None
    assert at(heads=16, batch=1, length=100) is None
    assert at(heads=128, batch=1, length=100) == "triton"
    assert at(heads=16, batch=5, length=100) == "triton"
    assert at(heads=16, batch=4, length=8193) == "triton"
    assert pick("mla_decode", "pallas_gpu", table, shape=dict(heads=16, batch=1, length=1)) == "triton"


def test_named_kernels_run_or_refuse_in_one_line():
    """pallas_mosaic / pallas_triton take their kernel, listed or not, or refuse naming why, the same
    for every family; Mosaic GPU needs a Hopper."""
    for family in gpu_dispatch.FAMILIES:
        assert pick(family, "pallas_mosaic", {}) == "mosaic"
        assert pick(family, "pallas_triton", {}) == "triton"
        refuses = {"mosaic": lambda: "takes bfloat16 or float16 inputs, got float32", "triton": lambda: None}
        with pytest.raises(
            ValueError, match=r"^pallas_mosaic cannot run .* here: takes bfloat16.*; use pallas_triton$"
        ):
            pick(family, "pallas_mosaic", {}, supports=refuses)
    with pytest.raises(ValueError, match="need a Hopper GPU .*compute capability 8.0"):
        pick("moba_attention", "pallas_mosaic", {}, device=AMPERE)
    with pytest.raises(ValueError, match="kernel family must be one of"):
        pick("dsa", "auto", {})
    with pytest.raises(ValueError, match="impl must be"):
        pick("mla_decode", "pallas_tpu", {})


def test_shipped_table_lists_only_kernels_that_ran_on_a_gpu():
    """Today: the Triton own/selected-block MoBA kernels, from the H200 run at 3d20a84."""
    assert {
        ("moba_attention", "triton"): Verified("NVIDIA H200", "2026-12-04", "3d20a84")
    } == gpu_dispatch.VERIFIED
    assert gpu_dispatch.capability(types.SimpleNamespace(platform="cpu")) == "9.0"  # an AOT export's target
