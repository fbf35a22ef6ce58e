"""The layering of docs/architecture.md, checked: imports run one way, the config loads
without jax, there is no import cycle, and nothing cites a file outside the repository."""

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT

PACKAGES = ("effattn_jax", "pallas_kernels", "eval")
SKIP_DIRS = {
    ".venv",
    ".venv-lower",
    ".cache",
    ".git",
    "runs",
    "__pycache__",
    ".pytest_cache",
    ".hypothesis",
    "build",
    "dist",
}


def module_files() -> dict[str, Path]:
    """Dotted module name -> file, for every module of the project's packages."""
    out = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """Project modules `name` imports anywhere in its file, function-local imports included
    (a lazy import hides a cycle from Python, not from this walk)."""
    found = set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(
                    package.split(".")[: len(package.split(".")) - node.level + 1] + [base]
                ).strip(".")
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        else:
            continue
        for target in targets:
            while target and target not in modules:  # `import a.b.c` of a function or attribute
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    modules = module_files()
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


@pytest.mark.slow  # a subprocess
def test_config_imports_no_jax_or_model_code():
    code = (
        "import sys, effattn_jax.config\n"
        "heavy = ('jax', 'jaxlib', 'flax', 'optax', 'orbax')\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in heavy"
        " or (m.startswith('effattn_jax.') and m != 'effattn_jax.config'))\n"
        "print(','.join(bad[:8]))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "", f"importing effattn_jax.config loaded: {out.stdout.strip()}"


def test_no_import_cycle(graph):
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done

    def visit(node, path):
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycle = path[path.index(nxt) :] + [nxt]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])


def layer_of(module: str) -> str:
    """The layer of docs/architecture.md a module belongs to: a subpackage, a top module, or
    pallas_kernels / eval (the commands and their library) / eval.bench (the scripts)."""
    for prefix in (
        "eval.bench",
        *(f"effattn_jax.{p}" for p in ("ops", "attention", "data", "train", "checkpoint")),
    ):
        if module == prefix or module.startswith(prefix + "."):
            return prefix.removeprefix("effattn_jax.")
    if module.startswith("effattn_jax."):
        return module.split(".")[1]
    return module.split(".")[0]


# What each layer may import from the project besides itself (docs/architecture.md). Kernels
# are reached through ops only (and measured directly by eval.bench); they import nothing else.
BELOW_MODEL = {"config", "sharding", "ops", "layers", "attention"}
ALLOWED = {
    "effattn_jax": set(),
    "config": set(),
    "cli": set(),
    "storage": set(),  # local paths and gs:// behind one interface; at the bottom with the others
    "checksums": {"storage"},
    "sharding": {"config"},
    "pallas_kernels": set(),
    "ops": {"config", "sharding", "pallas_kernels"},
    "layers": set(),
    "attention": {"ops", "layers", "config", "sharding"},
    "model": BELOW_MODEL,
    "flops": {"config"},
    "memory": set(),
    "collectives": set(),
    "data": {"config", "storage"},
    "checkpoint": {"config", "sharding", "checksums", "model", "storage"},
    "launch": {"config", "cli"},
    "train": BELOW_MODEL
    | {
        "model",
        "flops",
        "memory",
        "collectives",
        "data",
        "checkpoint",
        "checksums",
        "launch",
        "cli",
        "storage",
    },
    "generate": BELOW_MODEL | {"model", "memory", "data", "checkpoint", "launch", "cli"},
    "convert": BELOW_MODEL | {"model", "data", "checkpoint", "train", "cli", "storage"},
    "eval": BELOW_MODEL
    | {
        "model",
        "flops",
        "memory",
        "data",
        "checkpoint",
        "launch",
        "cli",
        "generate",
        "train",
        "storage",
        "convert",
    },
    "eval.bench": set(),  # on top: anything (filled in below)
}
ALLOWED["eval.bench"] = set(ALLOWED) - {"eval.bench"}


def test_every_module_has_a_layer(graph):
    assert {layer_of(name) for name in graph} <= set(ALLOWED), sorted(
        name for name in graph if layer_of(name) not in ALLOWED
    )


