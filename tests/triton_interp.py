"""The Triton-interpreter harness of the kernel tests (tests/test_fast_kernels_interpret.py,
tests/test_paged_kernels_interpret.py).

Triton is not a dependency of the CPU install, so ``make test-kernels`` puts a pinned copy in
``.venv-triton`` (``QWEN_TRT_TRITON_PATH`` points elsewhere) and each check runs in a subprocess
with ``TRITON_INTERPRET=1``; without Triton the tests skip."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from qwen_trt import settings

ROOT = Path(__file__).resolve().parents[1]
TRITON_PATH = str(ROOT / settings.get("QWEN_TRT_TRITON_PATH"))   # default .venv-triton


def interpret(code: str) -> dict:
    """Run ``code`` (which prints one JSON line last) under the Triton interpreter."""
    env = dict(os.environ, TRITON_INTERPRET="1",
               PYTHONPATH=os.pathsep.join([TRITON_PATH, str(ROOT)]))
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, cwd=ROOT,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module", autouse=True)
def triton_interpreter():
    """Skip the importing module's tests when Triton cannot be imported from TRITON_PATH."""
    env = dict(os.environ, PYTHONPATH=TRITON_PATH)
    r = subprocess.run([sys.executable, "-c", "import triton"], env=env, capture_output=True)
    if r.returncode:
        pytest.skip("Triton is not installed here (make test-kernels installs a copy)")
