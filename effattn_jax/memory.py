"""Will it fit? A compiled program's memory (XLA's memory analysis: arguments, outputs and
temporaries, less the donated buffers its outputs reuse) against what a device has, checked
before anything runs, so a program too large for the machine ends in one line instead of an
allocator failure (or the kernel's OOM killer) part-way through."""

from __future__ import annotations

import os

# On a CPU a program's resident memory grows past XLA's estimate: dense attention fwd+bwd by
# 1.67-1.88x at 1K-4K tokens and 1.94-1.95x at 8K (the longest measured, the highest), MoBA by
# 1.07-1.36x (`python -m eval.bench.fit_check`, BENCHMARKS.md "The fit check on a CPU"). A CPU
# program's estimate may reach the available RAM over this factor, above every ratio measured
# with room for longer programs: better refused in one line than killed by the OOM killer.
CPU_PEAK_FACTOR = 2.5


class DoesNotFit(ValueError):
    """A program whose compiled memory exceeds what its device has; the message is one line."""


def program_bytes(compiled) -> int | None:
    """Bytes one device needs to run `compiled` (a jax `Compiled`); None when the backend gives
    no memory analysis."""
    try:
        m = compiled.memory_analysis()
    except (NotImplementedError, RuntimeError):
        return None
    if m is None:
        return None
    # donated inputs alias their outputs: counted once
    used = m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
    return int(used - m.alias_size_in_bytes)


def _available_ram() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            fields = dict(line.split(":", 1) for line in f)
        return int(fields["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def device_capacity(device, sharing: int = 1) -> tuple[int, str] | None:
    """(bytes a program's estimate may reach on `device`, where they come from): the allocator's
    limit on an accelerator; on the CPU the host's available memory over CPU_PEAK_FACTOR, split
    among the `sharing` CPU devices that run the program at once. None when neither is known."""
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    if stats and stats.get("bytes_limit"):
        return int(stats["bytes_limit"]), f"{device.device_kind} memory"
    ram = _available_ram() if device.platform == "cpu" else None
    if ram is None:
        return None
    shared = f" / {sharing} CPU devices" if sharing > 1 else ""
    source = f"available RAM{shared} / {CPU_PEAK_FACTOR:g} (a CPU's peak exceeds XLA's estimate)"
    return int(ram / CPU_PEAK_FACTOR) // sharing, source


def gib(n: float) -> str:
    return f"{n / 2**30:,.2f} GiB"


def check_fits(compiled, devices, what: str, knobs: str) -> int | None:
    """Raises DoesNotFit (naming `what`, the estimate, the capacity and the `knobs` that would
    shrink it) when `compiled` needs more than this process's `devices` have (each runs its
    share); returns the estimate in bytes."""
    need = program_bytes(compiled)
    capacity = device_capacity(devices[0], sharing=len(devices))
    if need is None or capacity is None:
        return need
    have, source = capacity
    if need > have:
        raise DoesNotFit(
            f"{what} needs {gib(need)} per device, more than the {gib(have)} of {source}; to fit: {knobs}"
        )
    return need


def _program_devices(compiled) -> list:
    """This process's devices that `compiled` runs on (from its input shardings)."""
    import jax

    devices = set()
    for sharding in jax.tree.leaves(compiled.input_shardings):
        devices |= set(sharding.device_set)
    local = [d for d in devices if d.process_index == jax.process_index()]
    return local or jax.local_devices()[:1]


def fit_checked(fn, what: str, knobs: str, static_argnums: tuple[int, ...] = (), static_argnames=()):
    """`fn` (a jax.jit function) checked to fit (DoesNotFit) before it first runs for each new
    input shape and dtype: the check compiles it ahead, and jit's own cache then reuses that
    executable. A known input costs one pass over the argument leaves, then jit's fast path."""
    import jax

    checked = set()

    def call(*args, **kwargs):
        dynamic = [a for i, a in enumerate(args) if i not in static_argnums]
        dynamic_kw = {k: v for k, v in kwargs.items() if k not in static_argnames}
        static_kw = sorted((k, v) for k, v in kwargs.items() if k in static_argnames)  # values hashable
        static = tuple(args[i] for i in static_argnums), tuple(static_kw)
        leaves, tree = jax.tree.flatten((dynamic, dynamic_kw))
        key = (tree, static, tuple((getattr(x, "shape", None), getattr(x, "dtype", None)) for x in leaves))
        if key not in checked:
            compiled = fn.lower(*args, **kwargs).compile()
            check_fits(compiled, _program_devices(compiled), what, knobs)
            checked.add(key)
        return fn(*args, **kwargs)

    return call
