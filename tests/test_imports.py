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
    assert "qwen_trt.fast.model.reference" in graph["qwen_trt.fast.kernels.gemv"]   # the checker sees edges
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))


def test_cycle_finder_finds_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


# The stack, bottom to top (README "Architecture"): a module may import its own layer and the
# layers below it, never one above — at module level or inside a function.
LAYERS = {
    "qwen_trt": 0, "qwen_trt.errors": 0, "qwen_trt.params": 0, "qwen_trt.progress": 0,
    "qwen_trt.settings": 0, "qwen_trt.debug": 0, "qwen_trt.stats": 0,
    "qwen_trt.model": 1,
    "qwen_trt.fast": 2,
    "qwen_trt.backends": 3, "qwen_trt.engine": 3, "qwen_trt.onnx": 3,
    "qwen_trt.serving": 4,
    "qwen_trt.api": 5, "qwen_trt.ui": 5, "qwen_trt.options": 5,
    "qwen_trt.commands": 6, "qwen_trt.bench": 6, "qwen_trt.cli": 6, "qwen_trt.__main__": 6,
}
ALLOWED_UPWARD: set[tuple[str, str]] = set()     # (importer, imported): none


def layer_of(module: str) -> int:
    parts = module.split(".")
    for n in range(len(parts), 0, -1):
        if ".".join(parts[:n]) in LAYERS:
            return LAYERS[".".join(parts[:n])]
    raise KeyError(f"{module} is in no layer of LAYERS")


def all_imports(tree: ast.Module, known: set[str]):
    """Every qwen_trt module imported anywhere in the file (functions and classes included)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names if a.name in known)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for a in node.names:
                sub = f"{node.module}.{a.name}"
                if sub in known:
                    yield sub
                elif node.module in known:
                    yield node.module


def upward_imports() -> list[str]:
    files = {module_name(p): p for p in PKG.rglob("*.py")}
    known = set(files)
    bad = []
    for m, p in sorted(files.items()):
        for dep in sorted(set(all_imports(ast.parse(p.read_text()), known))):
            if layer_of(dep) > layer_of(m) and (m, dep) not in ALLOWED_UPWARD:
                bad.append(f"{m} (layer {layer_of(m)}) imports {dep} (layer {layer_of(dep)})")
    return bad


def test_every_module_has_a_layer():
    for p in PKG.rglob("*.py"):
        layer_of(module_name(p))


def test_imports_run_down_the_stack():
    assert not ALLOWED_UPWARD
    bad = upward_imports()
    assert not bad, "\n".join(bad)


def test_layer_check_sees_function_level_imports():
    tree = ast.parse("def f():\n    from qwen_trt.serving.worker import main\n")
    assert list(all_imports(tree, {"qwen_trt.serving.worker"})) == ["qwen_trt.serving.worker"]
    assert layer_of("qwen_trt.serving.worker") > layer_of("qwen_trt.fast.step.batched")


def test_the_fast_path_imports_without_triton():
    """CPU-only installs (the transformers-4.57 venv of `make test-compat` has no Triton) import
    every fast-path module: each Triton helper a module imports has its stand-in there."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    mods = sorted(f"qwen_trt.fast.{p.stem}" for p in (root / "qwen_trt" / "fast").glob("*.py")
                  if p.stem != "__init__")
    code = ("import sys; sys.modules['triton'] = None; sys.modules['triton.language'] = None\n"
            + "".join(f"import {m}\n" for m in mods))
    r = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
