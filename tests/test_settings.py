"""Every QWEN_TRT_* variable is declared once (qwen_trt/settings.py) and read through it; the
options' help, README's configuration table and docs/settings.md are made from the declarations
and agree with them."""
import argparse
import ast
import io
import re
from pathlib import Path

import pytest

import qwen_trt
from qwen_trt import settings
from qwen_trt.fast.options import KernelOptions
from qwen_trt.options import OPTIONS

ROOT = Path(qwen_trt.__file__).parent.parent
README = (ROOT / "README.md").read_text()


def readme_config_vars() -> set[str]:
    table = README.split("## Configuration", 1)[1].split("\n## ", 1)[0]
    return set(re.findall(r"QWEN_TRT_[A-Z0-9_]+", table))


# Where a QWEN_TRT_* name may be written: the code, the tests, the scripts, the build and
# container files, the docs (not docs/measurements/ and docs/history/: records of past runs
# name switches since removed). This file is left out: it names undeclared ones on purpose.
_SCANNED = ("qwen_trt/**/*.py", "app.py", "tests/**/*.py", "scripts/**/*", "Makefile", "docker/*",
            "deploy/*", ".ci/*", "README.md", "docs/*.md")
_NAME = re.compile(r"\bQWEN_TRT_[A-Za-z0-9_]*[A-Za-z0-9_]")


def scanned_files() -> list[Path]:
    files = {p for pat in _SCANNED for p in ROOT.glob(pat) if p.is_file()}
    return sorted(files - {Path(__file__).resolve()})


def named_vars() -> dict[str, set[str]]:
    """Every QWEN_TRT_* name written in the scanned files, with the files naming it."""
    names: dict[str, set[str]] = {}
    for p in scanned_files():
        try:
            text = p.read_text()
        except UnicodeDecodeError:
            continue
        for name in _NAME.findall(text):
            names.setdefault(name, set()).add(str(p.relative_to(ROOT)))
    return names


def _env_key(node: ast.AST, consts: dict[str, str]) -> str | None:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.Name):
        return consts.get(node.id)
    return None


def _is_environ(node: ast.AST) -> bool:
    """``os.environ``, or a name that holds an environment (``environ``, ``env``)."""
    return ((isinstance(node, ast.Attribute) and node.attr == "environ")
            or (isinstance(node, ast.Name) and node.id in ("environ", "env")))


def direct_reads(tree: ast.Module) -> list[tuple[int, str]]:
    """(line, name) of each QWEN_TRT_* variable read straight from an environment:
    ``os.environ[...]``, ``os.environ.get(...)``, ``os.getenv(...)`` (or through a module
    constant holding the name), rather than through ``qwen_trt.settings``."""
    consts = {t.id: n.value.value for n in tree.body if isinstance(n, ast.Assign)
              and isinstance(n.value, ast.Constant) and isinstance(n.value.value, str)
              for t in n.targets if isinstance(t, ast.Name)}
    out = []
    for node in ast.walk(tree):
        key = None
        if isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load) \
                and _is_environ(node.value):
            key = _env_key(node.slice, consts)
        elif isinstance(node, ast.Call) and node.args and isinstance(node.func, ast.Attribute):
            f = node.func
            if (f.attr == "get" and _is_environ(f.value)) or f.attr == "getenv":
                key = _env_key(node.args[0], consts)
        if key and key.startswith(settings.PREFIX):
            out.append((node.lineno, key))
    return out


def test_names_are_declared_once():
    names = [s.name for s in settings.SETTINGS]
    assert len(names) == len(set(names))
    assert all(n.startswith(settings.PREFIX) for n in names)
    assert all(s.doc and "\n" not in s.doc for s in settings.SETTINGS)


def test_every_variable_named_anywhere_is_declared():
    named = named_vars()
    assert "QWEN_TRT_CORPUS" in named and "QWEN_TRT_TRITON_PATH" in named   # the scan sees them
    missing = {}
    for name, where in sorted(named.items()):
        try:
            settings.declared(name)
        except KeyError:
            missing[name] = sorted(where)
    assert not missing, f"declare these in qwen_trt/settings.py (named in): {missing}"


def test_every_read_goes_through_the_settings():
    bad = []
    for p in scanned_files():
        if p.suffix != ".py" or p.name == "settings.py" and p.parent.name == "qwen_trt":
            continue
        for line, name in direct_reads(ast.parse(p.read_text())):
            bad.append(f"{p.relative_to(ROOT)}:{line} reads {name}")
    assert not bad, "read these with qwen_trt.settings.get:\n" + "\n".join(bad)


