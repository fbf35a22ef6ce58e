"""The MoBA kernel registry (pallas_kernels/moba/kernels.py): every registered module provides what
its protocol names, and every own/selected-block kernel file of the package is registered."""

from typing import get_type_hints

import pytest
from conftest import ROOT

from pallas_kernels.moba import kernels
from pallas_kernels.moba.kernels import BlockKernels, OwnKernels, ShapeChecked, moba_kernels
from pallas_kernels.moba.parts import KernelCall
from pallas_kernels.moba.schedule import BlockSizes


def _provides(module, protocol) -> list[str]:
    """The callables `protocol` names that `module` lacks."""
    return [name for name in get_type_hints(protocol) if not callable(getattr(module, name, None))]


@pytest.mark.parametrize("backend", list(kernels.REGISTRY))
def test_every_registered_module_satisfies_its_protocol(backend):
    chosen = moba_kernels(backend)
    assert isinstance(chosen.own, OwnKernels) and isinstance(chosen.blocks, BlockKernels)
    assert _provides(chosen.own, OwnKernels) == [] and _provides(chosen.blocks, BlockKernels) == []
    if backend == "mosaic":  # gpu_dispatch asks them before choosing them
        assert _provides(chosen.own, ShapeChecked) == [] and _provides(chosen.blocks, ShapeChecked) == []


def test_every_kernel_file_is_registered():
    files = {p.stem for p in (ROOT / "pallas_kernels/moba").glob("*_own.py")}
    files |= {p.stem for p in (ROOT / "pallas_kernels/moba").glob("*_blocks.py")}
    registered = set()
    for backend in kernels.REGISTRY:
        chosen = moba_kernels(backend)
        registered |= {m.__name__.rpartition(".")[2] for m in (chosen.own, chosen.blocks)}
    assert registered == files


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
