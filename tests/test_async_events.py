"""Handle events onto an asyncio loop without a thread per request (serving/async_events.py),
and the server's prompt encoder (api/encoder.py)."""
from __future__ import annotations

import asyncio
import contextlib
import threading

from qwen_trt.params import Reply, ReplyMetrics, SamplingParams
from qwen_trt.serving.async_events import batch, handle_batches, merge_deltas, sink_for
from qwen_trt.serving.events import Delta, Failed, Finished, RequestHandle, Started

REPLY = Reply("", ReplyMetrics())


class Owner:
    def __init__(self) -> None:
        self.cancelled: list[int] = []

    def _position(self, handle) -> int:
        return 0

    def _cancel(self, handle) -> None:
        self.cancelled.append(handle.id)


def handles(n: int, owner=None):
    owner = owner or Owner()
    return [RequestHandle(owner, i, [1, 2], SamplingParams(max_new_tokens=8), 0)
            for i in range(n)]


def test_one_loop_wakeup_per_step_for_all_requests_in_order():
    hs = handles(16)
    steps = 5
    loop = asyncio.new_event_loop()
    got: dict[int, list] = {h.id: [] for h in hs}
    ready = threading.Event()

    async def one(h):
        async for items in handle_batches(h, poll_s=5.0):
            got[h.id].append(items)

    async def main():
        tasks = [asyncio.ensure_future(one(h)) for h in hs]
        await asyncio.sleep(0)            # every handle has its listener
        ready.set()
        await asyncio.gather(*tasks)

    def produce():
        ready.wait(10)
        for h in hs:
            h._emit(Started(0.0))           # emitted before anyone listens would also arrive
        for s in range(steps):
            while sink._pending:            # the loop has taken what came before
                threading.Event().wait(0.001)
            before = sink.wakeups
            with batch():
                for h in hs:
                    h._emit(Delta(f"{s},"))
            # the next step only once the loop has taken this one (like an engine step)
            while sink.wakeups == before:
                threading.Event().wait(0.001)
        with batch():
            for h in hs:
                h._emit(Finished(REPLY))

    sink = sink_for(loop)
    t = threading.Thread(target=produce)
    t.start()
    loop.run_until_complete(asyncio.wait_for(main(), 30))
    t.join(10)
    loop.close()
    for h in hs:
        flat = [ev for items in got[h.id] for ev in items]
        assert "".join(ev.text for ev in flat if isinstance(ev, Delta)) == "0,1,2,3,4,"
        assert isinstance(flat[-1], Finished)
        assert all(len([e for e in items if isinstance(e, Delta)]) <= 1
                   for items in got[h.id])     # one step's delta per wake-up here
    # the 16 Started (unbatched, maybe coalesced) + 5 steps + the finish: never one per event
    assert steps + 1 < sink.wakeups <= steps + 1 + len(hs)
    assert sink.delivered == len(hs) * (steps + 2)


def test_events_emitted_before_listening_come_first_and_leaving_cancels():
    owner = Owner()
    (h,) = handles(1, owner)
    h._emit(Started(0.0))
    h._emit(Delta("a"))
    loop = asyncio.new_event_loop()

    async def first_batch():
        async with contextlib.aclosing(handle_batches(h, poll_s=5.0)) as it:
            async for items in it:
                return items

    items = loop.run_until_complete(first_batch())
    loop.close()
    assert [type(e) for e in items] == [Started, Delta]
    assert owner.cancelled == [0]        # left before Finished: the request is cancelled


def test_heartbeat_is_an_empty_batch():
    (h,) = handles(1)
    loop = asyncio.new_event_loop()

    async def first_batch():
        async for items in handle_batches(h, poll_s=0.01):
            return items

    assert loop.run_until_complete(first_batch()) == []
    loop.close()


def test_merge_deltas_joins_runs_only():
    f = Failed(RuntimeError("x"))
    out = merge_deltas([Delta("a"), Delta("b"), Started(0.0), Delta("c"), f])
    assert [type(e) for e in out] == [Delta, Started, Delta, Failed]
    assert out[0].text == "ab" and out[2].text == "c"


def test_prompt_encoder_matches_encode_messages_and_reuses_reply_ids(tiny_tokenizer):
    from qwen_trt.api.encoder import PromptEncoder
    from qwen_trt.api.prompt import encode_messages

    enc = PromptEncoder(tiny_tokenizer)
    turn1 = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}]
    ids1 = enc.encode(turn1)
    assert ids1 == encode_messages(tiny_tokenizer, turn1)
    assert enc.encode(turn1) == ids1                      # from the caches
    # a reply whose ids differ from what its text would encode to (as generated ids can)
    reply_text = "hi you"
    text_ids = tiny_tokenizer.encode(reply_text, add_special_tokens=False)
    generated = [i for t in reply_text for i in tiny_tokenizer.encode(t, add_special_tokens=False)]
    assert tiny_tokenizer.decode(generated) == reply_text and generated != text_ids
    turn2 = turn1 + [{"role": "assistant", "content": reply_text},
                     {"role": "user", "content": "more"}]
    plain = enc.encode(turn2)
    enc.remember(reply_text, generated)
    reused = enc.encode(turn2)
    assert plain == encode_messages(tiny_tokenizer, turn2)
    assert reused[:len(ids1)] == ids1
    assert reused[len(ids1):len(ids1) + len(generated)] == generated     # the engine's own ids
    assert tiny_tokenizer.decode(reused) == tiny_tokenizer.decode(plain)


def test_sse_events_survive_a_splitlines_reader():
    import json

    from qwen_trt.api.server import _data

    text = "a\u2028b\u2029c\x85d\r\ne\x1cf"
    frame = _data({"content": text})
    body = frame.removeprefix("data: ").removesuffix("\n\n")
    assert len(body.splitlines()) == 1            # one event, one line, for any line reader
    assert json.loads(body)["content"] == text
