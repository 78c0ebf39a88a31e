"""The chat UI's Streamlit-free logic: sanitising, block splitting, chunk coalescing, footers,
and the per-session state that commits interrupted replies exactly once."""
from __future__ import annotations


import pytest

from fakes import ScriptedBackend
from qwen_trt.serving.session import ChatSession
from qwen_trt.params import Reply, ReplyMetrics, SamplingParams
from qwen_trt.serving.events import Delta, Finished, Started, Waiting
from qwen_trt.serving.service import InferenceService
from qwen_trt.ui.state import ChatState, TurnNote
from qwen_trt.ui.stream import StreamView, coalesce
from qwen_trt.errors import PromptTooLongError
from qwen_trt.ui.text import (CSS_CLASS, CURSOR, dropped_note, markdown_html, reply_footer,
                              stable_prefix_end, user_error, waiting_label)

# markdown_html: tests/test_markdown_sanitiser.py (and in Chromium, test_markdown_browser.py)


# -- stable_prefix_end / StreamView ------------------------------------------------------------


@pytest.mark.parametrize("text, prefix", [
    ("one line", ""),
    ("para one\n\npara two", "para one\n\n"),
    ("a\n\nb\n\nc d", "a\n\nb\n\n"),
    ("a\n\n    indented code", ""),                   # an indented line may continue a block
    ("```py\nx = 1\n\ny = 2\n", ""),                   # blank line inside an open fence
    ("```py\nx = 1\n\ny = 2\n```\n\nafter", "```py\nx = 1\n\ny = 2\n```\n\n"),
    ("a\n\n", ""),                                     # what follows is not known yet
])
def test_stable_prefix_end(text, prefix):
    assert text[:stable_prefix_end(text)] == prefix


def _inner(html: str) -> str:
    wrap = f'<div class="{CSS_CLASS}">'
    assert html.startswith(wrap) and html.endswith("</div>")
    return html[len(wrap):-len("</div>")]


def test_stream_view_renders_final_blocks_once_and_a_small_tail():
    view = StreamView()
    pieces = ["Hello", " world.\n", "\nSecond ", "para ![i](http://x/y)", "\n\nThird"]
    blocks, tails = [], []
    for p in pieces:
        u = view.add(p)
        blocks += u.new_blocks
        tails.append(u.tail)
    assert blocks == [markdown_html("Hello world.\n\n"),
                      markdown_html("Second para ![i](http://x/y)\n\n")]
    assert "![i](http://x/y)" in blocks[1] and "<img" not in blocks[1]   # the image as text
    assert _inner(tails[-1]) == f"<p>Third{CURSOR}</p>\n"
    assert all(CURSOR in t for t in tails)
    # the blocks read as the whole reply
    assert "".join(_inner(b) for b in blocks + [markdown_html("Third")]) == \
        _inner(markdown_html("".join(pieces)))


def test_stream_view_draws_the_cursor_where_the_text_ends():
    view = StreamView()
    assert _inner(view.add("```py\nx = 1\n").tail) == \
        f"<pre><code>x = 1\n{CURSOR}</code></pre>\n"                    # in the code
    assert _inner(view.add("```\n").tail).endswith(f"</code></pre>\n<p>{CURSOR}</p>\n")


# -- coalesce -----------------------------------------------------------------------------------


class FakeClock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def _timed(clock: FakeClock, items):
    for t, ev in items:
        clock.t = t
        yield ev


def test_coalesce_merges_deltas_within_interval_and_keeps_order():
    clock = FakeClock()
    r = Reply("abcdef", ReplyMetrics())
    items = [(0.000, Started(0.0)), (0.001, Delta("a")), (0.010, Delta("b")), (0.020, Delta("c")),
             (0.035, Delta("d")), (0.040, Delta("e")), (0.050, Waiting(0, 0.05)),
             (0.080, Waiting(0, 0.08)), (0.081, Delta("f")), (0.090, Finished(r))]
    out = list(coalesce(_timed(clock, items), interval_s=0.03, clock=clock))
    assert out == [Started(0.0), Delta("a"), Delta("bcd"), Waiting(0, 0.05),
                   Delta("e"), Waiting(0, 0.08), Delta("f"), Finished(r)]


