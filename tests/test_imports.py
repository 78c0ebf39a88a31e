"""The package has no import circles at module level (imports inside functions are lazy and
do not count)."""
import ast
from pathlib import Path

import qwen_trt

PKG = Path(qwen_trt.__file__).parent


def module_name(path: Path) -> str:
    parts = path.relative_to(PKG.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def top_level_imports(tree: ast.Module, known: set[str]):
    """qwen_trt modules imported by statements outside any function or class body."""
    def walk(nodes):
        for node in nodes:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                continue
            if isinstance(node, ast.Import):
                yield from (a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                for a in node.names:
                    sub = f"{node.module}.{a.name}"
                    yield sub if sub in known else node.module
            for field in ("body", "orelse", "finalbody", "handlers"):
                yield from walk(getattr(node, field, []) or [])
    return {m for m in walk(tree.body) if m in known}


def import_graph() -> dict[str, set[str]]:
    files = {module_name(p): p for p in PKG.rglob("*.py")}
    known = set(files)
    return {m: top_level_imports(ast.parse(p.read_text()), known) - {m} for m, p in files.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str):
        state[m] = 1
        stack.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                return stack[stack.index(n):] + [n]
            if n not in state and (found := visit(n)):
                return found
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (found := visit(m)):
            return found
    return None


def test_no_import_cycles():
    graph = import_graph()
    assert "qwen_trt.fast.reference" in graph["qwen_trt.fast.gemv"]   # the checker sees edges
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))


def test_cycle_finder_finds_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
