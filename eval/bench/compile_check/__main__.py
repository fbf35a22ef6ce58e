"""Every Pallas GPU kernel compiled to machine code on a machine with no GPU (`make gpu-compile`):

    python -m eval.bench.compile_check --site DIR --stub DIR [--out results/gpu_compile.json]
                                 [--markdown FILE] [--only TEXT] [--self-test] [--no-strict-edges]

Mosaic GPU kernels: lowered here for CUDA, each module compiled by the CUDA plugin's MosaicGpuCompile
to PTX and an sm_90a cubin. Triton kernels and the configs/gpu/ train steps: XLA's deviceless
ahead-of-time compile for an H100 (and the Triton kernels for an A100), which enforces the device's
shared memory. Each compile runs in a child process (eval/bench/compile_check/child.py) with the plugin
(`--site`, pip's jax-cuda13-plugin and -pjrt of jaxlib's version) and a stub CUDA driver (`--stub`)
that reports compute capability 9.0. One row per kernel and configuration: registers, spill bytes,
shared memory, threads, ptxas warnings; the rules a row fails by are eval/bench/compile_check/reading.py's
`verdict`. Exit status 1 when a row fails (`--self-test`: when a planted failure passes).
"""

from __future__ import annotations

import concurrent.futures
import datetime
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from effattn_jax.cli import ArgumentParser
from eval.bench.compile_check import reading
from eval.bench.compile_check.cases import ROOT, Case, accepted, build, cases, planted

HERE = Path(__file__).resolve().parent
TARGETS = {"h100": (HERE / "h100_sxm.txtpb", 232_448), "a100": (HERE / "a100_sxm.txtpb", 166_912)}
CHILD_TIMEOUT_S = 600
PALLAS_KERNELS = ("moba_", "mla_", "dsa_")  # the names of this project's kernels in a compiled module


def _child_env(args, extra: dict) -> dict:
    path = os.pathsep.join([str(ROOT), str(args.site)])
    ld = os.pathsep.join(filter(None, [str(args.stub), os.environ.get("LD_LIBRARY_PATH", "")]))
    env = os.environ | {"PYTHONPATH": path, "LD_LIBRARY_PATH": ld, "JAX_PLATFORMS": "cpu"}
    return env | {"JAX_SKIP_CUDA_CONSTRAINTS_CHECK": "1"} | extra


def _run_child(argv: list[str], env: dict) -> tuple[str | None, str]:
    """(the child's error line or None, its stderr)."""
    try:
        done = subprocess.run([sys.executable, "-m", "eval.bench.compile_check.child", *argv], env=env,
                              capture_output=True, text=True, timeout=CHILD_TIMEOUT_S)  # fmt: skip
    except subprocess.TimeoutExpired:
        return f"timed out after {CHILD_TIMEOUT_S} s", ""
    said = [line for line in done.stdout.splitlines() if line.startswith('{"error"')]  # native lines too
    if said:
        return json.loads(said[-1])["error"], done.stderr
    return f"exit {done.returncode}: {(done.stderr.strip().splitlines() or [''])[-1][:300]}", done.stderr


def _mosaic_modules(case: Case) -> dict[str, bytes]:
    """The serialized Mosaic GPU modules a case lowers to, by hash (lowered here, for an H200)."""
    import jax
    from jax.experimental.mosaic.gpu import core

    from effattn_jax.ops.platform import tracing_for
    from pallas_kernels.common import gpu_lowering_target

    jax.clear_caches()
    core.KNOWN_KERNELS.clear()
    fn, args = build(case)
    with tracing_for("gpu"), gpu_lowering_target():
        jax.export.export(jax.jit(fn), platforms=["cuda"])(*args)
    return dict(core.KNOWN_KERNELS)


