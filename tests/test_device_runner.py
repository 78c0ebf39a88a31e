"""scripts/device.sh, the one device runner: every phase in scripts/device/ is listed in its
help, an unknown phase is refused in one line naming the phases, every script parses, and no
doc or script still names a per-issue device script (scripts/device_*.sh)."""
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RUNNER = ROOT / "scripts" / "device.sh"
PHASES = sorted(p.stem for p in (ROOT / "scripts" / "device").glob("*.sh") if p.stem != "common")


def run(*args):
    return subprocess.run(["bash", str(RUNNER), *args], capture_output=True, text=True, timeout=30)


def test_help_lists_every_phase():
    r = run()
    assert r.returncode == 2
    listed = re.findall(r"^  ([a-z][\w-]*) {2,}", r.stdout.split("Phases:", 1)[1], re.M)
    assert sorted(listed) == PHASES and len(PHASES) >= 10
    assert run("--help").returncode == 0


def test_an_unknown_phase_is_one_line():
    for bad in ("nope", "common"):
        r = run("ab", bad)
        assert r.returncode == 2 and r.stdout == ""
        assert r.stderr.count("\n") == 1 and f"unknown phase '{bad}'" in r.stderr
        assert all(p in r.stderr for p in PHASES)


def test_every_script_parses():
    for f in [RUNNER, *sorted((ROOT / "scripts" / "device").glob("*.sh"))]:
        r = subprocess.run(["bash", "-n", str(f)], capture_output=True, text=True)
        assert r.returncode == 0, f"{f.name}: {r.stderr}"


def test_no_per_issue_device_scripts_left():
    assert not list((ROOT / "scripts").glob("device_*.sh"))
    texts = [ROOT / "README.md", *(ROOT / "docs").glob("**/*.md"), *(ROOT / "scripts").rglob("*"),
             *(ROOT / "qwen_trt").rglob("*.py"), *(ROOT / "qwen_trt").rglob("*.md")]
    named = [str(p.relative_to(ROOT)) for p in texts
             if p.is_file() and re.search(r"device_(?!load_diag)\w+\.sh", p.read_text())]
    assert not named, f"these still name scripts/device_*.sh: {named}"
