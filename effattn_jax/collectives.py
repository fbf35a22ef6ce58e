"""The bytes a compiled program's collectives move per run, read from its optimized HLO text.

A compiled SPMD module is one device's program, so each collective's result shape is what that
device receives (all-gather), keeps (reduce-scatter) or holds reduced (all-reduce). A collective
inside a loop counts once per iteration: a `while` multiplies its body by the trip count XLA
proved (`known_trip_count`), or else by the bound its condition compares the counter against
(`counter < N`, libtpu's programs); any other called computation (fusions, calls, async
collectives, branches) counts once. Collectives over groups of one device move nothing and are left out.
"""

from __future__ import annotations

import re
from collections import defaultdict

KINDS = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")

_BYTES = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2, "f32": 4, "s32": 4,
          "u32": 4, "f64": 8, "s64": 8, "u64": 8}  # fmt: skip
_COMPUTATION = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) \(.*\{$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%[\w.\-]+ = (.+?) ([a-z\-]+)\((.*)$")
_SHAPE = re.compile(r"\b([a-z]+\d*)\[([\d,]*)\]")
_CALLS = re.compile(
    r"\b(?:calls|to_apply|body|branch_computations|true_computation|false_computation)=(\{[^}]*\}|%[\w.\-]+)"
)
_TRIPS = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_CONDITION = re.compile(r"\bcondition=%([\w.\-]+)")
_BOUND = re.compile(r"s32\[\]\S* constant\((\d+)\)")
_GROUPS = re.compile(
    r"replica_groups=(\{\{[\d,{} ]*\}\}|\[[\d,]+\]<=\[[\d,]+\][^,]*|mesh\[[^\]]*\] \{[^}]*\})"
)


def _shape_bytes(text: str) -> int:
    total = 0
    for dtype, dims in _SHAPE.findall(text):
        if dtype in _BYTES:
            n = 1
            for d in filter(None, dims.split(",")):
                n *= int(d)
            total += n * _BYTES[dtype]
    return total


def _trivial(line: str) -> bool:
    """A collective whose groups each hold one device ({{0},{1},...})."""
    m = _GROUPS.search(line)
    return (
        bool(m)
        and m.group(1).startswith("{{")
        and all("," not in g for g in re.findall(r"\{([\d,]*)\}", m.group(1)))
    )


def collective_bytes(hlo_text: str) -> dict[str, int]:
    """{collective kind: bytes per run of the program} for the kinds in KINDS that occur (the
    async start/done pairs of an accelerator's program count once, at the start)."""
    own: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    calls: dict[str, list[tuple[str, int | str]]] = defaultdict(list)  # trips, or the condition's name
    bounds: dict[str, int] = {}  # a loop condition's `counter < N`
    entry, current = None, None
    for line in hlo_text.splitlines():
        if m := _COMPUTATION.match(line):
            current = m.group(1)
            if line.startswith("ENTRY"):
                entry = current
            continue
        if current is not None and (b := _BOUND.search(line)):
            bounds[current] = max(bounds.get(current, 0), int(b.group(1)))
        m = _INSTRUCTION.match(line)
        if not m or current is None:
            continue
        shape, op, rest = m.groups()
        kind = op.removesuffix("-start")
        if kind in KINDS and not op.endswith("-done") and not _trivial(rest):
            if op.endswith("-start"):  # the result tuple holds the operands too: count the last shape
                shape = _SHAPE.findall(shape)[-1:]
                shape = " ".join(f"{t}[{d}]" for t, d in shape)
            own[current][kind] += _shape_bytes(shape)
        trips: int | str = 1
        if op == "while":
            t, cond = _TRIPS.search(rest), _CONDITION.search(rest)
            trips = int(t.group(1)) if t else (cond.group(1) if cond else 1)
        for called in _CALLS.findall(rest):
            for name in re.findall(r"%?([\w.\-]+)", called):
                calls[current].append((name, trips))

    done: dict[str, dict[str, int]] = {}

    def total(name: str) -> dict[str, int]:  # HLO calls form a DAG: each computation summed once
        if name not in done:
            out = defaultdict(int, own.get(name, {}))
            for child, times in calls.get(name, []):
                times = bounds.get(times, 1) if isinstance(times, str) else times
                for kind, n in total(child).items():
                    out[kind] += n * times
            done[name] = dict(out)
        return done[name]

    return total(entry) if entry else {}
