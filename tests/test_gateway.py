"""Scale-out behind a real LLM router: two ``qwen-trt serve`` replicas on the tiny model (CPU, the
engine process's batched runner with its prefix cache) behind the SGLang Model Gateway
(``sglang-router``, the dev extra) with its ``cache_aware`` policy, which routes on the request
text's prefix and needs no header. A multi-turn chat keeps landing on the replica that holds its
prefix (each turn reuses nearly all of the previous turn's prompt:
``usage.prompt_tokens_details.cached_tokens``); with that replica killed, the chat goes on on the
other one without an error. The replicas also publish KV-cache events (``--kv-events``, vLLM's
format, what llm-d's precise prefix scorer reads) to one subscriber: they must name the blocks
each replica stored and, once its 8192-token cache overflows, evicted. docs/deploy.md, "SGLang
Model Gateway" and "KV-cache events"."""
from __future__ import annotations

import re
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

pytest.importorskip("sglang_router")
pytest.importorskip("zmq")
pytest.importorskip("msgpack")

from kv_subscriber import Subscriber, removed_blocks, stored_blocks  # noqa: E402
from qwen_trt.serving.kv_events import block_hash  # noqa: E402
from servers import free_port, start_serve, wait_for  # noqa: E402

pytestmark = pytest.mark.slow
SLACK = 32          # the prefix cache reuses whole blocks (32 tokens)
# What deploy/docs say to run, on loopback; health checked every second, a worker taken out
# after one failed check or one refused request (the defaults are for real fleets)
GATEWAY_ARGS = ("--policy", "cache_aware", "--health-check-interval-secs", "1",
                "--health-failure-threshold", "1", "--cb-failure-threshold", "1",
                "--retry-max-retries", "3", "--retry-initial-backoff-ms", "50",
                "--log-level", "warn")


@dataclass
class Gateway:
    proc: subprocess.Popen
    port: int
    log: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def healthy(self) -> int:
        try:
            return int(httpx.get(f"{self.url}/readiness", timeout=2).json()["healthy_workers"])
        except (httpx.HTTPError, ValueError, KeyError):
            return -1

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)


def start_gateway(tmp: Path, worker_urls: list[str]) -> Gateway:
    port = free_port()
    log = tmp / "gateway.log"
    with open(log, "wb") as fh:
        proc = subprocess.Popen([sys.executable, "-m", "sglang_router.launch_router",
                                 "--host", "127.0.0.1", "--port", str(port),
                                 "--worker-urls", *worker_urls, *GATEWAY_ARGS],
                                stdout=fh, stderr=subprocess.STDOUT)
    gw = Gateway(proc, port, log)
    if not wait_for(lambda: gw.healthy() == len(worker_urls) or proc.poll() is not None, 60) \
            or proc.poll() is not None:
        gw.stop()
        raise RuntimeError(f"the gateway did not see its workers: {log.read_text()[-2000:]}")
    return gw