def test_the_direct_read_finder_finds_them():
    code = ('import os\nK = "QWEN_TRT_X"\na = os.environ.get("QWEN_TRT_A")\n'
            'b = os.environ[K]\nc = os.getenv("QWEN_TRT_C", "1")\nd = env.get("OTHER")\n'
            'os.environ["QWEN_TRT_W"] = "1"\ne = dict(os.environ, QWEN_TRT_E="1")\n')
    assert direct_reads(ast.parse(code)) == [(3, "QWEN_TRT_A"), (4, "QWEN_TRT_X"),
                                              (5, "QWEN_TRT_C")]


def test_backend_options_match_their_declarations():
    for o in OPTIONS:
        s = settings.declared(o.env)
        assert s.flag == o.flag, o.env


def test_readme_table_lists_the_user_settings_once_and_nothing_undeclared():
    in_readme = readme_config_vars()
    for name in in_readme:
        settings.declared(name)
    users = {s.name for s in settings.SETTINGS if s.group == "user"}
    assert users <= in_readme, f"README's Configuration table lacks {sorted(users - in_readme)}"
    table = README.split("## Configuration", 1)[1].split("\n## ", 1)[0]
    rows = [re.match(r"\| `(QWEN_TRT_\w+)", line) for line in table.splitlines()]
    firsts = [m.group(1) for m in rows if m]
    assert len(firsts) == len(set(firsts)) == len(users), "a setting has more than one row"


def test_generated_documents_are_current():
    stale = [str(p.relative_to(ROOT)) for p in settings.stale()]
    assert not stale, f"{', '.join(stale)} stale: run {settings.REGENERATE}"


def test_staleness_is_seen(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "README.md").write_text(f"# x\n{settings.README_BEGIN}\n| old |\n"
                                        f"{settings.README_END}\nrest\n")
    assert settings.stale(tmp_path) == [tmp_path / "README.md", tmp_path / "docs" / "settings.md"]
    for path, text in settings.documents(tmp_path).items():
        path.write_text(text)
    assert settings.stale(tmp_path) == []
    readme = (tmp_path / "README.md").read_text()
    assert readme.startswith("# x\n") and readme.endswith("rest\n")
    assert "| `QWEN_TRT_MODEL` | `--model` |" in readme and "QWEN_TRT_PDL" not in readme
    (tmp_path / "README.md").write_text("# no markers\n")
    with pytest.raises(ValueError, match="lacks the markers"):
        settings.documents(tmp_path)


def test_the_reference_has_every_declaration_in_its_group():
    ref = (ROOT / "docs" / "settings.md").read_text()
    assert not settings.problems()
    sections = {g: ref.split(f"\n## {g}\n", 1)[1].split("\n## ", 1)[0] for g in settings.GROUPS}
    for s in settings.SETTINGS:
        assert f"`{s.name}" in sections[s.group], s.name


def test_a_bad_declaration_is_named(monkeypatch):
    bad = settings.Setting("QWEN_TRT_X", "int", None, "a <b> tag", group="kernel")
    monkeypatch.setattr(settings, "SETTINGS", (*settings.SETTINGS, bad))
    found = settings.problems()
    assert len(found) == 2 and all(p.startswith("QWEN_TRT_X: ") for p in found)
    with pytest.raises(ValueError, match="group 'kernel' is not one of user, tuning, test"):
        settings.reference()


def test_flag_help_comes_from_the_declaration():
    from qwen_trt.cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    serve = sub.choices["serve"]
    helps = {f: a.help for a in serve._actions for f in a.option_strings}
    for s in settings.SETTINGS:
        if s.flag in helps:
            assert helps[s.flag] == s.help, s.flag
    assert helps["--port"] == "port of qwen-trt serve (default 8000) [env QWEN_TRT_PORT]"
    assert "--watchdog-s" in helps and "--api-key" in helps and "--cache-dir" in helps
    top = {f: a.help for a in parser._actions for f in a.option_strings}
    assert top["--debug"] == settings.declared("QWEN_TRT_DEBUG").help


def test_choices_are_the_backends_own():
    from qwen_trt.backends import BACKENDS, DTYPES, FAST_MODES, QUANTIZATIONS, SPECULATIVE
    from qwen_trt.serving.service import WORKER_MODES

    for name, allowed in (("QWEN_TRT_BACKEND", BACKENDS), ("QWEN_TRT_DTYPE", DTYPES),
                          ("QWEN_TRT_FAST", FAST_MODES), ("QWEN_TRT_QUANTIZATION", QUANTIZATIONS),
                          ("QWEN_TRT_WORKER", WORKER_MODES)):
        assert settings.declared(name).choices == allowed, name


