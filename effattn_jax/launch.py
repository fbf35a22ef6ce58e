"""Multi-process runs through jax.distributed, and a local launcher for trying them.

`initialize(cfg.distributed)` (train.py calls it before touching a device) joins the processes
into one JAX runtime when the run is multi-process:
- explicitly, from `distributed.coordinator` / `num_processes` / `process_id`, or from the
  environment variables JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID when the
  config leaves them unset (all three or none);
- or, with `distributed.auto_detect` (the default), wherever jax detects a cluster by itself
  (Cloud TPU pod slices, SLURM, Open MPI, ...).
Otherwise the run is one process. On CPU the processes' collectives go through gloo.

    python -m effattn_jax.launch --processes 2 [--devices-per-process 2] -- <train.py args>
    python -m effattn_jax.launch --processes 2 --module eval -- downstream --run DIR

starts N train.py processes (or `python -m <module>`: eval, eval.harness, effattn_jax.generate) on loopback
(a free port; simulated CPU devices per process, else the caller's XLA_FLAGS), streams process
0's output (the others' goes to `--log-dir`, named in the first line), forwards SIGTERM/SIGINT to
all, and stops the rest when one fails (or when they do not follow one that exited within two
minutes); the children die with the launcher.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from effattn_jax.cli import ArgumentParser, positive_int
from effattn_jax.config import ConfigError

ENV = {
    "coordinator": "JAX_COORDINATOR_ADDRESS",
    "num_processes": "JAX_NUM_PROCESSES",
    "process_id": "JAX_PROCESS_ID",
}
ROOT = Path(__file__).resolve().parents[1]
MODULES = ("eval", "eval.harness", "effattn_jax.generate")  # the other programs that join a multi-process run


def _env_int(name: str, unset: int) -> int:
    text = os.environ.get(name, "")
    try:
        return int(text) if text else unset
    except ValueError:
        raise ConfigError(name, text, "must be an integer") from None


def _explicit(dist) -> dict:
    """The coordinator / process count / id asked for by the config, else by the environment."""
    given = {
        "coordinator": dist.coordinator or os.environ.get(ENV["coordinator"], ""),
        "num_processes": dist.num_processes or _env_int(ENV["num_processes"], 0),
        "process_id": dist.process_id if dist.process_id >= 0 else _env_int(ENV["process_id"], -1),
    }
    unset = {"coordinator": "", "num_processes": 0, "process_id": -1}
    missing = [k for k in given if given[k] == unset[k]]
    if len(missing) not in (0, len(given)):
        names = ", ".join(f"distributed.{k} (or {ENV[k]})" for k in missing)
        raise ConfigError("distributed", f"missing {names}", "a multi-process run needs all three or none")
    return {} if missing else given


def _cluster_detected() -> bool:
    """Whether jax's own cluster detection (what `jax.distributed.initialize()` without arguments
    uses) finds a multi-process environment here. Its registry is not public API: if a jax
    version moves it, nothing is detected and the explicit settings still work."""
    try:
        from jax._src import clusters

        kinds = clusters.ClusterEnv._cluster_types
        return any(not k.opt_in_only_method and k.is_env_present() for k in kinds)
    except (ImportError, AttributeError):
        return False


def initialize(dist) -> None:
    """Joins this process into a multi-process run when one is asked for (see the module doc)."""
    import jax

    explicit = _explicit(dist)
    if not explicit and not (dist.auto_detect and _cluster_detected()):
        return
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if explicit:
        jax.distributed.initialize(
            explicit["coordinator"],
            num_processes=explicit["num_processes"],
            process_id=explicit["process_id"],
        )
    else:
        jax.distributed.initialize()
    from jax.experimental import multihost_utils

    with _stdout_muted():  # the first collective connects gloo, which prints a notice on stdout
        multihost_utils.sync_global_devices("effattn_jax.launch.initialize")


@contextlib.contextmanager
def _stdout_muted():
    """File descriptor 1 points at /dev/null meanwhile (output of C++ libraries included)."""
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 1)
        yield
    finally:
        os.dup2(saved, 1)
        os.close(saved)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(index: int, count: int, port: int, devices: int | None) -> dict:
    env = dict(os.environ)
    env.update({ENV["coordinator"]: f"127.0.0.1:{port}", ENV["num_processes"]: str(count)})
    env[ENV["process_id"]] = str(index)
    if devices:
        flags = [
            f for f in env.get("XLA_FLAGS", "").split() if "xla_force_host_platform_device_count" not in f
        ]
        env["XLA_FLAGS"] = " ".join([*flags, f"--xla_force_host_platform_device_count={devices}"])
        env.setdefault("JAX_PLATFORMS", "cpu")
    return env


def _die_with_parent() -> None:
    """In each child: killed when the launcher dies, however it dies (Linux)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def launch(
    args: list[str],
    processes: int,
    devices_per_process: int | None,
    log_dir: str | None = None,
    grace_s: float = 120.0,
    module: str | None = None,
) -> int:
    """Runs the processes (train.py with `args`, or `python -m module args`) to the end; the exit
    status is the first failure's, else process 0's."""
    port = _free_port()
    logs = Path(log_dir) if log_dir else Path(tempfile.mkdtemp(prefix="effattn-launch-"))
    logs.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, *(["-m", module] if module else [str(ROOT / "train.py")]), *args]
    procs, outs = [], [None] + [open(logs / f"process_{i}.log", "w") for i in range(1, processes)]  # noqa: SIM115
    for i, out in enumerate(outs):
        env = _env(i, processes, port, devices_per_process)
        procs.append(subprocess.Popen(cmd, env=env, stdout=out, stderr=out, preexec_fn=_die_with_parent))  # noqa: PLW1509
    if processes > 1:
        print(
            f"launch: {processes} processes on 127.0.0.1:{port}; processes 1.. log to {logs}", file=sys.stderr
        )

    def forward(signum, frame):
        for p in procs:
            if p.poll() is None:
                p.send_signal(signum)

    previous = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        failed, first_exit = None, None
        while any(p.poll() is None for p in procs):
            codes = [p.poll() for p in procs]
            bad = [c for c in codes if c not in (None, 0, 143)]
            if bad:
                failed = bad[0]
                break
            if first_exit is None and any(c is not None for c in codes):
                first_exit = time.monotonic()
            if first_exit is not None and time.monotonic() - first_exit > grace_s:
                print(f"launch: a process exited; the rest did not within {grace_s:.0f} s", file=sys.stderr)
                failed = 1
                break
            time.sleep(0.2)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
        for out in outs[1:]:
            out.close()
        for s, h in previous.items():
            signal.signal(s, h)
    if failed is not None:
        print(
            f"launch: a process failed (exit {failed}); stopped the others; logs in {logs}", file=sys.stderr
        )
        return failed
    codes = [p.returncode for p in procs]
    return next((c for c in codes if c != 0), 0)


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(prog="python -m effattn_jax.launch", description=__doc__)
    parser.add_argument("--processes", type=positive_int, required=True, help="number of processes")
    parser.add_argument("--devices-per-process", type=positive_int, help="simulated CPU devices per process")
    parser.add_argument("--log-dir", help="where processes 1.. write their output (default: a new temp dir)")
    parser.add_argument("--module", choices=MODULES, help="run `python -m MODULE` instead of train.py")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="-- then the program's arguments")
    args = parser.parse_args(argv)
    rest = args.args[1:] if args.args[:1] == ["--"] else args.args
    return launch(rest, args.processes, args.devices_per_process, args.log_dir, module=args.module)


if __name__ == "__main__":
    sys.exit(main())
