"""The package's shape, checked on every CI run (the architecture issue's bounds): no import
cycles between modules or between subpackages (imports inside functions included), core/ and
model/ never importing features/, launch/ or serve/, core/model_runner.py at most 250 lines,
no function but a @triton.jit kernel longer than 80 lines (docstring included), and
LLMEngine.step() at most 25 lines, so that reading it shows the whole step."""

from __future__ import annotations

import ast
import os

ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "nanovllm")


def modules() -> dict[str, ast.Module]:
    out = {}
    for folder, _, files in os.walk(ROOT):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(folder, f)
                name = os.path.relpath(path[:-3], os.path.dirname(ROOT)).replace(os.sep, ".")
                out[name.removesuffix(".__init__")] = ast.parse(open(path).read(), path)
    return out


def import_graph(mods: dict[str, ast.Module]) -> dict[str, set[str]]:
    """Module -> the package modules it imports, at any level: ast.walk visits the imports inside
    functions (and under `if TYPE_CHECKING:`) too."""
    edges = {name: set() for name in mods}
    for name, tree in mods.items():
        for node in ast.walk(tree):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            edges[name] |= {t for t in targets if t in mods and t != name}
    return edges


# Subpackages that may not import some others: core/ and model/ read alone, the features and
# the processes plug into hooks they declare.
FORBIDDEN = {"core": {"features", "launch", "serve"}, "model": {"features", "launch", "serve", "core"}}


def subpackage(module: str) -> str:
    """The subpackage of a module ("core", "launch", ...), or "(front)" for the top-level modules
    (nanovllm.llm, nanovllm.config, ...) and the subpackages' __init__ files, where the fronts
    wire features and launchers in (nanovllm.wiring)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 2 else "(front)"


def forbidden_imports(edges: dict[str, set[str]]) -> set[str]:
    def area(module: str) -> str:  # as subpackage(), with each subpackage's __init__ in it
        return module.split(".")[1] if "." in module else module

    return {f"{a} -> {b}" for a, targets in edges.items() for b in targets if area(b) in FORBIDDEN.get(area(a), ())}


def test_core_and_model_never_import_features_launch_or_serve():
    found = forbidden_imports(import_graph(modules()))
    assert not found, sorted(found)


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    state, stack, cycles = {}, [], []

    def visit(u):
        state[u] = "open"
        stack.append(u)
        for v in sorted(edges[u]):
            if state.get(v) == "open":
                cycles.append(stack[stack.index(v):] + [v])
            elif v not in state:
                visit(v)
        stack.pop()
        state[u] = "done"

    for m in sorted(edges):
        if m not in state:
            visit(m)
    return cycles


def test_import_graph_has_no_cycles():
    edges = import_graph(modules())
    assert not _cycles(edges), _cycles(edges)
    assert edges["nanovllm.core.model_runner"]  # the graph is real: the runner imports its parts


def test_no_cycle_between_subpackages():
    """Between core/, model/, features/, parallel/, launch/, serve/, kernels/ (the fronts, which
    wire them together, are left out: their own cycles are the module test's)."""
    units: dict[str, set[str]] = {}
    for a, targets in import_graph(modules()).items():
        units.setdefault(subpackage(a), set()).update(subpackage(b) for b in targets)
    units = {a: {b for b in bs if b not in (a, "(front)")} for a, bs in units.items() if a != "(front)"}
    assert not _cycles(units), _cycles(units)
    assert "parallel" in units["core"] and "core" in units["launch"]  # the graph is real


def test_model_runner_is_small():
    with open(os.path.join(ROOT, "core", "model_runner.py")) as f:
        assert len(f.read().splitlines()) <= 250


def test_no_function_longer_than_80_lines_but_kernels():
    long = []
    for name, tree in modules().items():
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                kernel = any("jit" in ast.unparse(d) for d in node.decorator_list)
                if not kernel and node.end_lineno - node.lineno + 1 > 80:
                    long.append(f"{name}.{node.name}: {node.end_lineno - node.lineno + 1} lines")
    assert not long, long


def test_engine_step_reads_as_the_step():
    tree = modules()["nanovllm.core.engine"]
    step = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "step")
    assert step.end_lineno - step.lineno + 1 <= 25