def served(url: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return sum(float(v) for v in re.findall(r"^qwen_trt_requests_total\{[^}]*\} (\S+)$", text,
                                            re.M))


def topic(i: int) -> str:
    return f"kv@replica-{i}@tiny"      # llm-d's topic layout: kv@<pod>@<model>


@pytest.fixture(scope="module")
def fleet(tiny_model_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gateway")
    sub = Subscriber("kv@")
    replicas = [start_serve(tiny_model_dir, tmp, "--served-model-name", "tiny", "--fast", "on",
                            "--kv-events", sub.endpoint, "--kv-events-topic", topic(i),
                            env={"QWEN_TRT_WORKER": "process"}, wait=False) for i in range(2)]
    gw = None
    try:
        for r in replicas:
            r.wait()
        gw = start_gateway(tmp, [r.url for r in replicas])
        yield replicas, gw, sub
    finally:
        if gw is not None:
            gw.stop()
        for r in replicas:
            r.stop()
        sub.close()


def user_text(chat: str, t: int) -> str:
    # each turn adds well over a block, so a turn served without the previous turn's KV shows
    return f"{chat} turn {t}: " + " ".join(f"w{(t * 13 + k) % 89}" for k in range(60))


class Chat:
    """One conversation through the gateway, as a client sends it: the whole history each turn,
    no session header."""

    def __init__(self, url: str, name: str) -> None:
        self.client = httpx.Client(base_url=f"{url}/v1", timeout=120)
        self.name = name
        self.msgs = [{"role": "system", "content": f"You are chat {name}."},
                     {"role": "user", "content": user_text(name, 0)}]
        self.turns: list[tuple[int, int]] = []      # (prompt_tokens, cached_tokens)

    def turn(self) -> None:
        r = self.client.post("/chat/completions", json={
            "model": "tiny", "messages": self.msgs, "max_tokens": 16, "temperature": 0,
            "ignore_eos": True})
        assert r.status_code == 200, r.text[:300]
        body = r.json()
        u = body["usage"]
        self.turns.append((u["prompt_tokens"], u["prompt_tokens_details"]["cached_tokens"]))
        self.msgs += [{"role": "assistant", "content": body["choices"][0]["message"]["content"]},
                      {"role": "user", "content": user_text(self.name, len(self.turns))}]

    def reused(self, t: int) -> bool:
        """Whether turn ``t`` reused (nearly) all of turn ``t - 1``'s prompt."""
        return self.turns[t][1] >= self.turns[t - 1][0] - SLACK


def test_a_chat_stays_on_the_replica_with_its_prefix(fleet):
    replicas, gw, sub = fleet
    where = []
    chat = Chat(gw.url, "alpha")
    for _ in range(4):
        before = [served(r.url) for r in replicas]
        chat.turn()
        after = [served(r.url) for r in replicas]
        (i,) = [k for k in range(2) if after[k] > before[k]]
        where.append(i)
    assert len(set(where)) == 1, where               # every turn on one replica
    assert all(chat.reused(t) for t in range(1, 4)), chat.turns
    assert chat.turns[0][1] == 0 and chat.turns[3][0] > chat.turns[0][0] + 3 * 60
    # the replica it stayed on announced the chat's blocks; the other one none of them
    ids = httpx.post(f"{replicas[where[0]].url}/tokenize", timeout=30,
                     json={"messages": chat.msgs[:-2]}).json()["tokens"]
    first = block_hash(None, ids[:SLACK])
    assert wait_for(lambda: first in stored_blocks(sub.events(topic(where[0]))), 10)
    assert first not in stored_blocks(sub.events(topic(1 - where[0])))


def test_a_replica_reports_the_blocks_it_stored_and_evicted(fleet):
    replicas, gw, sub = fleet
    r = replicas[1]
    prompts = []
    with httpx.Client(base_url=r.url, timeout=120) as client:
        for i in range(3):       # 3 x ~2.9k tokens: more than the 8192-token CPU cache
            msgs = [{"role": "user", "content": " ".join(f"p{i}w{k % 97}" for k in range(590))}]
            resp = client.post("/v1/chat/completions", json={
                "model": "tiny", "messages": msgs, "max_tokens": 2, "temperature": 0})
            assert resp.status_code == 200, resp.text[:200]
            prompts.append(client.post("/tokenize", json={"messages": msgs}).json()["tokens"])
    sub.quiet()
    mine = sub.events(topic(1))
    stored = stored_blocks(mine)
    bs = next(ev[4] for ev in mine if ev[0] == "BlockStored")
    chains = []
    for ids in prompts:     # each prompt's full blocks were stored, as one chain from its start
        assert len(ids) > 2048
        parent, chain = None, []
        for k in range((len(ids) - 1) // bs):
            h = block_hash(parent, ids[k * bs:(k + 1) * bs])
            assert stored.get(h) == (parent, ids[k * bs:(k + 1) * bs]), (k, len(ids))
            parent = h
            chain.append(h)
        chains.append(chain)
    removed = removed_blocks(mine)
    assert removed, "3 prompts of ~2.9k tokens overflow the cache: blocks were evicted"
    assert len(set(removed)) == len(removed) and set(removed) <= set(stored)
    # LRU, and a finished sequence's tail first: the first prompt's tail went, its head and the
    # last prompt stayed; the other replica evicted nothing
    assert chains[0][-1] in removed and chains[0][0] not in removed
    assert not set(removed) & set(chains[2])
    assert not removed_blocks(sub.events(topic(0)))
    assert not set(stored_blocks(sub.events(topic(0)))) & set(chains[0])


def test_a_killed_replica_the_chat_goes_on_on_the_other(fleet):
    replicas, gw, _ = fleet
    chat = Chat(gw.url, "beta")
    before = [served(r.url) for r in replicas]
    chat.turn()
    chat.turn()
    assert chat.reused(1), chat.turns
    (home,) = [k for k in range(2) if served(replicas[k].url) > before[k]]
    other = replicas[1 - home]
    replicas[home].proc.send_signal(signal.SIGKILL)
    replicas[home].proc.wait(10)
    n_other = served(other.url)
    chat.turn()                   # no error: the gateway retries it elsewhere
    chat.turn()
    assert served(other.url) == n_other + 2
    assert not chat.reused(2)     # the other replica never saw this chat...
    assert chat.reused(3), chat.turns   # ...and from then on it has it
    assert wait_for(lambda: gw.healthy() == 1, 30)