def test_coalesce_flushes_pending_text_at_the_end():
    clock = FakeClock()
    out = list(coalesce(_timed(clock, [(0, Delta("a")), (0.001, Delta("b"))]), 0.03, clock))
    assert out == [Delta("a"), Delta("b")]


def test_coalesce_bounds_chunks_for_a_long_fast_stream():
    clock = FakeClock()
    items = [(i * 0.001, Delta("t")) for i in range(3000)]    # 3000 tokens in 3 s
    out = list(coalesce(_timed(clock, items), interval_s=0.03, clock=clock))
    assert "".join(d.text for d in out) == "t" * 3000
    assert len(out) <= 3.0 / 0.03 + 2


# -- footers and labels -------------------------------------------------------------------------


def test_reply_footer_and_notes():
    done = Reply("x", ReplyMetrics(ttft_ms=42.4, tokens=120, decode_tok_s=87.26, finish_reason="stop"))
    assert reply_footer(done) == "first token 42 ms · 120 tokens · 87.3 tokens/s"
    cut = Reply("x", ReplyMetrics(ttft_ms=1500, tokens=9, decode_tok_s=5, finish_reason="length"))
    assert reply_footer(cut, waited_s=2.04) == (
        "first token 1.50 s · 9 tokens · 5.0 tokens/s · stopped at max length · "
        "waited 2.0 s for the engine")
    assert reply_footer(Reply("", ReplyMetrics(finish_reason="cancelled"))) == \
        "interrupted before the first token"
    assert "interrupted" in reply_footer(Reply("ab", ReplyMetrics(tokens=2, finish_reason="cancelled")))
    assert dropped_note(0) == ""
    assert "1 oldest turn was left out" in dropped_note(1)
    assert "3 oldest turns were left out" in dropped_note(3)
    assert waiting_label(0, 3) == ""
    assert waiting_label(2, 3.4) == "Waiting for the engine: 2 requests ahead of yours (3 s)"


def test_user_error_lines():
    assert user_error(PromptTooLongError("Too long: shorten it.")) == "Too long: shorten it."
    line = user_error(ValueError("bad thing\n  at frame 1"), "loading the engine")
    assert line.startswith("Unexpected error while loading the engine (ValueError: bad thing)")
    assert "\n" not in line and "frame" not in line
    assert "(KeyError: 'k')" in user_error(KeyError("k"))
    assert "(RuntimeError)" in user_error(RuntimeError())


# -- ChatState ----------------------------------------------------------------------------------


@pytest.fixture
def text_service(tiny_tokenizer):
    backend = ScriptedBackend(tiny_tokenizer, "Hello world")
    svc = InferenceService(backend)
    yield svc, backend
    backend.gate.set()
    svc.close()


PARAMS = SamplingParams(max_new_tokens=64, temperature=0)


def test_chat_state_commits_a_finished_reply_once(text_service, tiny_tokenizer):
    svc, _ = text_service
    state = ChatState(ChatSession(tiny_tokenizer))
    pending = state.start("hi", svc.submit([1, 2, 3], PARAMS))
    assert pending.handle.wait(30)
    reply = state.commit_pending(pending)
    assert reply is not None and reply.text == "Hello world"
    assert state.commit_pending(pending) is None            # the other thread loses the race
    [(u, a, note)] = state.turns()
    assert (u.content, a.content, a.interrupted) == ("hi", "Hello world", False)
    assert note.footer.startswith("first token")


def test_chat_state_keeps_an_interrupted_reply(text_service, tiny_tokenizer):
    svc, backend = text_service
    backend.gate.clear()
    state = ChatState(ChatSession(tiny_tokenizer))
    state.start("first", svc.submit([1, 2, 3], PARAMS))
    # The next run (a new message) commits the old one, cancelled, before starting its own.
    backend.gate.set()
    state.commit_pending()
    [(u, a, note)] = state.turns()
    assert u.content == "first" and a.interrupted
    assert "Hello world".startswith(a.content)
    assert "interrupted" in note.footer
    assert state.pending is None


