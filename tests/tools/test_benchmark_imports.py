"""benchmarks/ has no circle of imports and no benchmark imports another (issue 41): the
pieces they share are in benchmarks/common.py. The import graph is read with `ast` from
every import statement, function-level ones included (a lazy import is still an
edge)."""

from __future__ import annotations

import ast
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
SHARED = "common"


def modules() -> dict[str, Path]:
    """Dotted name (as the scripts import it, benchmarks/ on sys.path) -> file."""
    out = {}
    for path in sorted(BENCHMARKS.rglob("*.py")):
        rel = path.relative_to(BENCHMARKS).with_suffix("")
        parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
        out[".".join(parts)] = path
    return out


def import_graph() -> dict[str, set[str]]:
    mods = modules()
    graph: dict[str, set[str]] = {name: set() for name in mods}
    for name, path in mods.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: from .x import y
                    anchor = package.split(".")[
                        : len(package.split(".")) - node.level + 1
                    ]
                    base = ".".join([*anchor, base] if base else anchor)
                targets = [base] + [f"{base}.{a.name}" for a in node.names]
            for target in targets:
                # The longest benchmarks module the import names, if any.
                parts = target.split(".")
                for n in range(len(parts), 0, -1):
                    if ".".join(parts[:n]) in mods:
                        hit = ".".join(parts[:n])
                        if hit != name:
                            graph[name].add(hit)
                        break
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every cycle found by a depth-first search (one per back edge)."""
    found, state, stack = [], {}, []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                found.append(stack[stack.index(nxt) :] + [nxt])
            elif nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node)
    return found


def test_the_graph_sees_the_imports_it_must():
    graph = import_graph()
    assert SHARED in graph["bench_rag"] and SHARED in graph["bench_targets"]
    assert "quality_eval.dataset" in graph["eval_quality"]
    assert SHARED in graph["quality_eval.mode_ttft"]  # a function-level import


def test_the_cycle_finder_finds_a_circle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == [
        ["a", "b", "c", "a"]
    ]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_circle_of_imports_in_benchmarks():
    assert cycles(import_graph()) == []


def test_no_benchmark_imports_another():
    """Scripts import common and the quality_eval package only, never each other."""
    graph = import_graph()
    scripts = {
        name
        for name in graph
        if "." not in name and name not in (SHARED, "quality_eval")
    }
    wrong = {
        name: sorted(graph[name] & scripts) for name in graph if graph[name] & scripts
    }
    assert wrong == {}
    assert graph[SHARED] == set()