def _compile_mosaic(case: Case, args) -> list[dict]:
    rows = []
    modules = _mosaic_modules(case)
    for module in modules.values():
        with tempfile.TemporaryDirectory() as tmp:
            (Path(tmp) / "module.mlirbc").write_bytes(module)
            dump = Path(tmp) / "dump"
            dump.mkdir()
            error, _ = _run_child(["mosaic", str(Path(tmp) / "module.mlirbc")],
                                  _child_env(args, {"MOSAIC_GPU_DUMP_TO": str(dump)}))  # fmt: skip
            reports = sorted(dump.glob("*.ptxas")) if dump.exists() else []
            if not reports:
                rows.append({"kernel": "?", "error": error or "no PTX (a Mosaic GPU pass failed)"})
                continue
            for report in reports:
                stem = report.name.removesuffix(".ptxas")
                info = next(iter(reading.ptxas_report(report.read_text()).values()), {})  # one kernel
                log = report.with_name(f"{stem}.mlir-passes.log")
                ptx = report.with_name(f"{stem}.ptx")
                threads = None
                if ptx.exists() and (found := re.search(r"\.maxntid (\d+)", ptx.read_text())):
                    threads = int(found.group(1))
                smem = reading.mosaic_smem(log.read_text()) if log.exists() else None
                rows.append({"kernel": stem.rsplit("_", 1)[0], "threads": threads, "smem": smem, **info})
    return rows or [{"kernel": "?", "error": "no Mosaic GPU kernel lowered"}]


def _compile_xla(case: Case, target: str, args) -> list[dict]:
    raw = json.dumps({"family": case.family, "backend": case.backend, "kind": case.kind, "shape": case.shape})
    with tempfile.TemporaryDirectory() as tmp:
        flags = f"--xla_dump_to={tmp} --xla_gpu_ptx_compiler_extra_flags=-v"
        env = _child_env(args, {"XLA_FLAGS": flags, "TF_CPP_MIN_LOG_LEVEL": "0",
                                "TF_CPP_VMODULE": "subprocess_compilation=2"})  # fmt: skip
        error, stderr = _run_child(["xla", raw, str(TARGETS[target][0])], env)
        thunks = {}
        for path in Path(tmp).glob("*thunk_sequence.txt"):
            thunks |= reading.thunk_kernels(path.read_text())
    everything = reading.ptxas_report(stderr)
    ptxas = {n: i for n, i in everything.items() if n.startswith(PALLAS_KERNELS)}
    if case.family == "train_step":  # one row: the step's Pallas kernels (XLA's own fusions are noted)
        xla_spills = sum(i["spill_bytes"] for n, i in everything.items() if n not in ptxas)
        worst = max(ptxas.items(), key=lambda kv: kv[1]["registers"] or 0, default=("", {}))
        return [
            {
                "kernel": f"{len(ptxas)} Pallas kernels (most registers: {worst[0] or '-'}; "
                f"XLA's fusions spill {xla_spills} B)",
                "error": error,
                "registers": worst[1].get("registers"),
                "smem": max((t["smem"] for t in thunks.values()), default=None),
                "spill_bytes": sum(i["spill_bytes"] for i in ptxas.values()),
                "warnings": sorted({w for i in ptxas.values() for w in i["warnings"]}),
            }
        ]
    if error or not ptxas:
        return [{"kernel": "?", "error": error or "no Pallas kernel in the compiled module"}]
    return [{"kernel": n, **ptxas[n], **thunks.get(n, {})} for n in sorted(ptxas)]


def _config(case: Case) -> str:
    return ", ".join(f"{k}={v}" for k, v in case.shape)


def check(case_list: list[Case], args) -> list[dict]:
    """Every case's rows, compiles two at a time (the children are single-threaded mostly)."""
    jobs = []
    for case in case_list:
        why_not = accepted(case)
        base = {"family": case.family, "backend": case.backend, "kind": case.kind, "config": _config(case)}
        base["accepted"] = why_not is None
        for target in case.targets:
            jobs.append((case, target, base | {"target": target} | ({"refused": why_not} if why_not else {})))

    def run(job):
        case, target, base = job
        if not base["accepted"]:
            return [base]
        found = _compile_mosaic(case, args) if case.backend == "mosaic" else _compile_xla(case, target, args)
        return [base | row for row in found]

    mosaic = [j for j in jobs if j[0].backend == "mosaic"]  # lowered in this process: one at a time
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        xla = list(pool.map(run, [j for j in jobs if j[0].backend != "mosaic"]))
        rows = [r for found in map(run, mosaic) for r in found] + [r for found in xla for r in found]
    for row in rows:
        if why := reading.verdict(row, TARGETS[row["target"]][1], args.strict_edges):
            row["fails"] = why
    return rows