def test_chat_state_clear_cancels_and_forgets(text_service, tiny_tokenizer):
    svc, backend = text_service
    state = ChatState(ChatSession(tiny_tokenizer))
    state.start("a", svc.submit([1], PARAMS))
    state.commit_pending()
    backend.gate.clear()
    pending = state.start("b", svc.submit([1], PARAMS))
    state.clear()
    assert state.chat.messages == [] and state.turns() == [] and state.pending is None
    assert pending.handle.cancelled
    assert pending.handle.result(30).metrics.finish_reason == "cancelled"
    assert state.commit_pending(pending) is None             # nothing comes back after clear
    assert state.chat.messages == []


def test_interrupting_a_queued_reply_does_not_wait_for_the_engine(text_service, tiny_tokenizer):
    svc, backend = text_service
    backend.gate.clear()
    other = svc.submit([1], PARAMS)                    # another session holds the engine
    state = ChatState(ChatSession(tiny_tokenizer))
    pending = state.start("mine", svc.submit([1], PARAMS))
    assert pending.handle.position == 1
    reply = state.commit_pending()
    assert pending.handle.done and not other.done      # finished without the engine
    assert reply.text == "" and reply.metrics.finish_reason == "cancelled"
    [(u, a, note)] = state.turns()
    assert (u.content, a.content, a.interrupted) == ("mine", "", True)
    assert note.footer == "interrupted before the first token"
    backend.gate.set()
    assert other.result(30).text == "Hello world"


def test_stream_view_scans_only_the_open_tail_yet_agrees_with_a_full_scan():
    import random

    rng = random.Random(0)
    atoms = ["a", "b ", "\n", "\n\n", "```", "~~~", "    ", "x", "`", "#", "\r\n"]
    for _ in range(500):
        view, full = StreamView(), ""
        for _ in range(rng.randrange(1, 30)):
            delta = "".join(rng.choice(atoms) for _ in range(rng.randrange(1, 4)))
            view.add(delta)
            full += delta
            assert view.frozen == stable_prefix_end(full), full


# -- reload store, transcript, progress, settings (issue 15) ------------------------------------

def test_session_store_is_bounded_expiring_and_copies():
    from qwen_trt.ui.store import SessionStore, looks_like_session_id, new_session_id

    now = [0.0]
    store = SessionStore(max_chats=2, ttl_s=10, clock=lambda: now[0])
    a, b, c = new_session_id(), new_session_id(), new_session_id()
    assert len({a, b, c}) == 3 and all(map(looks_like_session_id, (a, b, c)))
    assert not looks_like_session_id("../etc") and not looks_like_session_id(None)
    snap = {"messages": [{"role": "user", "content": "hi"}]}
    store.put(a, snap)
    snap["messages"].clear()                          # the store kept its own copy
    assert store.get(a)["messages"][0]["content"] == "hi"
    store.get(a)["messages"].clear()                  # and hands out copies
    assert store.get(a)["messages"]
    store.put(b, {})
    now[0] = 5
    assert store.get(a) is not None                   # a used last: b is the LRU one
    store.put(c, {})
    assert store.get(b) is None and store.get(a) is not None and len(store) == 2
    now[0] = 14.9
    assert store.get(a) is not None                   # used at 5: still fresh
    now[0] = 30
    assert store.get(a) is None and store.get(c) is None and len(store) == 0
    with pytest.raises(ValueError):
        SessionStore(max_chats=0)


