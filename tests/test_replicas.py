"""Scale-out on loopback: two ``qwen-trt serve`` replicas on the tiny model behind a real nginx
running deploy/nginx.conf (Debian's package; skipped without it). Requests spread over both;
killing one replica mid-stream ends that stream without a finish_reason (the openai backend
says so in one line and keeps the partial text); new requests succeed on the survivor."""
from __future__ import annotations

import re
import signal
import threading
import time

import httpx
import pytest

openai = pytest.importorskip("openai")

from qwen_trt.serving.remote import OpenAIConfig, OpenAIService  # noqa: E402
from qwen_trt.params import SamplingParams  # noqa: E402
from qwen_trt.serving.events import Delta, Failed, Finished  # noqa: E402
from servers import nginx_binary, start_nginx, start_serve  # noqa: E402

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(nginx_binary() is None, reason="needs nginx (apt-get install nginx)")]


PUBLIC_NAME = "chat.example.test"


def served_count(url: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return sum(float(v) for v in re.findall(r"^qwen_trt_requests_total\{[^}]*\} (\S+)$", text, re.M))


def running(url: str) -> float:
    m = re.search(r"^qwen_trt_requests_running (\S+)$",
                  httpx.get(f"{url}/metrics", timeout=10).text, re.M)
    return float(m.group(1)) if m else 0.0


@pytest.fixture(scope="module")
def cluster(tiny_model_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("replicas")
    # the name clients reach nginx by (nginx passes their Host on: docs/deploy.md)
    replicas = [start_serve(tiny_model_dir, tmp, "--served-model-name", "tiny",
                            "--allowed-hosts", PUBLIC_NAME, wait=False) for _ in range(2)]
    ng = None
    try:
        for r in replicas:
            r.wait()
        ng = start_nginx(tmp / "nginx", [r.port for r in replicas])
        yield replicas, ng
    finally:
        if ng is not None:
            ng.stop()
        for r in replicas:
            r.stop()


def test_replicas_behind_nginx_answer_its_names_and_refuse_others(cluster):
    _replicas, ng = cluster
    port = ng.url.rsplit(":", 1)[1]
    for host, status in ((f"127.0.0.1:{port}", 200), (f"localhost:{port}", 200),
                         (PUBLIC_NAME, 200), (f"rebind.example.test:{port}", 421)):
        r = httpx.get(f"{ng.url}/v1/models", headers={"Host": host}, timeout=30)
        assert r.status_code == status, (host, r.text[:200])
    r = httpx.post(f"{ng.url}/v1/chat/completions", content=b'{"messages": []}', timeout=30,
                   headers={"Content-Type": "text/plain"})
    assert r.status_code == 415


def test_requests_spread_over_both_replicas(cluster):
    replicas, ng = cluster
    client = openai.OpenAI(base_url=f"{ng.url}/v1", api_key="none", max_retries=0, timeout=60)
    errors: list[BaseException] = []

    def one(i):
        try:
            chunks = list(client.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": f"hello {i}"}],
                max_tokens=16, temperature=0, stream=True))
            assert chunks[-1].choices[0].finish_reason in ("stop", "length")
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    # no X-Session-Id: nginx routes each on a random key (16 requests all on one replica:
    # p = 2^-15)
    threads = [threading.Thread(target=one, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    counts = [served_count(r.url) for r in replicas]
    assert sum(counts) == 16 and min(counts) >= 1, counts
    ups = set(re.findall(r"up=(127\.0\.0\.1:\d+)", ng.access_log()))
    assert ups == {f"127.0.0.1:{r.port}" for r in replicas}


def test_killing_a_replica_mid_stream_then_the_survivor_serves(cluster):
    replicas, ng = cluster
    svc = OpenAIService(OpenAIConfig(f"{ng.url}/v1", model="tiny"))
    try:
        h = svc.submit([{"role": "user", "content": "a long story"}],
                       SamplingParams(max_new_tokens=3000, temperature=0, ignore_eos=True))
        events = h.events(poll_s=0.05)
        for ev in events:
            if isinstance(ev, Delta) and len(h.text) > 10:
                break
        victim = None
        for _ in range(100):
            busy = [r for r in replicas if running(r.url) >= 1]
            if busy:
                victim = busy[0]
                break
            time.sleep(0.05)
        assert victim is not None
        victim.proc.send_signal(signal.SIGKILL)
        victim.proc.wait(10)
        last = None
        deadline = time.monotonic() + 30
        for ev in events:
            if isinstance(ev, (Finished, Failed)):
                last = ev
            assert time.monotonic() < deadline
        assert isinstance(last, Failed), last
        line = str(last.error)
        assert "went away mid-reply" in line and "partial reply is kept" in line
        assert "\n" not in line and len(h.text) > 10
    finally:
        svc.close()
    # new requests all land on the survivor (nginx skips the dead one)
    survivor = next(r for r in replicas if r is not victim)
    before = served_count(survivor.url)
    client = openai.OpenAI(base_url=f"{ng.url}/v1", api_key="none", max_retries=0, timeout=60)
    for i in range(4):
        r = client.chat.completions.create(model="tiny", max_tokens=4, messages=[
            {"role": "user", "content": f"after {i}"}])
        assert r.choices[0].finish_reason in ("stop", "length")
    assert served_count(survivor.url) == before + 4


def test_compose_runs_the_tested_nginx_conf_against_its_replicas():
    yaml = pytest.importorskip("yaml")
    from servers import NGINX_CONF, ROOT

    compose = yaml.safe_load((ROOT / "docker" / "compose.yaml").read_text())
    services = compose["services"]
    ports = {}
    for name, svc in services.items():
        if name.startswith("serve"):
            assert svc["network_mode"] == "host", name     # loopback stays the host's loopback
            cmd = svc["command"]
            assert cmd[:2] == ["qwen-trt", "serve"]
            port = cmd[cmd.index("--port") + 1]
            assert port in " ".join(svc["healthcheck"]["test"])
            if name != "serve":
                ports[name] = port
                (dev,) = svc["deploy"]["resources"]["reservations"]["devices"]
                assert dev["device_ids"] == [name.split("-")[1]] and "count" not in dev
    assert services["serve"]["command"][-1] == "8000"
    conf = NGINX_CONF.read_text()
    assert sorted(re.findall(r"server 127\.0\.0\.1:(\d+) ", conf)) == sorted(ports.values())
    assert "listen 127.0.0.1:8000;" in conf
    nginx = services["nginx"]
    assert nginx["network_mode"] == "host" and set(nginx["depends_on"]) == set(ports)
    assert "../deploy/nginx.conf:/etc/qwen-trt/nginx.conf:ro" in nginx["volumes"]
    assert {s for s, svc in services.items() if "replicas" in svc.get("profiles", [])} \
        == set(ports) | {"nginx"}
