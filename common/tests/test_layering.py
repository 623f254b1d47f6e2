"""How common's modules may import each other, read from their source (every import, the ones
inside functions too): every module sits in one of common's layers (common/__init__.py: LAYERS) and
imports only its own layer and those below it, no import cycle, the value-head module imports only
the leaves below it, and nothing in common imports a backend or an integration (the registry knows
backends by name). And one rule for every test file: it runs its tests when run as a script."""

import ast
import os

from critic_adapters.common import LAYERS
from critic_adapters.common.tests.helpers import run_pytest

COMMON = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# What common/valuehead may import from the rest of common: torch-only leaves. Its command line
# (cli.py, __main__.py) sits on top of it and may read rollout data too.
VALUEHEAD_MAY_IMPORT = {"common.learning.hl_gauss", "common.parallel.kernels", "common.parallel.packed_attention",
                        "common.storage.atomic_dir", "common.learning.loss"}
VALUEHEAD_CLI_MAY_IMPORT = VALUEHEAD_MAY_IMPORT | {"common.learning.data", "common.testdata"}


def _modules() -> dict[str, str]:
    """common's product modules by dotted name (tests and test data left out)."""
    out = {}
    for folder, _, files in os.walk(COMMON):
        relative = os.path.relpath(folder, os.path.dirname(COMMON))
        if "tests" in relative.split(os.sep):
            continue
        for file in files:
            if file.endswith(".py"):
                name = os.path.join(relative, file[:-3]).replace(os.sep, ".").removesuffix(".__init__")
                out[name] = os.path.join(folder, file)
    return out


def _imports(name: str, path: str, modules) -> set[str]:
    """The modules of `modules` (or outside common: 'backends...', 'integrations...') that `path` imports."""
    package = name if path.endswith("__init__.py") else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(open(path).read())):
        if not isinstance(node, ast.ImportFrom) or not node.level:
            continue
        parts = package.split(".")
        base = parts[:len(parts) - node.level + 1]
        target = ".".join(base + ([node.module] if node.module else []))
        if not base or base[0] != "common":
            found.add(target or "<the package root>")
            continue
        # `from package import module` imports the module (the package's __init__ comes with any
        # import of it); names that are not modules come from `target` itself.
        submodules = {f"{target}.{alias.name}" for alias in node.names} & set(modules)
        takes_names = len(submodules) < len(node.names)
        for candidate in submodules | ({target} if takes_names else set()):
            if candidate in modules and candidate != name:
                found.add(candidate)
    return found


def import_graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in graph:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_common_has_no_import_cycle():
    graph = import_graph()
    assert {"common.job.trainer", "common.engine.lora", "common.engine.transforms", "common.valuehead.load"} <= set(graph)  # all read
    assert cycles(graph) == []


RANK = {package: index for index, layer in enumerate(LAYERS) for package in layer}


def layer_violations(graph: dict[str, set[str]]) -> list[str]:
    """Imports of a layer above the importer's in LAYERS (common.<layer>.<module> names)."""
    return sorted(f"{name} imports {dep}" for name, deps in graph.items() if name.count(".")
                  for dep in deps if dep.count(".") and RANK[dep.split(".")[1]] > RANK[name.split(".")[1]])


def test_common_holds_its_layers_and_no_module_beside_them():
    loose = sorted(n for n in os.listdir(COMMON) if n.endswith(".py") and n != "__init__.py")
    assert loose == [], f"modules outside a layer of common: {loose} (common/__init__.py: LAYERS)"
    packages = sorted(n for n in os.listdir(COMMON) if os.path.isfile(os.path.join(COMMON, n, "__init__.py")))
    assert set(packages) == set(RANK) | {"tests"}, packages
    for package in RANK:
        doc = ast.get_docstring(ast.parse(open(os.path.join(COMMON, package, "__init__.py")).read()))
        assert doc and "may import" in doc, f"common/{package}/__init__.py must say what the package may import"


def test_no_module_imports_a_layer_above_its_own():
    assert layer_violations({"common.parallel.x": {"common.job.trainer"}, "common.job.y": {"common.parallel.x"}}) == [
        "common.parallel.x imports common.job.trainer"]  # the check sees one
    graph = import_graph()
    assert {"common.parallel.ulysses", "common.engine", "common.job.launcher"} <= set(graph)
    assert layer_violations(graph) == []


def test_the_value_head_module_imports_only_the_leaves_below_it():
    for name, deps in import_graph().items():
        if not name.startswith("common.valuehead"):
            continue
        allowed = VALUEHEAD_CLI_MAY_IMPORT if name.rpartition(".")[2] in ("cli", "__main__") else VALUEHEAD_MAY_IMPORT
        upward = sorted(d for d in deps if not d.startswith("common.valuehead") and d not in allowed)
        assert not upward, f"{name} imports {upward}"


def test_common_imports_no_backend_and_no_integration():
    for name, deps in import_graph().items():
        outside = sorted(d for d in deps if not d.startswith("common"))
        assert not outside, f"{name} imports {outside}"


if __name__ == "__main__":
    run_pytest(__file__)


def test_every_test_file_runs_its_tests_when_run_as_a_script():
    """Bazel runs a test file as a script (tools/bazel/defs.bzl: main = the file): without the
    run_pytest(__file__) block it would define its tests, run none and pass (tests/test_vision_critics.py
    once did)."""
    root = os.path.dirname(COMMON)
    missing = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if not d.startswith((".", "bazel-")) and d not in ("consumer_workspace", "__pycache__")]
        for file in files:
            if file.startswith("test_") and file.endswith(".py"):
                with open(os.path.join(folder, file)) as f:
                    if "run_pytest(__file__" not in f.read():
                        missing.append(os.path.relpath(os.path.join(folder, file), root))
    assert not missing, f"test files that run nothing as a script: {missing}"
