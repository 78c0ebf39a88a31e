"""qwen-trt chat in the browser: ``streamlit run app.py -- [--model DIR] [--engine DIR] ...``.

Widgets and session state only; the engine service, settings, streaming and text handling live
in ``qwen_trt`` (serving, options, ui). See docs/app.md.
"""
from __future__ import annotations

import logging
import os
import sys
from contextlib import closing

import streamlit as st

from qwen_trt.backends.openai_backend import start_service_for, submit_plan
from qwen_trt.serving import service as serving
from qwen_trt.options import app_parser, config_from, config_key
from qwen_trt.chat.session import ChatSession
from qwen_trt.errors import QwenTrtError
from qwen_trt.params import DEFAULT_MAX_NEW_TOKENS, DEFAULT_TEMPERATURE, DEFAULT_TOP_P, SamplingParams
from qwen_trt.ui.state import ChatState
from qwen_trt.ui.stream import StreamView, coalesce
from qwen_trt.ui.text import (dropped_note, reply_footer, sanitize_markdown, user_error,
                              waiting_label)

log = logging.getLogger("qwen_trt.app")

st.set_page_config(page_title="qwen-trt chat", page_icon="💬")


@st.cache_resource(max_entries=1, on_release=lambda service: service.close(),
                   show_spinner="Loading the model, once for all sessions (on a GPU the first start "
                                "compiles CUDA graphs: a few minutes)…")
def engine_service(key: str, _cfg) -> serving.InferenceService:
    """One engine per server process, shared by every browser session."""
    return start_service_for(_cfg)    # this machine's engine, or an OpenAI-compatible server


def sidebar() -> SamplingParams:
    with st.sidebar:
        st.header("Settings")
        max_new = st.slider("Max length (new tokens)", 128, 4096, DEFAULT_MAX_NEW_TOKENS, step=64,
                            key="max_new_tokens")
        temp = st.slider("Temperature (0 = greedy)", 0.0, 1.5, DEFAULT_TEMPERATURE, step=0.05,
                         key="temperature")
        top_p = st.slider("Top-p", 0.05, 1.0, DEFAULT_TOP_P, step=0.05, key="top_p")
        st.text_area("System prompt (optional)", key="system_prompt", height=80)
        st.button("Clear memory", key="clear", on_click=clear_memory, type="primary")
    return SamplingParams(max_new_tokens=max_new, temperature=temp, top_p=top_p)


def clear_memory() -> None:
    state = st.session_state.get("chat_state")
    if state is not None:
        state.clear()


def show_history(state: ChatState) -> None:
    for user, assistant, note in state.turns():
        with st.chat_message("user"):
            st.markdown(sanitize_markdown(user.content))
        with st.chat_message("assistant"):
            if note.dropped_turns:
                st.caption(dropped_note(note.dropped_turns))
            st.markdown(sanitize_markdown(assistant.content) or "*(no text)*")
            st.caption(note.footer)


def stream_reply(service: serving.InferenceService, state: ChatState, text: str,
                 params: SamplingParams) -> None:
    info = service.info
    plan = state.chat.prepare(text, max_input_len=info.max_input_len, max_seq_len=info.max_seq_len,
                              max_new_tokens=params.max_new_tokens)
    pending = state.start(text, submit_plan(service, plan, params))
    handle = pending.handle
    with st.chat_message("assistant"):
        if plan.dropped_turns:
            st.caption(dropped_note(plan.dropped_turns))
        status, body = st.empty(), st.empty()
        view, shown_label = StreamView(), None
        with body.container():
            blocks, tail = st.container(), st.empty()
        with closing(handle.events(poll_s=0.05)) as events:   # closing cancels if interrupted
            for ev in coalesce(events):
                if handle.cancelled:          # cleared, or a newer run took over
                    return
                match ev:
                    case serving.Waiting(position=position, waited_s=waited_s, engine=engine):
                        label = engine or waiting_label(position, waited_s)
                        if label != shown_label:  # redraw when it changes (at most once a second)
                            if label:
                                status.info(label, icon=":material/hourglass_top:")
                            else:
                                status.empty()
                            shown_label = label
                    case serving.Started():
                        status.empty()
                        tail.markdown(view.add("").tail)      # the cursor, until the first token
                    case serving.Delta(text=text):
                        update = view.add(text)
                        for block in update.new_blocks:
                            blocks.markdown(block)
                        tail.markdown(update.tail)
                    case serving.Failed(error=error):
                        if handle.text:        # e.g. the server went away: keep the partial reply
                            state.commit_pending(pending)
                        else:
                            state.discard(pending)
                        raise error
                    case serving.Finished():
                        reply = state.commit_pending(pending)
                        if reply is not None:
                            body.markdown(sanitize_markdown(reply.text) or "*(no text)*")
                            st.caption(reply_footer(reply, handle.waited_s))


def main() -> None:
    st.title("qwen-trt chat")
    params = sidebar()
    try:
        cfg = config_from(app_parser().parse_args(sys.argv[1:]), os.environ)
        service = engine_service(config_key(cfg), cfg)
    except Exception as e:  # noqa: BLE001 - shown as one line, never a traceback
        if not isinstance(e, QwenTrtError):
            log.exception("loading the engine failed")
        st.error(user_error(e, "loading the engine"), icon=":material/error:")
        st.stop()
    st.sidebar.caption(f"**Engine:** {service.info.describe()}")

    state = st.session_state.get("chat_state")
    if state is None:
        state = st.session_state["chat_state"] = ChatState(ChatSession(service.tokenizer))
    state.chat.system_prompt = (st.session_state.get("system_prompt") or "").strip() or None
    state.commit_pending()       # a reply interrupted by this rerun: keep it, marked interrupted
    status = service.status()
    if status.busy:
        more = f"; {status.queued} more waiting" if status.queued else ""
        st.sidebar.caption(f"Engine busy with another session's reply{more}.")
    show_history(state)

    text = st.chat_input("Message qwen-trt")
    if text is None:
        if not state.chat.messages:
            st.caption("Type a message below. Replies stream token by token; a new message or "
                       "any click stops the reply being written.")
        return
    with st.chat_message("user"):
        st.markdown(sanitize_markdown(text))
    try:
        stream_reply(service, state, text, params)
    except Exception as e:  # noqa: BLE001 - shown as one line; the history is kept
        if not isinstance(e, QwenTrtError):
            log.exception("answering failed")
        st.error(user_error(e), icon=":material/warning:")


main()
