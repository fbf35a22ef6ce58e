"""The kernel registry (pallas_kernels/registry.py): every kernel file is registered, every MoBA
attention module provides what its protocol names (pallas_kernels/moba/kernels.py), and the
kernels of one (family, part) take the same arguments."""

import inspect
from typing import get_type_hints

import pytest
from conftest import ROOT

from pallas_kernels import registry
from pallas_kernels.moba.kernels import BlockKernels, OwnKernels, ShapeChecked
from pallas_kernels.moba.parts import KernelCall
from pallas_kernels.moba.schedule import BlockSizes


def _provides(module, protocol) -> list[str]:
    """The callables `protocol` names that `module` lacks."""
    return [name for name in get_type_hints(protocol) if not callable(getattr(module, name, None))]


def moba_kernels(backend):
    return registry.kernel("moba", "attention", backend)


BACKENDS = ("tpu", "triton", "mosaic")
PARTS = [("moba", "attention"), ("moba", "routing"), ("moba", "decode"), ("mla", "decode")]


def test_every_part_has_every_backend():
    """DSA has its attention, decode and selection in Triton and on TPU, none in Mosaic GPU so far
    (docs/dsa.md)."""
    dsa = {("dsa", part, b) for part in ("attention", "decode", "select") for b in ("triton", "tpu")}
    want = {(*part, b) for part in PARTS for b in BACKENDS} | dsa
    assert set(registry.REGISTRY) == want


@pytest.mark.parametrize("backend", BACKENDS)
def test_every_registered_module_satisfies_its_protocol(backend):
    chosen = moba_kernels(backend)
    assert isinstance(chosen.own, OwnKernels) and isinstance(chosen.blocks, BlockKernels)
    assert _provides(chosen.own, OwnKernels) == [] and _provides(chosen.blocks, BlockKernels) == []
    if backend == "mosaic":  # gpu_dispatch asks them before choosing them
        assert _provides(chosen.own, ShapeChecked) == [] and _provides(chosen.blocks, ShapeChecked) == []


def test_every_kernel_file_is_registered():
    kernel_files = ("*_own.py", "*_blocks.py", "routing_*.py", "*_decode.py")
    files = {f"moba.{p.stem}" for g in kernel_files for p in (ROOT / "pallas_kernels/moba").glob(g)}
    files -= {"moba.routing_common"}  # the routing kernels' shared tiles, not a kernel
    files |= {f"mla_decode.{p.stem}" for p in (ROOT / "pallas_kernels/mla_decode").glob("*.py")}
    files |= {f"dsa.{p.stem}" for p in (ROOT / "pallas_kernels/dsa").glob("*.py")}
    files -= {"mla_decode.__init__", "dsa.__init__"}
    # the TPU kernels' shared grid step, and the one-KV-head path of ("dsa", "attention", "tpu")
    files -= {"dsa.tpu_chunks", "dsa.tpu_latent_attention"}
    registered = set()
    for family, part, backend in registry.REGISTRY:
        entry = registry.kernel(family, part, backend)
        moba_attention = (family, part) == ("moba", "attention")
        modules = (entry.own, entry.blocks) if moba_attention else (inspect.getmodule(entry),)
        registered |= {m.__name__.removeprefix("pallas_kernels.") for m in modules}
    assert registered == files


@pytest.mark.parametrize("family, part", PARTS[1:])
def test_the_kernels_of_one_part_take_the_same_arguments(family, part):
    """Callers pass the same arguments whichever backend runs (interpret included); a backend may
    add keyword options with defaults (tiles, pieces)."""
    signatures = {b: inspect.signature(registry.kernel(family, part, b)).parameters for b in BACKENDS}
    required = {
        b: [n for n, p in params.items() if p.default is inspect.Parameter.empty]
        for b, params in signatures.items()
    }
    assert len({tuple(r) for r in required.values()}) == 1, required
    assert all("interpret" in params for params in signatures.values())


def test_dsa_decode_kernels_take_the_same_arguments():
    signatures = [inspect.signature(registry.kernel("dsa", "decode", b)) for b in ("triton", "tpu")]
    assert signatures[0] == signatures[1]


def test_a_call_runs_the_kernels_of_its_backend():
    """A call's modules: the registry's for its GPU kernels, else its backend's (Triton's on a GPU);
    an unknown kernel backend is refused in one line."""
    tiles = BlockSizes().resolve("tpu", head_dim=64, v_head_dim=64, block_size=128)
    call = lambda backend, gpu="": KernelCall(backend, True, tiles, 128, 1.0, gpu).kernels
    assert call("tpu") == moba_kernels("tpu")
    assert call("gpu") == call("gpu", "triton") == moba_kernels("triton")
    assert call("gpu", "mosaic") == moba_kernels("mosaic")
    with pytest.raises(ValueError, match="must be one of .*'mosaic'.*got 'cuda'"):
        moba_kernels("cuda")
    with pytest.raises(ValueError, match="registered .*not .*'dsa'"):
        registry.kernel("dsa", "routing", "tpu")
