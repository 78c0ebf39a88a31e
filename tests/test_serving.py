"""InferenceService: one backend, many threads, one request at a time, FIFO, clean cancellation."""
from __future__ import annotations

import threading

import pytest

from qwen_trt.backends.base import Backend, BackendInfo
from qwen_trt.serving.session import ChatSession
from qwen_trt.errors import QwenTrtError
from qwen_trt.params import SamplingParams
from service_checks import (check_cancel_mid_reply_leaves_engine_clean,
                            check_threads_get_their_own_replies)

from qwen_trt.serving.events import (Delta, RequestFailedError, Failed, Finished,
                                     ServiceClosedError, Started, Waiting)
from qwen_trt.serving.service import InferenceService

GREEDY = SamplingParams(max_new_tokens=40, temperature=0)
TIMEOUT = 30  # seconds; only a hang would ever reach it


class GatedBackend(Backend):
    """Yields the ids of "x" (forever, up to max_new_tokens) but only while ``gate`` is open;
    while closed it waits between tokens and honours cancel, like a real engine between steps."""

    def __init__(self, tokenizer) -> None:
        super().__init__()
        self._tok = tokenizer
        self.gate = threading.Event()
        self.running = threading.Event()      # set while a stream is active
        self.calls = 0
        self.fail_next = False
        self._x = tokenizer.encode("x", add_special_tokens=False)[0]

    @property
    def info(self) -> BackendInfo:
        return BackendInfo("gated", "fake", "cpu", "float32", 1023, 1024, ())

    @property
    def tokenizer(self):
        return self._tok

    def stream(self, prompt_ids, params):
        cancel = self._begin()
        self.calls += 1
        if self.fail_next:
            self.fail_next = False
            raise RuntimeError("boom")
        self.running.set()
        try:
            for _ in range(params.max_new_tokens):
                while not self.gate.wait(0.005):
                    if cancel.is_set():
                        return
                yield self._x
                if cancel.is_set():
                    return
        finally:
            self.running.clear()


def _prompt(tokenizer, text: str) -> list[int]:
    plan = ChatSession(tokenizer).prepare(text, max_input_len=1000, max_seq_len=2048,
                                          max_new_tokens=GREEDY.max_new_tokens)
    return plan.ids


@pytest.fixture
def tiny_service(tiny_backend):
    svc = InferenceService(tiny_backend)
    yield svc
    svc.close(free_backend=False)


@pytest.fixture
def gated(tiny_tokenizer):
    backend = GatedBackend(tiny_tokenizer)
    svc = InferenceService(backend)
    yield svc, backend
    backend.gate.set()
    svc.close()


def _collect(handle, out: dict, key: str) -> None:
    out[key] = list(handle.events(poll_s=0.01))


def test_concurrent_requests_get_complete_separate_replies(tiny_service, tiny_tokenizer):
    prompts = {"a": _prompt(tiny_tokenizer, "Hello, how are you today?"),
               "b": _prompt(tiny_tokenizer, "你好，世界！请用中文回答。")}
    alone = {k: tiny_service.submit(ids, GREEDY).result(TIMEOUT).text for k, ids in prompts.items()}
    assert alone["a"] != alone["b"]  # otherwise interleaving could not be detected

    events: dict[str, list] = {}
    handles = {k: tiny_service.submit(ids, GREEDY) for k, ids in prompts.items()}
    threads = [threading.Thread(target=_collect, args=(h, events, k)) for k, h in handles.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT)
    for key, evs in events.items():
        text = "".join(e.text for e in evs if isinstance(e, Delta))
        finished = [e for e in evs if isinstance(e, Finished)]
        assert len(finished) == 1 and evs[-1] is finished[0]
        assert [type(e) for e in evs if not isinstance(e, Waiting)][0] is Started
        assert text == finished[0].reply.text == alone[key]
        assert finished[0].reply.metrics.finish_reason in ("stop", "length")


def test_requests_from_many_threads_each_get_their_own_reply(tiny_service, tiny_tokenizer):
    texts = ["one", "two two", "three three three", "The quick brown fox"]
    check_threads_get_their_own_replies(tiny_service, [_prompt(tiny_tokenizer, t) for t in texts],
                                        GREEDY, TIMEOUT)


def test_cancel_mid_reply_leaves_engine_clean_for_next_request(tiny_service, tiny_tokenizer):
    ids = _prompt(tiny_tokenizer, "Please explain how a GPU reads weights")
    check_cancel_mid_reply_leaves_engine_clean(tiny_service, ids, GREEDY, TIMEOUT)


