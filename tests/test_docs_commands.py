"""Every command in README.md and docs/usage.md runs as written.

Each fenced command runs in a scratch directory (the repository's configs and train.py linked in),
in the documents' order, so a command finds the runs the commands before it made. `HOW` says how
each is checked: run with a few tiny arguments appended (fewer steps, a smaller batch, fewer
documents; later values win), its config loaded and checked, or covered by a named test that runs
it on tiny inputs, with the reason. A command `HOW` does not name fails the test, so none is
skipped silently. The runs take a few minutes: they are marked `docs`, left out of `make test` and
run by `make test-docs` (CI runs both).
"""

from __future__ import annotations

import ast
import os
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from conftest import ROOT

TRAIN = ("train.steps=2", "data.batch_size=4", "eval.max_batches=1")  # after the command's own
FEW_DOCS = ("--limit", "2")

# Hugging Face models in place of the downloads the README names: the same family's test fixture.
MODELS = {
    "models/llama-3.2-1b": "llama3",
    "models/mistral-7b-v0.3": "mistral",
    "models/qwen2.5-0.5b": "qwen2",
    "models/qwen3-0.6b": "qwen3",
}


def run(*extra):
    return ("run", extra)


def covered(test, why):
    return ("covered", (test, why))


def config_only(why):
    """A train.py command checked up to its config (loaded and validated), and why no further."""
    return ("config", why)


MAKE = ("make", None)  # the target exists (`make -n`); CI runs test, test-lower, gpu-compile
EXTRA = ("extra", None)  # `pip install -e '.[X]'`: the extra is declared
EVENTS = ("events", None)  # tensorboard: the run's event files hold the scalars the docs list

HOW = {
    "README.md": {
        "make train": MAKE,
        "make test": MAKE,
        "make test-fast": MAKE,
        "make test-long": MAKE,
        "make test-docs": MAKE,
        "make test-lower": MAKE,
        "make gpu-compile": MAKE,
        "python train.py --config configs/moba/cpu/default.yaml train.run_dir=runs/exp1": run(*TRAIN),
        "python -m eval lm-loss --run runs/exp1": run(*FEW_DOCS),
        'python -m effattn_jax.generate --run runs/exp1 --prompt "Fellow citizens" '
        "--max-new-tokens 40": run(),
        "python train.py --config configs/moba/paper/full_545m_1m.yaml train.dry_run=true": config_only(
            "an ahead-of-time compile of a 545M model for 64 TPU v5p chips: 2 minutes here; "
            "test_dry_run compiles the smallest config of each family for a slice"
        ),
        "XLA_FLAGS=--xla_force_host_platform_device_count=8 python train.py --config "
        "configs/moba/cpu/default.yaml mesh.data=4 mesh.context=2": run(*TRAIN),
        "pip install -e '.[gpu]'": EXTRA,
        "python train.py --config configs/gpu/moba_545m_8k.yaml": config_only(
            "needs a GPU; make gpu-compile compiles its train step for an H100"
        ),
        "python -m eval.bench.gpu_suite --out runs/gpu_suite": covered(
            "test_gpu_suite.py::test_dry_run_writes_every_section_without_the_data_stack",
            "needs a GPU; its --dry runs the kernels interpreted",
        ),
        "python -m effattn_jax.convert from-hf --model models/llama-3.2-1b --out runs/llama-1b": run(),
        "python -m effattn_jax.convert from-hf --model models/mistral-7b-v0.3 --out runs/mistral-7b": run(),
        "python -m effattn_jax.convert from-hf --model models/qwen2.5-0.5b --out runs/qwen2.5-0.5b": run(),
        "python -m effattn_jax.convert from-hf --model models/qwen3-0.6b --out runs/qwen3-0.6b": run(),
        'python -m effattn_jax.generate --run runs/qwen3-0.6b --prompt "The capital of France is"': run(),
        "python -m eval lm-loss --run runs/qwen3-0.6b": run(*FEW_DOCS),
        "python -m effattn_jax.convert to-hf --run runs/qwen3-0.6b --out exported/qwen3-0.6b": run(),
    },
    "docs/usage.md": {
        "python train.py --config configs/cpu/default.yaml train.run_dir=runs/mqa train.steps=500 "
        "model.num_kv_heads=1 checkpoint.every_steps=100": run(*TRAIN),
        "python -m eval lm-loss --run runs/cpu_default --step latest --json lm_loss.json": run(*FEW_DOCS),
        "python -m eval downstream --run runs/cpu_default --tasks piqa,hellaswag --limit 200": run(*FEW_DOCS),
        "python -m eval curves --runs runs/cpu_default,runs/mqa --tasks piqa --limit 200 "
        "--out eval_out/curves": run(*FEW_DOCS),
        "python -m eval scaling --runs 'runs/moba_*,runs/full_*' --loss trailing "
        "--out eval_out/scaling": covered(
            "test_eval.py::test_figure_commands_write_png_and_data", "reads a sweep's runs of several sizes"
        ),
        "python -m eval report --runs 'runs/egmla_*,runs/mla' --context 2048 --out eval_out/report": covered(
            "test_eval.py::test_figure_commands_write_png_and_data", "reads a sweep's EG-MLA and MLA runs"
        ),
        "pip install -e '.[lm-eval]'": EXTRA,
        "python -m eval.harness --model effattn --model_args run=runs/cpu_default,step=latest --tasks "
        "arc_challenge,hellaswag --batch_size 16 --output_path out/": covered(
            "test_harness.py::test_harness_figures_equal_the_suites",
            "the harness's tasks download from the Hugging Face Hub; the test runs offline copies",
        ),
        "JAX_PLATFORMS=cpu python -m eval.sweep --recipe moba-scaling-1k --only full_53k,moba_53k": covered(
            "test_sweep.py::test_recipe_trains_summarizes_then_only_redraws",
            "hours of training; the test's recipe is tiny",
        ),
        'python -m effattn_jax.generate --run runs/cpu_default --prompt "Fellow citizens" '
        '--max-new-tokens 40 --prompt "The economy" --temperature 0.8 --top-p 0.9': run(),
        "JAX_PLATFORMS=cpu python -m eval.bench.efficiency kv-cache --config "
        "configs/egmla/paper/eg_mla_kv64_emb256.yaml": run(),
        "JAX_PLATFORMS=cpu python -m eval.bench.efficiency decode-latency --context 1024,4096,16384": covered(
            "test_efficiency.py::test_decode_latency_alternates_the_named_models", "a timing, minutes here"
        ),
        "JAX_PLATFORMS=cpu python -m eval.bench.efficiency train-cost": covered(
            "test_efficiency.py::test_train_cost_counts_the_gate_table",
            "compiles every paper model, 90 s here",
        ),
        "JAX_PLATFORMS=cpu python -m eval.bench.efficiency moba-decode --context 8192,32768,131072 "
        "--batch 1,8 --json": run("--context", "512", "--batch", "1"),
        "JAX_PLATFORMS=cpu python -m eval.bench.efficiency latent-decode --context 4096,8192,16384,32768 "
        "--batch 1,16 --json": run("--context", "256", "--batch", "1"),
        "tensorboard --logdir runs/cpu_default": EVENTS,
        "python -m effattn_jax.launch --processes 2 --devices-per-process 2 -- "
        "--config configs/cpu/default.yaml": covered(
            "test_multiprocess.py::test_two_processes_train_as_one_and_stop_together",
            "the same launch on a tiny corpus; its losses are checked against one process",
        ),
    },
}
# What usage.md's commands expect to exist: the run `make train` writes (configs/cpu/default.yaml).
BEFORE = {"docs/usage.md": ["python train.py --config configs/cpu/default.yaml"]}