def test_chat_state_pop_snapshot_restore(tiny_tokenizer):
    state = ChatState(ChatSession(tiny_tokenizer))
    assert state.pop_last_turn() is None
    state.chat.add_exchange("q1", "a1")
    state.chat.add_exchange("q2", "a2", interrupted=True)
    state.notes += [TurnNote("f1"), TurnNote("f2", metrics={"tokens": 3})]
    snap = state.snapshot()
    assert state.pop_last_turn() == "q2"
    assert [m.content for m in state.chat.messages] == ["q1", "a1"] and len(state.notes) == 1
    other = ChatState(ChatSession(tiny_tokenizer))
    other.restore(snap)
    assert [(m.content, m.interrupted) for m in other.chat.messages][-1] == ("a2", True)
    assert other.notes[1].metrics == {"tokens": 3}


def test_transcript_markdown_quotes_messages_and_json_has_metrics():
    import json

    from qwen_trt.ui.transcript import to_json, to_markdown

    snap = {"system_prompt": "be brief",
            "messages": [{"role": "user", "content": "show ```code```", "interrupted": False},
                         {"role": "assistant", "content": "<b>x</b>", "interrupted": True}],
            "notes": [{"footer": "first token 5 ms", "dropped_turns": 0,
                       "metrics": {"tokens": 2, "finish_reason": "stopped"},
                       "params": {"temperature": 0.5}}]}
    md = to_markdown(snap, {"temperature": 0.5}, "torch · tiny")
    assert "````text\nshow ```code```\n````" in md     # a fence longer than any run inside
    assert "<b>x</b>" in md and "be brief" in md and "first token 5 ms" in md
    doc = json.loads(to_json(snap, {"temperature": 0.5}, "torch · tiny"))
    assert doc["settings"] == {"temperature": 0.5, "system_prompt": "be brief"}
    assert doc["messages"][1] == {"role": "assistant", "content": "<b>x</b>", "interrupted": True}
    assert doc["replies"] == [{"turn": 1, "metrics": {"tokens": 2, "finish_reason": "stopped"},
                               "params": {"temperature": 0.5}, "footer": "first token 5 ms",
                               "dropped_turns": 0}]


def test_background_load_reports_tqdm_bars_stages_and_errors():
    import threading

    from tqdm import tqdm

    from qwen_trt.ui.progress import BackgroundLoad

    go, halfway = threading.Event(), threading.Event()

    def load(report):
        report("Fetching weights", None, "model.safetensors")
        with tqdm(total=8_000_000, unit="B", desc="Downloading", disable=False) as bar:
            bar.update(2_000_000)
            halfway.set()
            go.wait(5)
        return "service"

    job = BackgroundLoad(load)
    assert halfway.wait(5)
    events = job.events()
    assert events[0].stage == "Fetching weights" and "model.safetensors" in events[0].detail
    bar = next(e for e in events if e.stage == "Downloading")
    assert bar.fraction == pytest.approx(0.25) and bar.detail == "2.0 MB of 8.0 MB"
    assert not job.done
    go.set()
    assert job.result() == "service" and job.done and not job.failed

    def broken(report):
        raise PromptTooLongError("nope")

    bad = BackgroundLoad(broken)
    assert bad.wait(5) and bad.failed
    with pytest.raises(PromptTooLongError):
        bad.result()


def test_settings_make_validated_sampling_params():
    from qwen_trt.ui.settings import SLIDERS, params_from, settings_dict, slider_args

    keys = [s.key for s in SLIDERS]
    assert keys[:4] == ["max_new_tokens", "temperature", "top_p", "top_k"]
    p = params_from({"max_new_tokens": 256.0, "temperature": 0.2, "top_k": 7})
    assert (p.max_new_tokens, p.temperature, p.top_k, p.top_p) == (256, 0.2, 7, 0.8)
    from qwen_trt.ui.settings import slider_defaults

    assert "value" not in slider_args(SLIDERS[0])   # the value lives in session state only
    defaults = slider_defaults()
    assert isinstance(defaults["max_new_tokens"], int) and defaults["temperature"] == 0.7
    assert set(settings_dict(p)) == set(keys)
    with pytest.raises(ValueError):
        params_from({"top_p": 1.5})                  # checked once, by SamplingParams