def test_cancel_frees_a_blocked_engine_at_once(gated, tiny_tokenizer):
    svc, backend = gated
    ids = _prompt(tiny_tokenizer, "hi")
    first = svc.submit(ids, SamplingParams(max_new_tokens=100, temperature=0))
    assert backend.running.wait(TIMEOUT)          # running, stuck before its first token
    first.cancel()                                # the gate never opens for it
    reply = first.result(TIMEOUT)
    assert reply.metrics.finish_reason == "cancelled" and reply.metrics.tokens == 0
    backend.gate.set()
    second = svc.submit(ids, SamplingParams(max_new_tokens=5, temperature=0, ignore_eos=True))
    r2 = second.result(TIMEOUT)
    assert r2.metrics.finish_reason == "length" and r2.text == "x" * 5


def test_queue_positions_wait_status_and_fifo(gated, tiny_tokenizer):
    svc, backend = gated
    ids = _prompt(tiny_tokenizer, "hi")
    params = SamplingParams(max_new_tokens=3, temperature=0, ignore_eos=True)
    a = svc.submit(ids, params)
    assert backend.running.wait(TIMEOUT)
    b, c, d = (svc.submit(ids, params) for _ in range(3))
    assert (a.position, b.position, c.position, d.position) == (0, 1, 2, 3)
    assert (a.state, b.state) == ("running", "queued")
    st = svc.status()
    assert st.busy and st.queued == 3

    # While queued, a reader sees "waiting" heartbeats that carry its position.
    events = c.events(poll_s=0.01)
    first = next(events)
    assert isinstance(first, Waiting) and first.position == 2

    b.cancel()                                     # a cancelled request no longer counts
    assert (c.position, d.position) == (1, 2)
    assert b.done and a.state == "running"         # finished at once, without the engine
    assert svc.status().queued == 2

    backend.gate.set()
    rest = list(events)
    assert isinstance(rest[-1], Finished) and rest[-1].reply.text == "xxx"
    assert d.result(TIMEOUT).text == "xxx"
    rb = b.result(TIMEOUT)
    assert rb.metrics.finish_reason == "cancelled" and rb.text == ""
    assert backend.calls == 3                      # a, c, d ran; b never reached the engine
    assert a.started_at < c.started_at < d.started_at
    assert c.waited_s > 0 and svc.status().queued == 0


def test_closing_the_reader_cancels_the_request(gated, tiny_tokenizer):
    svc, backend = gated
    handle = svc.submit(_prompt(tiny_tokenizer, "hi"), SamplingParams(max_new_tokens=50))
    events = handle.events(poll_s=0.01)
    next(events)
    events.close()                                 # e.g. the page was reloaded mid-reply
    assert handle.cancelled
    assert handle.result(TIMEOUT).metrics.finish_reason == "cancelled"


def test_backend_error_is_reported_and_worker_survives(gated, tiny_tokenizer):
    svc, backend = gated
    backend.gate.set()
    ids = _prompt(tiny_tokenizer, "hi")
    backend.fail_next = True
    bad = svc.submit(ids, SamplingParams(max_new_tokens=3, ignore_eos=True))
    evs = list(bad.events(poll_s=0.01))
    assert isinstance(evs[-1], Failed) and isinstance(evs[-1].error, RequestFailedError)
    assert "boom" in str(evs[-1].error) and "\n" not in str(evs[-1].error)
    with pytest.raises(QwenTrtError):
        bad.result(TIMEOUT)
    ok = svc.submit(ids, SamplingParams(max_new_tokens=3, ignore_eos=True)).result(TIMEOUT)
    assert ok.text == "xxx"


def test_close_cancels_waiting_requests_and_refuses_new_ones(tiny_tokenizer):
    backend = GatedBackend(tiny_tokenizer)
    svc = InferenceService(backend)
    ids = _prompt(tiny_tokenizer, "hi")
    a = svc.submit(ids, SamplingParams(max_new_tokens=10))
    b = svc.submit(ids, SamplingParams(max_new_tokens=10))
    assert backend.running.wait(TIMEOUT)
    svc.close()
    assert a.wait(TIMEOUT) and a.result().metrics.finish_reason == "cancelled"
    assert b.cancelled and b.wait(TIMEOUT)
    with pytest.raises(ServiceClosedError):
        svc.submit(ids, SamplingParams(max_new_tokens=10))


def test_the_three_services_share_one_protocol():
    from qwen_trt.serving.client import WorkerClient
    from qwen_trt.serving.remote import OpenAIService
    from qwen_trt.serving.service import Service

    members = ("info", "tokenizer", "submit_plan", "status", "close")
    for cls in (InferenceService, WorkerClient, OpenAIService):
        missing = [m for m in members if not hasattr(cls, m)]
        assert not missing, f"{cls.__name__} lacks {missing}"
    assert not hasattr(OpenAIService, "takes_messages")


def test_in_process_service_reports_whether_it_accepts(tiny_tokenizer):
    svc = InferenceService(GatedBackend(tiny_tokenizer))
    assert svc.status().accepting
    svc.close()
    assert svc.status().state == "closed" and not svc.status().accepting