def test_imports_run_one_way(graph):
    wrong = [
        f"{name} imports {target}"
        for name, targets in graph.items()
        for target in targets
        if layer_of(target) != layer_of(name) and layer_of(target) not in ALLOWED.get(layer_of(name), ())
    ]
    assert not wrong, "\n".join(wrong)


def test_each_kernel_backend_stands_alone(graph):
    """The GPU kernels do not import the TPU ones (or the reverse), and the Triton kernels do not
    import the Mosaic GPU ones (which may reuse Triton's tables); what they share is in
    pallas_kernels/common.py (every kernel), moba/common.py (the MoBA kernel bodies),
    moba/routing_common.py (the routing kernels') and moba/schedule.py (the MoBA schedule and
    tiles, also the XLA path's), which import no kernel
    (schedule.py, for `auto` tiles, only common.py and the GPU's shared-memory model,
    gpu_memory.py, which imports nothing); the Mosaic GPU kernels' own building blocks are in
    mgpu_toolkit.py, which imports nothing of the project."""
    shared = {
        "pallas_kernels.common",
        "pallas_kernels.moba.common",
        "pallas_kernels.moba.schedule",
        "pallas_kernels.moba.routing_common",
    }
    by_backend = {  # gpu: Triton; mgpu: Mosaic GPU
        b: {*(f"pallas_kernels.moba.{b}_{part}" for part in ("own", "blocks", "decode")),
            f"pallas_kernels.moba.routing_{b}", f"pallas_kernels.mla_decode.{b}"}
        for b in ("tpu", "gpu", "mgpu")
    }  # fmt: skip
    by_backend["gpu"].add("pallas_kernels.gpu_memory")  # shared memory: the GPU kernels' estimates
    by_backend["tpu"].add("pallas_kernels.moba.tpu_smem")  # scalar memory: the TPU kernels' tables
    by_backend["mgpu"].add("pallas_kernels.mgpu_toolkit")  # wgmma, TMA rings: the Mosaic GPU kernels'
    allowed = by_backend | {"mgpu": by_backend["mgpu"] | by_backend["gpu"]}
    for backend, names in by_backend.items():
        for name in names:
            assert name in graph, name
            wrong = graph[name] - allowed[backend] - shared
            assert not wrong, f"{name} ({backend}) imports {wrong}"
    assert graph["pallas_kernels.common"] == set()
    assert graph["pallas_kernels.moba.schedule"] <= {"pallas_kernels.gpu_memory", "pallas_kernels.common"}
    assert graph["pallas_kernels.gpu_memory"] == set()
    assert graph["pallas_kernels.mgpu_toolkit"] == set()
    assert graph["pallas_kernels.moba.common"] == {"pallas_kernels.common"}


def test_kernel_helpers_are_defined_once():
    """NT, TN, tpu_interpret, mosaic_gpu_interpret and triton_params live in pallas_kernels/common.py
    only (the Mosaic GPU interpreter's params are built there alone)."""
    pattern = re.compile(
        r"^(NT|TN) = |^def (tpu_interpret|mosaic_gpu_interpret|triton_params)\(|InterpretGPUParams\(\)", re.M
    )
    hits = [
        str(path.relative_to(ROOT))
        for path in (ROOT / "pallas_kernels").rglob("*.py")
        if pattern.search(path.read_text())
    ]
    assert hits == ["pallas_kernels/common.py"], hits


def test_mosaic_gpu_building_blocks_live_in_the_toolkit():
    """The Mosaic GPU kernels' swizzled shared memory, warpgroup matmuls and their accumulators,
    register sharing between warpgroups and the interpreter's path for register operands are
    pallas_kernels/mgpu_toolkit.py's alone: a kernel file (mgpu_*, routing_mgpu, mla_decode/mgpu)
    calls them, it does not spell them again."""
    pattern = re.compile(
        r"\b(wgmma|run_state|ACC|SwizzleTransform|TilingTransform|set_max_registers)\(|"
        r"^def (accumulate|interpreter_staging|matmul|matmul_sum|matmuls|swizzled_smem|stream_ring)\(",
        re.M,
    )
    hits = [
        str(path.relative_to(ROOT))
        for path in (ROOT / "pallas_kernels").rglob("*.py")
        if pattern.search(path.read_text())
    ]
    assert hits == ["pallas_kernels/mgpu_toolkit.py"], hits


