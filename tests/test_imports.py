"""The import graph of the source tree, read from the files (nothing is imported):

- prefill/, decode/ and transfer/ reach the engine only through its handoff seam (`engine/kv_handoff.py`) and a
  few modules of plain types;
- the serving backends (router, admission queue, replicas) do not import the HTTP layer (`cluster/api`);
- no module imports itself back through a chain of imports, lazy (function-level) imports included.

An import under `if TYPE_CHECKING:` counts for the first two (it names a dependency) but not for cycles (it never
runs).
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SUBPACKAGES = ("cluster", "prefill", "decode", "transfer", "kernels", "model", "engine")

# What the workers and the transfer layer may import from engine/, besides the seam itself. Each is a module of
# plain values that crosses the seam in its signatures, with no engine state behind it:
#   config           EngineArgs, the validated arguments a worker is started with
#   sampling_params  SamplingParams, the request's parameters, passed through to the engine
#   outputs          RequestDelta / TokenLogprobs, what the engine streams back
#   host_ip          a pure check of IP literals (transfer/control.py binds and dials with it)
SEAM = "k3serve.engine.kv_handoff"
PLAIN_ENGINE_MODULES = frozenset(f"k3serve.engine.{m}" for m in ("config", "sampling_params", "outputs", "host_ip"))
HTTP_LAYER = "k3serve.cluster.api"
BACKEND_MODULES = ("k3serve.cluster.router", "k3serve.cluster.admission", "k3serve.cluster.replicas",
                   "k3serve.cluster.decode_feed")


@dataclass(frozen=True)
class Edge:
    target: str  # a module of the tree
    at_top: bool  # executed when the importing module is (not inside a function or class body)
    type_checking: bool  # under `if TYPE_CHECKING:`


def module_files() -> dict[str, Path]:
    """Every module of the tree by its import name (`k3serve.engine.llm_engine`, `k3serve.kernels.moe`)."""
    files = {"k3serve": REPO / "k3serve" / "__init__.py"}
    files.update({f"k3serve.{f.stem}": f for f in (REPO / "k3serve").glob("*.py") if f.stem != "__init__"})
    for top in SUBPACKAGES:
        for f in (REPO / top).rglob("*.py"):
            parts = f.relative_to(REPO).with_suffix("").parts
            name = ".".join(("k3serve",) + (parts[:-1] if parts[-1] == "__init__" else parts))
            files[name] = f
    return files


MODULES = module_files()


def imports_of(name: str) -> list[Edge]:
    path = MODULES[name]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    edges: list[Edge] = []

    def visit(node: ast.AST, at_top: bool, type_checking: bool) -> None:
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([node.module] if node.module else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]
        else:
            targets = []
        edges.extend(Edge(t, at_top, type_checking) for t in targets if t in MODULES)
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.body:
                visit(child, at_top, True)
            for child in node.orelse:
                visit(child, at_top, type_checking)
            return
        inner = at_top and not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef))
        for child in ast.iter_child_nodes(node):
            visit(child, inner, type_checking)

    for statement in ast.parse(path.read_text()).body:
        visit(statement, True, False)
    return edges


GRAPH = {name: imports_of(name) for name in MODULES}


def test_workers_and_the_transfer_layer_touch_the_engine_only_through_the_seam() -> None:
    allowed = PLAIN_ENGINE_MODULES | {SEAM}
    reached = {
        (name, edge.target)
        for name in MODULES
        if name.split(".")[1:2] in (["prefill"], ["decode"], ["transfer"])
        for edge in GRAPH[name]
        if edge.target.startswith("k3serve.engine") and edge.target not in allowed
    }
    assert not reached, f"engine modules imported past the seam (importer, imported): {sorted(reached)}"


def test_the_seam_is_what_the_workers_use() -> None:
    """The seam is real: both workers and both follower ranks import it (a test that passed on an empty tree
    would prove nothing)."""
    for worker in ("prefill.worker", "prefill.rank", "decode.worker", "decode.rank"):
        assert SEAM in {edge.target for edge in GRAPH[f"k3serve.{worker}"]}, worker


def test_the_serving_backends_do_not_import_the_http_layer() -> None:
    reached = {
        (name, edge.target)
        for name in BACKEND_MODULES
        for edge in GRAPH[name]
        if edge.target == HTTP_LAYER or edge.target.startswith(HTTP_LAYER + ".")
    }
    assert not reached, f"backend modules import the HTTP layer: {sorted(reached)}"


def runtime_edges(graph: dict[str, list[Edge]]) -> dict[str, set[str]]:
    """The imports that run, as edges of a cycle. A submodule's import of its own package is left out unless
    the package reaches that submodule through imports it runs at its top level: Python finishes a package's
    `__init__` before a submodule runs, so only such a chain can hand the submodule a half-made package."""
    eager = {name: {e.target for e in edges if e.at_top and not e.type_checking} for name, edges in graph.items()}

    def reaches_eagerly(start: str, goal: str) -> bool:
        seen, todo = set(), [start]
        while todo:
            name = todo.pop()
            if name == goal:
                return True
            if name not in seen:
                seen.add(name)
                todo.extend(eager[name])
        return False

    out: dict[str, set[str]] = {}
    for name, edges in graph.items():
        out[name] = set()
        for edge in edges:
            if edge.type_checking or edge.target == name:
                continue
            if name.startswith(edge.target + ".") and not reaches_eagerly(edge.target, name):
                continue  # a submodule reading its finished package
            out[name].add(edge.target)
    return out


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_no_module_imports_itself_back() -> None:
    assert cycles(runtime_edges(GRAPH)) == []


def test_a_lazy_import_that_closes_a_loop_is_a_cycle() -> None:
    graph = {"a": [Edge("b", True, False)], "b": [Edge("c", True, False)], "c": [Edge("a", False, False)],
             "d": [Edge("a", True, True)]}
    assert cycles(runtime_edges(graph)) == [["a", "b", "c"]]


def test_a_submodule_reading_its_package_is_a_cycle_only_if_the_package_imports_it_at_its_top() -> None:
    def package_importing_its_submodule(at_top: bool) -> dict[str, list[Edge]]:
        return {"p": [Edge("p.x", at_top, False)], "p.x": [Edge("p", True, False)]}

    assert cycles(runtime_edges(package_importing_its_submodule(at_top=False))) == []
    assert cycles(runtime_edges(package_importing_its_submodule(at_top=True))) == [["p", "p.x"]]
