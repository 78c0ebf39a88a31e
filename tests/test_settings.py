"""Every QWEN_TRT_* variable is declared once (qwen_trt/settings.py); the options, the README's
configuration table and the code agree with the declarations."""
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


def code_vars() -> set[str]:
    """QWEN_TRT_* names written as string constants in the package and app.py."""
    names = set()
    for p in [*(ROOT / "qwen_trt").rglob("*.py"), ROOT / "app.py"]:
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                names.update(re.findall(r"\bQWEN_TRT_[A-Z0-9_]*[A-Z0-9]\b", node.value))
    return names


def test_names_are_declared_once():
    names = [s.name for s in settings.SETTINGS]
    assert len(names) == len(set(names))
    assert all(n.startswith(settings.PREFIX) for n in names)
    assert all(s.doc and "\n" not in s.doc for s in settings.SETTINGS)


def test_every_variable_the_code_names_is_declared():
    missing = []
    for name in sorted(code_vars()):
        try:
            settings.declared(name)
        except KeyError:
            missing.append(name)
    assert not missing, f"declare these in qwen_trt/settings.py: {missing}"


def test_backend_options_match_their_declarations():
    for o in OPTIONS:
        s = settings.declared(o.env)
        assert s.flag == o.flag, o.env


def test_readme_table_lists_the_user_settings_and_nothing_undeclared():
    in_readme = readme_config_vars()
    for name in in_readme:
        settings.declared(name)
    users = {s.name for s in settings.SETTINGS if s.group == "user"}
    assert users <= in_readme, f"README's Configuration table lacks {sorted(users - in_readme)}"


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