def test_stage_writer_turns_printed_lines_into_stages():
    from qwen_trt.ui.progress import StageWriter

    got = []
    w = StageWriter(lambda stage, *a: got.append(stage), prefix="[qwen-trt engine]")
    w.write("[qwen-trt engine] loading weights (1.2 s)\n[qwen-trt engine] capt")
    w.write("uring graphs\n\n")
    assert got == ["loading weights (1.2 s)", "capturing graphs"]


def test_session_store_forks_a_save_on_top_of_an_older_version():
    from qwen_trt.ui.store import SessionStore, new_session_id

    store = SessionStore()
    sid = new_session_id()
    a = store.save(sid, {"messages": ["a1"]}, 0)
    assert (a.sid, a.version, a.forked_from) == (sid, 1, None)
    b = store.save(sid, {"messages": ["a1", "a2"]}, 1)        # the same tab again
    assert (b.sid, b.version) == (sid, 2)
    c = store.save(sid, {"messages": ["a1", "c"]}, 1)          # a tab that saw version 1
    assert c.sid != sid and c.version == 1 and c.forked_from == sid
    assert store.get(sid)["messages"] == ["a1", "a2"]          # nothing overwritten
    assert store.get(sid)["forks"] == [c.sid] and store.forks(sid) == [c.sid]
    assert store.get(c.sid)["forked_from"] == sid
    d = store.save(sid, {"messages": ["x"]}, 2)                 # the original goes on
    assert d.sid == sid and store.get(sid)["forks"] == [c.sid]  # and keeps its links
    gone = new_session_id()                                     # expired or never saved
    assert store.save(gone, {}, 5).sid == gone


def test_chat_state_save_to_follows_its_fork(tiny_tokenizer):
    import threading

    from qwen_trt.ui.store import SessionStore, new_session_id

    store = SessionStore()
    mine, other = ChatState(ChatSession(tiny_tokenizer)), ChatState(ChatSession(tiny_tokenizer))
    mine.chat_id = new_session_id()
    mine.chat.add_exchange("q", "a")
    mine.save_to(store)
    other.restore(store.get(mine.chat_id), chat_id=mine.chat_id)
    threads = [threading.Thread(target=mine.save_to, args=(store,)) for _ in range(8)]
    for th in threads:                          # one tab's concurrent saves never fork
        th.start()
    for th in threads:
        th.join()
    assert store.forks(mine.chat_id) == [] and mine.version == 9
    other.chat.add_exchange("q2", "a2")
    saved = other.save_to(store)
    assert other.forked_from == mine.chat_id and other.chat_id == saved.sid != mine.chat_id
    assert len(store.get(other.chat_id)["messages"]) == 4


def test_settings_are_saved_on_change_and_win_over_a_reply_started_before(tiny_tokenizer):
    from qwen_trt.ui.store import SessionStore, new_session_id

    store = SessionStore()
    state = ChatState(ChatSession(tiny_tokenizer))
    state.chat_id = new_session_id()
    state.save_settings(store, {"top_k": 5}, "Be kind.")     # not saved yet: a first save
    assert store.get(state.chat_id)["settings"] == {"top_k": 5}
    assert store.get(state.chat_id)["system_prompt"] == "Be kind."
    version = state.version
    state.save_settings(store, {"top_k": 9}, None)           # in place: no new version
    assert store.get(state.chat_id)["version"] == version
    assert store.update(new_session_id(), {"settings": {}}) is False
    other = ChatState(ChatSession(tiny_tokenizer))            # another tab on this chat
    other.restore(store.get(state.chat_id), chat_id=state.chat_id)
    other.chat.add_exchange("q", "a")
    assert other.save_to(store).forked_from is None           # a settings change forks nothing
    # a reply that started with top_k 5 ends after the change: the newer values are kept
    state.restore(store.get(state.chat_id), chat_id=state.chat_id)
    state.save_to(store, {"settings": {"top_k": 5}})
    snap = store.get(state.chat_id)
    assert snap["settings"] == {"top_k": 9} and snap["system_prompt"] is None