def markdown(rows: list[dict]) -> str:
    columns = ("family", "backend", "target", "kind", "config", "kernel", "accepted", "regs", "spill B",
               "smem B", "threads", "ptxas warnings", "verdict")  # fmt: skip
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for r in rows:
        verdict = r.get("fails") or ("refused: " + r["refused"][:80] if "refused" in r else "ok")
        if verdict == "ok" and r.get("spill_bytes"):
            verdict = "spills (a Triton edge: reported)"
        cells = [r["family"], r["backend"], r["target"], r["kind"], r["config"], r.get("kernel", ""),
                 "yes" if r["accepted"] else "no", r.get("registers"), r.get("spill_bytes"), r.get("smem"),
                 r.get("threads"), " ".join(r.get("warnings", [])), verdict]  # fmt: skip
        lines.append("| " + " | ".join("" if c is None else str(c).replace("|", "/") for c in cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = ArgumentParser(prog="python -m eval.bench.compile_check", description=__doc__)
    p.add_argument("--site", type=Path, required=True, help="jax-cuda13-plugin and -pjrt (pip --target)")
    p.add_argument("--stub", type=Path, required=True, help="the folder of the stub libcuda.so.1")
    p.add_argument("--out", type=Path, default=None, help="the rows as JSON")
    p.add_argument("--markdown", type=Path, default=None, help="the rows as a markdown table")
    p.add_argument("--only", default="", help="cases whose name contains this")
    p.add_argument("--self-test", action="store_true", help="the planted failures must fail")
    p.add_argument(
        "--kernels-only", action="store_true", help="leave out the train steps (a kernels-only venv)"
    )
    p.add_argument("--no-strict-edges", dest="strict_edges", action="store_false",
                   help="spills in accepted edge configurations are reported, not failed")  # fmt: skip
    args = p.parse_args(argv)
    for what, path in (("--site", args.site / "jax_plugins"), ("--stub", args.stub / "libcuda.so.1")):
        if not path.exists():
            p.error(f"{what}: no {path} (make gpu-compile installs and builds them)")
    start = time.perf_counter()
    if args.self_test:
        rows = check(planted(), args)
        for r in rows:
            print(f"planted {r['family']} ({r['config']}) {r.get('kernel', '')}: {r.get('fails', 'PASSED')}")
        caught = {(r["family"], r["config"]) for r in rows if "fails" in r}
        missed = [c.name for c in planted() if (c.family, _config(c)) not in caught]
        seconds = time.perf_counter() - start
        caught_count = len(planted()) - len(missed)
        print(f"self-test: {caught_count} of {len(planted())} planted failures caught ({seconds:.0f} s)")
        return 1 if missed else 0
    chosen = [
        c for c in cases() if args.only in c.name and not (args.kernels_only and c.family == "train_step")
    ]
    rows = check(chosen, args)
    import jax

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    report = {"date": datetime.date.today().isoformat(), "commit": commit.stdout.strip()}
    report |= {"jax": jax.__version__, "seconds": round(time.perf_counter() - start), "rows": rows}
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1) + "\n")
    table = markdown(rows)
    if args.markdown:
        args.markdown.write_text(table)
    print(table)
    failed = [r for r in rows if "fails" in r]
    for r in failed:
        where = f"{r['family']}/{r['backend']}/{r['target']} ({r['config']}) {r.get('kernel', '')}"
        print(f"FAIL {where}: {r['fails']}")
    print(f"{len(rows)} rows, {len(failed)} failing, {report['seconds']} s (jax {jax.__version__})")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
