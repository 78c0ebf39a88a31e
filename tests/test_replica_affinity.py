"""A chat stays on its replica behind deploy/nginx.conf (``hash $http_x_session_id``), so each
turn reuses the previous turn's KV (``usage.prompt_tokens_details.cached_tokens``); under
least_conn turns land on the replica that never saw the previous one; with one replica killed
the chat goes on on the other. Two ``qwen-trt serve`` replicas on the tiny model (CPU, the fast
path's batched runner, which has the prefix cache) behind Debian's nginx; skipped without it."""
from __future__ import annotations

import re
import signal
import time

import httpx
import pytest

from qwen_trt.serving.remote import SESSION_HEADER, session_key
from servers import NGINX_CONF, nginx_binary, start_nginx, start_serve

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(nginx_binary() is None, reason="needs nginx (apt-get install nginx)")]

TURNS = 6
SLACK = 32          # the prefix cache reuses whole blocks (32 tokens)


def user_text(chat: str, t: int) -> str:
    # each turn adds well over a block, so a turn served without the previous turn's KV shows
    return f"{chat} turn {t}: " + " ".join(f"w{(t * 13 + k) % 89}" for k in range(60))


def run_chat(url: str, chat: str, turns: int = TURNS, on_turn=None) -> list[tuple[int, int]]:
    """(prompt_tokens, cached_tokens) per turn of one chat, the session header as the openai
    backend sends it."""
    msgs = [{"role": "system", "content": f"You are chat {chat}."},
            {"role": "user", "content": user_text(chat, 0)}]
    out = []
    with httpx.Client(base_url=f"{url}/v1", timeout=120) as client:
        for t in range(turns):
            if on_turn is not None:
                on_turn(t)
            r = client.post("/chat/completions", headers={SESSION_HEADER: session_key(msgs)},
                            json={"model": "tiny", "messages": msgs, "max_tokens": 16,
                                  "temperature": 0, "ignore_eos": True})
            assert r.status_code == 200, r.text[:300]
            body = r.json()
            u = body["usage"]
            assert "prompt_tokens_details" in u, (t, u, out)
            out.append((u["prompt_tokens"], u["prompt_tokens_details"]["cached_tokens"]))
            msgs += [{"role": "assistant", "content": body["choices"][0]["message"]["content"]},
                     {"role": "user", "content": user_text(chat, t + 1)}]
    return out


def reused(turns: list[tuple[int, int]]) -> list[bool]:
    """For turns 2..n: whether the turn reused (nearly) all of the previous turn's prompt."""
    return [turns[t][1] >= turns[t - 1][0] - SLACK for t in range(1, len(turns))]


@pytest.fixture(scope="module")
def pair(tiny_model_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("affinity")
    # the engine in its own process, as `qwen-trt serve` runs by default (the suite's inline
    # mode serves through the backend's own stream, without the runner's prefix cache)
    replicas = [start_serve(tiny_model_dir, tmp, "--served-model-name", "tiny", "--fast", "on",
                            env={"QWEN_TRT_WORKER": "process"}, wait=False) for _ in range(2)]
    ngs = []
    try:
        for r in replicas:
            r.wait()
        ports = [r.port for r in replicas]
        ngs.append(start_nginx(tmp / "hash", ports))
        least = NGINX_CONF.read_text().replace("hash $qwen_trt_route consistent;", "least_conn;")
        assert "least_conn;" in least
        ngs.append(start_nginx(tmp / "least", ports, conf_text=least))
        yield replicas, ngs[0], ngs[1]
    finally:
        for ng in ngs:
            ng.stop()
        for r in replicas:
            r.stop()


def test_a_chat_keeps_its_replica_and_its_prefix_cache(pair):
    replicas, hashed, _ = pair
    turns = run_chat(hashed.url, "alpha")
    assert all(reused(turns)), turns
    assert len(set(re.findall(r"up=(\S+) sid=[0-9a-f]{32} ", hashed.access_log()))) == 1


def test_least_conn_loses_the_reuse(pair):
    _, _, least = pair
    turns = run_chat(least.url, "beta")
    assert reused(turns).count(False) >= 2, turns


def test_the_openai_backend_sends_the_session_header(pair):
    from qwen_trt.serving.remote import OpenAIConfig, OpenAIService
    from qwen_trt.params import SamplingParams

    _, hashed, _ = pair
    msgs = [{"role": "user", "content": "gamma"}]
    svc = OpenAIService(OpenAIConfig(f"{hashed.url}/v1", model="tiny"))
    try:
        reply = svc.submit(msgs, SamplingParams(max_new_tokens=2, temperature=0)).result(60)
        assert reply.metrics.finish_reason == "length", reply
    finally:
        svc.close()
    # nginx writes the line once the request is over, which may be just after the client saw it
    deadline = time.monotonic() + 10
    while f"sid={session_key(msgs)} " not in hashed.access_log():
        assert time.monotonic() < deadline, hashed.access_log()[-500:]
        time.sleep(0.05)


def test_a_killed_replica_moves_the_chat_without_an_error(pair):
    replicas, hashed, _ = pair
    victim = []

    def kill_after_three(t: int) -> None:
        if t == 3:
            ups = re.findall(r"up=127\.0\.0\.1:(\d+) sid=[0-9a-f]{32} ", hashed.access_log())
            (port,) = {int(p) for p in ups[-3:]}       # turns 0..2 went to one replica
            r = next(r for r in replicas if r.port == port)
            r.proc.send_signal(signal.SIGKILL)
            r.proc.wait(10)
            victim.append(r)

    turns = run_chat(hashed.url, "delta", on_turn=kill_after_three)
    assert victim and len(turns) == TURNS
    ok = reused(turns)
    assert all(ok[:2]), turns          # turns 2, 3 on the first replica
    assert not ok[2], turns            # turn 4 on the survivor: nothing to reuse
    assert all(ok[3:]), turns          # then the chat keeps the survivor