def test_one_bool_reading_everywhere():
    from qwen_trt.api.hops import HopClock
    from qwen_trt.debug import debug_enabled

    for word, value in (("on", True), (" Yes ", True), ("TRUE", True), ("1", True),
                        ("off", False), ("no", False), ("0", False), ("False", False)):
        assert settings.parse_bool(word) is value
        assert (HopClock.from_env({"QWEN_TRT_TRACE_HOPS": word}) is not None) is value
        assert debug_enabled({"QWEN_TRT_DEBUG": word}) is value
        assert KernelOptions().with_text(f"pdl={word.strip()}").pdl is value
    with pytest.raises(ValueError):
        settings.parse_bool("maybe")
    with pytest.raises(settings.SettingError, match="QWEN_TRT_TRACE_HOPS='maybe'"):
        HopClock.from_env({"QWEN_TRT_TRACE_HOPS": "maybe"})
    assert debug_enabled({"QWEN_TRT_DEBUG": "maybe"}) is False    # while reporting an error


def test_the_cache_folder_default_is_the_declared_one():
    from qwen_trt.fast.compile_cache import cache_root

    declared = settings.declared("QWEN_TRT_CACHE_DIR").default
    assert cache_root(None, {}) == Path(declared).expanduser()
    assert cache_root(None, {"QWEN_TRT_CACHE_DIR": " /x "}) == Path("/x")
    assert cache_root("/y", {"QWEN_TRT_CACHE_DIR": "/x"}) == Path("/y")


def test_parse_and_errors_name_the_variable():
    assert settings.get("QWEN_TRT_PORT", {"QWEN_TRT_PORT": " 9000 "}) == 9000
    assert settings.get("QWEN_TRT_PORT", {"QWEN_TRT_PORT": ""}) == 8000      # empty = unset
    assert settings.get("QWEN_TRT_PDL", {"QWEN_TRT_PDL": "0"}) is False
    with pytest.raises(settings.SettingError, match=r"QWEN_TRT_PORT='x': expected a whole number"):
        settings.get("QWEN_TRT_PORT", {"QWEN_TRT_PORT": "x"})
    with pytest.raises(settings.SettingError, match="QWEN_TRT_WORKER='thread': expected one of"):
        settings.get("QWEN_TRT_WORKER", {"QWEN_TRT_WORKER": "thread"})
    with pytest.raises(KeyError):
        settings.get("QWEN_TRT_NOPE", {})


def test_unknown_variables_get_one_warning_line():
    env = {"QWEN_TRT_MODLE": "x", "QWEN_TRT_MODEL": "y", "QWEN_TRT_GEMV_8x8": "1:1:1", "HOME": "/"}
    assert settings.unknown(env) == ["QWEN_TRT_MODLE"]
    out = io.StringIO()
    assert settings.warn_unknown(env, stream=out) == ["QWEN_TRT_MODLE"]
    assert out.getvalue().count("\n") == 1 and "QWEN_TRT_MODLE" in out.getvalue()
    settings.warn_unknown(env, stream=out)                      # once per name
    assert out.getvalue().count("\n") == 1


def test_kernel_options_from_the_environment_and_from_text():
    env = {"QWEN_TRT_CHAIN": "0", "QWEN_TRT_PAGED_SPLIT": "64", "QWEN_TRT_GEMV_4096x2560": "4:8:2"}
    opts = KernelOptions.from_env(env)
    assert (opts.chain, opts.paged_split, opts.pdl) == (False, 64, True)
    assert opts.gemv == {(4096, 2560): (4, 8, 2)}
    assert KernelOptions().with_text("attn_preload=0, gemv.8x16=1:4:8") == KernelOptions(
        attn_preload=False, gemv={(8, 16): (1, 4, 8)})
    with pytest.raises(ValueError, match="'fused_rope=0': expected NAME=VALUE"):
        KernelOptions().with_text("fused_rope=0")
    with pytest.raises(settings.SettingError, match="QWEN_TRT_GEMV_4096x2560='4:8'"):
        KernelOptions.from_env({"QWEN_TRT_GEMV_4096x2560": "4:8"})


def test_settings_imports_nothing_of_the_project():
    tree = ast.parse((ROOT / "qwen_trt" / "settings.py").read_text())
    mods = [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    mods += [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    assert not [m for m in mods if m and m.startswith("qwen_trt")]


def test_a_pattern_family_is_read_through_the_registry():
    env = {"QWEN_TRT_GEMV_4096x2560": " 4:8:2 ", "QWEN_TRT_GEMV_1024x2560": "  ",
           "QWEN_TRT_PDL": "0", "OTHER": "x"}
    assert settings.prefixed("QWEN_TRT_GEMV_", env) == {"4096x2560": "4:8:2"}
    with pytest.raises(KeyError):
        settings.prefixed("QWEN_TRT_PDL", env)          # a plain setting, not a pattern


def test_the_default_max_batch_is_written_once():
    """The registry documents the default the batched runner uses (fast/step/batched.py)."""
    from qwen_trt.params import DEFAULT_MAX_BATCH

    assert settings.declared("QWEN_TRT_MAX_BATCH").default_doc == f"`{DEFAULT_MAX_BATCH}`"
