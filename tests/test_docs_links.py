"""Every relative link in README.md and docs/ reaches a file of the tree, and every ``#anchor``
into a Markdown file names one of its headings (GitHub's slugs), so moving or renaming a doc or
a measurement cannot leave a dead link behind; docs/benchmarks.md says how to run every
benchmark module."""
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
_LINK = re.compile(r"\]\(([^)\s]+)\)")
_FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)
_CODE = re.compile(r"`[^`\n]*`")


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower().replace("`", ""))
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for line in _FENCE.sub("", path.read_text()).splitlines():
        m = re.match(r"#{1,6} (.+)", line)
        if m:
            s = slug(m.group(1))
            n = seen.get(s, 0)
            seen[s] = n + 1
            out.add(s if n == 0 else f"{s}-{n}")
    return out


def links(path: Path):
    for target in _LINK.findall(_CODE.sub("", _FENCE.sub("", path.read_text()))):
        if not re.match(r"[a-z]+:", target):            # http:, https:, mailto:
            yield target


def test_slugs_are_githubs():
    assert slug("Profilers: `python -m qwen_trt.bench.profile` and `kernel_bench`") == \
        "profilers-python--m-qwen_trtbenchprofile-and-kernel_bench"
    assert slug("Batch 1 (H200)") == "batch-1-h200"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(doc):
    bad = []
    for target in links(doc):
        file, _, anchor = target.partition("#")
        dest = (doc.parent / file).resolve() if file else doc
        if not dest.exists():
            bad.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            bad.append(f"{target}: no heading with that anchor")
    assert not bad, "\n".join(bad)


def test_the_manual_names_every_benchmark():
    manual = (ROOT / "docs" / "benchmarks.md").read_text()
    tools = {"process", "qwen_vocab", "shaped_model", "plot"}     # helpers, not benchmarks
    mods = [p.stem for p in (ROOT / "qwen_trt" / "bench").glob("*.py")
            if "def main" in p.read_text() and p.stem not in tools]
    assert len(mods) > 15
    missing = [m for m in mods if f"qwen_trt.bench.{m}" not in manual and f"`{m}`" not in manual]
    assert not missing, f"docs/benchmarks.md does not say how to run: {missing}"
