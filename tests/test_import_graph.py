"""No import cycles among pagedllm's modules.

Every ``import`` counts, including lazy ones inside functions (a cycle broken only by import
order is still a cycle); imports under ``if TYPE_CHECKING:`` don't, nor those under
``if __name__ == "__main__":`` (they run only when the module is the program, under the name
``__main__``, so they cannot close a cycle through the module's own name). A package's
``__init__`` counts as a module of its own, imported only where it is named.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pagedllm

ROOT = Path(pagedllm.__file__).parent


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in ROOT.rglob("*.py")}


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    skip: set[int] = set()
    for node in ast.walk(tree):
        test = ast.unparse(node.test) if isinstance(node, ast.If) else ""
        if "TYPE_CHECKING" in test or test in ("__name__ == '__main__'", '__name__ == "__main__"'):
            skip.update(id(n) for n in ast.walk(node))
    return skip


def _targets(name: str, node: ast.Import | ast.ImportFrom, is_package: bool, mods: dict[str, Path]) -> list[str]:
    """The modules an import statement names: ``from pkg import sub`` names ``pkg.sub`` when that is
    a module, else ``pkg`` itself (a name defined there). Parent packages imported on the way are
    not counted: they are part of every import and would make each re-exporting ``__init__`` a cycle."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = node.module or ""
    if node.level:
        parts = name.split(".") if is_package else name.split(".")[:-1]
        parts = parts[: len(parts) - node.level + 1]
        base = ".".join([*parts, base] if base else parts)
    return [f"{base}.{alias.name}" if f"{base}.{alias.name}" in mods else base for alias in node.names]


def import_graph() -> dict[str, set[str]]:
    mods = modules()
    graph: dict[str, set[str]] = {}
    for name, path in mods.items():
        tree = ast.parse(path.read_text())
        skip = _type_checking_nodes(tree)
        deps: set[str] = set()
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)) and id(node) not in skip:
                for target in _targets(name, node, path.name == "__init__.py", mods):
                    if target in mods and target != name:
                        deps.add(target)
        graph[name] = deps
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle as a path [a, b, ..., a], or None (depth-first search, three colours)."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for dep in sorted(graph[node]):
            if state.get(dep) == 1:
                return stack[stack.index(dep) :] + [dep]
            if dep not in state and (cycle := visit(dep)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_no_import_cycles() -> None:
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_the_check_finds_a_cycle() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_the_graph_sees_lazy_imports_and_skips_type_checking() -> None:
    graph = import_graph()
    assert "pagedllm.engine.protocol" in graph["pagedllm.engine.core"]
    assert all(dep.startswith("pagedllm") for deps in graph.values() for dep in deps)
