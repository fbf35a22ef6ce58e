"""Reading what the compilers say, and the verdict on it: ptxas' verbose report (registers, spills,
warnings per kernel), XLA's thunk sequence (shared memory and threads per kernel), Mosaic GPU's pass
log (its shared memory), and the rules a row fails by. Pure text: tested without the CUDA wheels."""

from __future__ import annotations

import re

FAILING_WARNINGS = ("C7504", "C7512")  # setmaxnreg ignored; wgmma serialized


def ptxas_report(text: str) -> dict[str, dict]:
    """kernel -> {registers, spill_bytes, warnings} from `ptxas -v` output (its "Compiling entry
    function" paragraphs; warnings are attributed to the kernel whose paragraph they fall in, or the
    first kernel when ptxas prints them before it)."""
    out, current, pending = {}, None, []
    for line in text.splitlines():
        if m := re.search(r"Compiling entry function '(\w+)'", line):
            current = m.group(1)
            out[current] = {"registers": None, "spill_bytes": 0, "warnings": pending}
            pending = []
        elif m := re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", line):
            if current:
                out[current]["spill_bytes"] = int(m.group(1)) + int(m.group(2))
        elif m := re.search(r"Used (\d+) registers", line):
            if current:
                out[current]["registers"] = int(m.group(1))
        elif "warning" in line.lower() and "ptxas" in line.lower():
            code = re.search(r"\b(C\d{4})\b", line)
            said = code.group(1) if code else line.split("warning", 1)[1].strip(" :")[:120]
            (out[current]["warnings"] if current else pending).append(said)
    return out


def thunk_kernels(text: str) -> dict[str, dict]:
    """kernel -> {threads, smem} of the named custom kernels in XLA's thunk sequence dump."""
    out = {}
    for m in re.finditer(
        r"\] (\w+) grid: \[[^\]]*\] threads: \[(\d+), (\d+), (\d+)\]\s+shared_memory: (\d+)", text
    ):
        name, x, y, z, smem = m.groups()
        out[name] = {"threads": int(x) * int(y) * int(z), "smem": int(smem)}
    return out


def mosaic_smem(pass_log: str) -> int | None:
    """The shared memory Mosaic GPU allocated for a kernel (its pass log's `smem_bytes`)."""
    found = re.findall(r"smem_bytes = (\d+)", pass_log)
    return max(map(int, found)) if found else None


def verdict(row: dict, limit: int, strict_edges: bool = True) -> str | None:
    """Why a row fails the check, or None. Fails: a compile error or shared memory over the device's
    `limit` where the project's checks accept the configuration (they must refuse what the compiler
    rejects); a spill or a C7504/C7512 warning where `auto` picks it; with `strict_edges`, a spill in
    an accepted Mosaic GPU edge configuration (its `supports()` must refuse what spills; the Triton
    kernels' check is of shared memory only, and their spills at the edges are reported). A planted
    row is judged as an `auto` one."""
    if not row.get("accepted", True):
        return None
    picked = row["kind"] in ("auto", "planted") or (strict_edges and row.get("backend") == "mosaic")
    if row.get("error"):
        return f"accepted but the compile fails: {row['error']}"
    if row.get("smem") is not None and row["smem"] > limit:
        return f"accepted but asks {row['smem']:,} bytes of shared memory, over the {limit:,}"
    if picked and row.get("spill_bytes"):
        return f"spills {row['spill_bytes']} bytes (registers {row.get('registers')})"
    bad = [w for w in row.get("warnings", []) if w in FAILING_WARNINGS]
    if row["kind"] in ("auto", "planted") and bad:
        return f"ptxas {', '.join(bad)}"
    return None