def test_kernels_and_ops_know_nothing_of_flax():
    for folder in ("pallas_kernels", "effattn_jax/ops"):
        for path in (ROOT / folder).rglob("*.py"):
            assert not re.search(r"^\s*(from|import) flax", path.read_text(), re.M), path


def test_registry_names_match_the_config_lists():
    from effattn_jax.attention import CORES, KINDS
    from effattn_jax.config import ATTENTION_CORES, ATTENTION_KINDS

    assert tuple(KINDS) == ATTENTION_KINDS and tuple(CORES) == ATTENTION_CORES


def repo_text_files():
    suffixes = (".py", ".md", ".yaml", ".toml", ".cff", ".txt", ".cfg")
    for path in ROOT.rglob("*"):
        parts = path.relative_to(ROOT).parts
        if SKIP_DIRS & set(parts) or any(p.endswith(".egg-info") for p in parts) or not path.is_file():
            continue
        if path.suffix in suffixes or path.name == "Makefile":
            yield path


def test_nothing_cites_a_file_outside_the_repository():
    this_file = Path(__file__).resolve()
    outside = re.compile(r"\.\./shared|PAPERS\.md|DESIGN\.md")
    hits = [
        f"{p.relative_to(ROOT)}:{i}"
        for p in repo_text_files()
        if p.resolve() != this_file
        for i, line in enumerate(p.read_text(errors="replace").splitlines(), 1)
        if outside.search(line)
    ]
    assert not hits, "cites a path outside the repo: " + ", ".join(hits)


def test_cited_docs_exist():
    cited = {
        m for p in repo_text_files() for m in re.findall(r"docs/[\w.-]+\.md", p.read_text(errors="replace"))
    }
    assert {"docs/moba.md", "docs/mla.md", "docs/eg_mla.md", "docs/architecture.md"} <= cited
    missing = sorted(c for c in cited if not (ROOT / c).is_file())
    assert not missing, missing


def test_no_private_name_is_imported_from_another_module():
    """`from project.module import _name` makes a file depend on what another calls its own
    business; a name two files share is public (no underscore)."""
    modules = module_files()
    hits = []
    for name, path in [*modules.items(), ("train", ROOT / "train.py")]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in PACKAGES:
                hits += [f"{name}: {node.module}.{a.name}" for a in node.names if a.name.startswith("_")]
    assert hits == [], hits


def _dotted(node) -> str | None:
    """`a.b.c` for a chain of names and attributes, else None (a call, a subscript, ...)."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute) and (head := _dotted(node.value)):
        return f"{head}.{node.attr}"
    return None


def test_no_private_attribute_of_another_module_is_read():
    """`module._name`, or `Class._name` of a class imported from another project module, is the same
    dependency on another file's own business as importing `_name` (dunders are not private)."""
    modules = module_files()
    hits = []
    for name, path in [*modules.items(), ("train", ROOT / "train.py")]:
        tree = ast.parse(path.read_text())
        bound = {}  # a name in this file -> the project module, or object of one, it was imported as
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for a in node.names:
                    bound[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
            elif isinstance(node, ast.ImportFrom) and node.module:
                bound |= {a.asname or a.name: f"{node.module}.{a.name}" for a in node.names}
        private = (n for n in ast.walk(tree) if isinstance(n, ast.Attribute) and n.attr[:1] == "_")
        for node in (n for n in private if not n.attr.startswith("__")):
            head, _, rest = (_dotted(node.value) or "").partition(".")
            owner = ".".join(filter(None, [bound.get(head, ""), rest]))
            while owner and owner not in modules:
                owner = owner.rpartition(".")[0]
            if owner and owner != name:
                hits.append(f"{name}:{node.lineno}: {ast.unparse(node)}")
    assert hits == [], hits