def documented(doc: str) -> list[str]:
    """The commands of a document's fenced blocks: continuations joined, comments dropped."""
    commands = []
    for block in re.findall(r"^```\n(.*?)^```", (ROOT / doc).read_text(), re.S | re.M):
        for line in block.replace("\\\n", " ").splitlines():
            if words := shlex.split(line, comments=True):
                commands.append(shlex.join(words))
    return commands


def normal(command: str) -> str:
    return shlex.join(shlex.split(command))


@pytest.mark.parametrize("doc", sorted(HOW))
def test_the_table_names_every_documented_command(doc):
    """A new or changed command in the docs must be given a way to run here."""
    documented_set = set(documented(doc))
    table = {normal(c) for c in HOW[doc]}
    assert documented_set - table == set(), "commands the table lacks (add them to HOW)"
    assert table - documented_set == set(), "commands the docs no longer have (drop them from HOW)"


@pytest.mark.docs
@pytest.mark.parametrize("doc", sorted(HOW))
def test_every_documented_command_runs(doc, tmp_path):
    for name in ("configs", "train.py"):
        (tmp_path / name).symlink_to(ROOT / name)
    for place, family in MODELS.items():
        shutil.copytree(ROOT / "tests" / "fixtures" / "hf" / family, tmp_path / place)
    how = {normal(c): h for c, h in HOW[doc].items()}
    for command in BEFORE.get(doc, []):
        execute(command, TRAIN, tmp_path)
    for command in documented(doc):
        kind, arg = how[command]
        if kind == "run":
            execute(command, arg, tmp_path)
        elif kind == "config":
            check_config(command)
        elif kind == "covered":
            assert_test_exists(*arg)
        elif kind == "make":
            target = shlex.split(command)[1]
            subprocess.run(["make", "-n", "-C", str(ROOT), target], check=True, capture_output=True)
        elif kind == "extra":
            extra = re.search(r"\.\[([\w-]+)\]", command).group(1)
            assert (
                extra
                in tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
            )
        elif kind == "events":
            check_events(doc, tmp_path / shlex.split(command)[-1])


def execute(command: str, extra, cwd: Path) -> None:
    """Runs `command` plus `extra` as a user would, with `python` this interpreter."""
    words = [*shlex.split(command), *extra]
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # the suite's 8 devices are its own
    env["JAX_PLATFORMS"] = "cpu"
    while "=" in words[0]:
        key, value = words.pop(0).split("=", 1)
        env[key] = value
    assert words[0] == "python", command
    done = subprocess.run(
        [sys.executable, *words[1:]], cwd=cwd, env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, f"{command}\n{done.stderr[-3000:]}"


def check_config(command: str) -> None:
    from effattn_jax.config import load_config

    words = shlex.split(command)
    assert words[:3] == ["python", "train.py", "--config"], command
    load_config(ROOT / words[3], words[4:])


def assert_test_exists(test: str, why: str) -> None:
    file, name = test.split("::")
    tree = ast.parse((ROOT / "tests" / file).read_text())
    assert name in {f.name for f in tree.body if isinstance(f, ast.FunctionDef)}, f"{test} ({why}) is gone"


def check_events(doc: str, run_dir: Path) -> None:
    """The scalars the document says TensorBoard shows are in the run's event files."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    listed = re.search(r"^shows ([\w,\s]+)\.", (ROOT / doc).read_text(), re.M).group(1)
    wanted = set(re.split(r",\s+|\s+and\s+", listed))
    events = EventAccumulator(str(run_dir))
    events.Reload()
    assert wanted <= set(events.Tags()["scalars"]), (wanted, events.Tags()["scalars"])
