"""The package's imports: no circles (imports inside functions count: a lazy import that closes a
loop is still two modules that need each other), and every import runs down the layer table."""
import ast
from pathlib import Path

import qwen_trt

PKG = Path(qwen_trt.__file__).parent


def module_name(path: Path) -> str:
    parts = path.relative_to(PKG.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """Module -> the qwen_trt modules it imports anywhere (module level, functions, classes)."""
    files = {module_name(p): p for p in PKG.rglob("*.py")}
    known = set(files)
    return {m: set(all_imports(ast.parse(p.read_text()), known)) - {m} for m, p in files.items()}


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The circles, one loop each: a loop found, its modules are set aside and the search runs
    again on the rest, until none is left."""
    cycles: list[list[str]] = []
    rest = dict(graph)
    while (found := find_cycle(rest)) is not None:
        cycles.append(found)
        rest = {k: v - set(found) for k, v in rest.items() if k not in found}
    return cycles


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
    cycles = find_cycles(graph)
    assert not cycles, "import circles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_cycle_finder_finds_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycles({"a": {"b"}, "b": {"a"}, "c": {"d"}, "d": {"c"}, "e": {"a"}}) == [
        ["a", "b", "a"], ["c", "d", "c"]]


def test_the_graph_sees_function_level_imports():
    tree = ast.parse("import os\ndef f():\n    from qwen_trt.fast.kernels import qkernels as Q\n")
    assert set(all_imports(tree, {"qwen_trt.fast", "qwen_trt.fast.kernels.qkernels"})) == {
        "qwen_trt.fast.kernels.qkernels"}


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
