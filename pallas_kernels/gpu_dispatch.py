"""Which GPU kernel runs, decided in one place: for a kernel family (MoBA attention, its routing,
MoBA decode, MLA decode), an `impl`, a device and the step's shapes and dtypes, `choose` answers
Mosaic GPU, Triton or XLA, and why not the others.

Only kernels a GPU has verified are defaults. VERIFIED lists each (family, Pallas GPU backend) with
the device, date and commit of the GPU suite's correctness run that passed on it
(`python -m eval.bench.gpu_suite --sections correctness,...`); `auto` and `pallas_gpu` take a listed
kernel that supports the step (Mosaic GPU first on Hopper: wgmma and TMA need sm_90a; Triton
elsewhere), and otherwise XLA, or for MoBA attention the Triton kernels (measured on a GPU). An entry
also says where XLA measured faster, and there `auto` takes XLA. `pallas_mosaic` / `pallas_triton`
run the kernels they name whether listed or not, or refuse in one line.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from pallas_kernels.gpu_memory import DEFAULT_CAPABILITY

GPU_BACKENDS = ("mosaic", "triton")
FAMILIES = {  # family -> (what it is called in a refusal, what `pallas_gpu` falls back to: None is XLA)
    "moba_attention": ("MoBA attention", "triton"),
    "moba_routing": ("MoBA routing", None),
    "moba_decode": ("MoBA decode", None),
    "mla_decode": ("MLA decode", None),
}


@dataclasses.dataclass(frozen=True)
class Verified:
    """A GPU suite correctness run that passed: where and at what commit. `xla_faster`: shapes at which
    the suite measured XLA faster, each a dict of bounds (`heads`: equal; any other key: at most), where
    `auto` takes XLA."""

    device: str
    date: str
    commit: str
    xla_faster: tuple[dict[str, int], ...] = ()


# (family, backend) -> the run that verified it. The Triton own/selected-block kernels ran on an H200 at
# tiles 64/64/64 (BENCHMARKS.md, "GPU"); nothing else has run on a GPU yet.
VERIFIED: dict[tuple[str, str], Verified] = {
    ("moba_attention", "triton"): Verified("NVIDIA H200", "2026-12-04", "3d20a84"),
}


@dataclasses.dataclass(frozen=True)
class Choice:
    """`kernel`: "mosaic", "triton", or None (the XLA path); `why`: one line on why this one."""

    kernel: str | None
    why: str


def capability(device=None) -> str:
    """The CUDA compute capability of `device` (default: this process's first device); anything but
    a GPU (an AOT export for CUDA, an interpreted run) gets an H100/H200's."""
    import jax

    device = device or jax.devices()[0]
    found = getattr(device, "compute_capability", None) if device.platform == "gpu" else None
    return str(found or DEFAULT_CAPABILITY)


def _hopper(cap: str) -> str | None:
    major = cap.split(".")[0]
    return (
        None
        if major == "9"
        else f"Mosaic GPU kernels need a Hopper GPU (sm_90a), not compute capability {cap}"
    )


def _faster_in_xla(entry: Verified, shape: dict[str, int]) -> bool:
    def within(bound):
        return all(
            key in shape and (shape[key] == most if key == "heads" else shape[key] <= most)
            for key, most in bound.items()
        )

    return any(within(bound) for bound in entry.xla_faster)


def choose(
    family: str,
    impl: str,
    supports: dict[str, Callable[[], str | None]],
    *,
    shape: dict[str, int] | None = None,
    device=None,
    table: dict | None = None,
) -> Choice:
    """The kernel `impl` runs for one step of `family` on a GPU. impl: "auto" / "pallas_gpu" /
    "pallas" (the table's choice) or "pallas_mosaic" / "pallas_triton" (that kernel, or ValueError
    in one line).
    supports: backend -> a check returning None where its kernel takes the step, else why not;
    shape: the step's sizes the table's `xla_faster` bounds read (batch, heads, length); device:
    whose compute capability counts (default: this process's GPU, else an H100/H200's); table:
    VERIFIED unless given (tests)."""
    if family not in FAMILIES:
        raise ValueError(f"kernel family must be one of {tuple(FAMILIES)}, got {family!r}")
    name, fallback = FAMILIES[family]
    table = VERIFIED if table is None else table
    cap = capability(device)
    reasons = {
        backend: (_hopper(cap) if backend == "mosaic" else None) or supports[backend]()
        for backend in GPU_BACKENDS
    }
    named = impl.removeprefix("pallas_")
    if named in GPU_BACKENDS:
        if reasons[named] is not None:
            other = "pallas_triton" if named == "mosaic" else "pallas_gpu or xla"
            raise ValueError(f"{impl} cannot run {name} here: {reasons[named]}; use {other}")
        return Choice(named, f"{impl} names it")
    if impl not in ("auto", "pallas", "pallas_gpu"):
        raise ValueError(f"impl must be auto, pallas_gpu, pallas_mosaic or pallas_triton, got {impl!r}")
    skipped = []
    for backend in GPU_BACKENDS:
        entry = table.get((family, backend))
        if entry is None:
            skipped.append(f"{backend}: not verified on a GPU")
        elif reasons[backend] is not None:
            skipped.append(f"{backend}: {reasons[backend]}")
        elif impl == "auto" and _faster_in_xla(entry, shape or {}):
            return Choice(None, f"XLA measured faster than {backend} at this shape")
        else:
            why = f"{backend}: verified on {entry.device}, {entry.date}, {entry.commit}"
            return Choice(backend, "; ".join([*skipped, why]))
    if fallback is not None and reasons[fallback] is None:
        return Choice(fallback, "; ".join([*skipped, f"{fallback}: the measured kernels"]))
    return Choice(None, "; ".join([*skipped, "XLA"]))
