"""Write a seed of tuned choices (qwen_trt/fast/seeds/) from a warm compile-cache folder.

    python scripts/tune_seed.py [FOLDER] OUT.json --source "H200, 2026-12-01, serve --max-batch 32"

FOLDER: a complete folder under the cache root (default: the newest one with key.json and
autotune.json under $QWEN_TRT_CACHE_DIR or ~/.cache/qwen-trt). Run it where the tuners' Triton
is importable (the machine that measured them), so their configuration lists are fingerprinted.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from qwen_trt.fast.compile_cache import cache_root, make_seed, tuners  # noqa: E402


def newest_folder(root: Path) -> Path | None:
    done = [p for p in root.glob("*") if (p / "key.json").is_file()
            and (p / "autotune.json").is_file()]
    return max(done, key=lambda p: (p / "key.json").stat().st_mtime) if done else None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("paths", nargs="+", help="[FOLDER] OUT.json")
    p.add_argument("--source", required=True, help="where and when the choices were measured")
    a = p.parse_args(argv)
    if len(a.paths) > 2:
        p.error("give [FOLDER] OUT.json")
    out = Path(a.paths[-1])
    folder = Path(a.paths[0]) if len(a.paths) == 2 else newest_folder(cache_root())
    if folder is None or not (folder / "autotune.json").is_file():
        print(f"tune_seed: no complete cache folder ({folder or cache_root()})", file=sys.stderr)
        return 2
    seed = make_seed(folder, tuners(), a.source)
    out.write_text(json.dumps(seed, indent=1, sort_keys=True) + "\n")
    rows = sum(len(v) for v in seed["choices"].values() if isinstance(v, dict))
    print(f"wrote {out}: {rows} choices from {folder}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
