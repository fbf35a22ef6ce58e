"""One compile, in its own process (started by eval/bench/compile_check/__main__.py with the CUDA plugin on
sys.path and the stub driver first on LD_LIBRARY_PATH):

    python -m eval.bench.compile_check.child mosaic MODULE_FILE
        a serialized Mosaic GPU module through the plugin's MosaicGpuCompile (MLIR -> PTX -> cubin;
        MOSAIC_GPU_DUMP_TO collects ptxas' report);
    python -m eval.bench.compile_check.child xla CASE_JSON TARGET_FILE
        a case's function (or a train step) through XLA's deviceless ahead-of-time GPU compile for
        the device description in TARGET_FILE (Triton kernels included; XLA_FLAGS' dump holds the
        thunk sequence, TF_CPP_VMODULE's log the ptxas report).

Prints one JSON line: {"error": first line or null}."""

from __future__ import annotations

import ctypes
import json
import sys
from pathlib import Path


def compile_mosaic(module_file: str) -> None:
    from jax_plugins import xla_cuda13

    compile_fn = ctypes.CDLL(xla_cuda13._get_library_path()).MosaicGpuCompile
    compile_fn.argtypes, compile_fn.restype = [ctypes.c_char_p, ctypes.c_size_t], ctypes.c_void_p
    module = Path(module_file).read_bytes()
    compile_fn(module, len(module))  # the cubin's later load fails on the stub: the dumps are the verdict


def compile_xla(case_json: str, target_file: str) -> None:
    import jax
    from jax.experimental import topologies

    from effattn_jax.ops.platform import tracing_for
    from eval.bench.compile_check.cases import Case, build, train_step
    from pallas_kernels.common import gpu_lowering_target

    raw = json.loads(case_json)
    case = Case(raw["family"], raw["backend"], raw["kind"], tuple((k, _tuple(v)) for k, v in raw["shape"]))
    text = Path(target_file).read_text()
    topo = topologies.get_topology_desc("1x1x1", platform="cuda", target_config=text, topology="1x1x1")
    kind = next(line.split('"')[1] for line in text.splitlines() if line.strip().startswith("name:"))
    with tracing_for("gpu"), gpu_lowering_target(kind):
        if case.family == "train_step":
            lowered = train_step(case, topo.devices)
        else:
            fn, args = build(case, topologies.make_mesh(topo, (1,), ("x",)))
            lowered = jax.jit(fn).lower(*args)
    lowered.compile()


def _tuple(value):
    return tuple(value) if isinstance(value, list) else value


def main(argv: list[str]) -> int:
    try:
        if argv[0] == "mosaic":
            compile_mosaic(argv[1])
        else:
            compile_xla(argv[1], argv[2])
        error = None
    except Exception as e:  # noqa: BLE001 - the compiler's refusal is the finding
        error = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"[:400]
    sys.stdout.flush()
    print(json.dumps({"error": error}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
