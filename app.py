"""qwen-trt chat in the browser: ``streamlit run app.py -- [--model DIR] [--engine DIR] ...``.

Widgets and session state only; the engine service, settings, streaming, the reload store and
text handling live in ``qwen_trt`` (serving, options, ui.*). See docs/app.md.
"""
from __future__ import annotations

import logging
import os
import sys
from contextlib import closing

import streamlit as st
from streamlit.runtime.scriptrunner_utils.exceptions import StopException

from qwen_trt.serving.events import Delta, Failed, Finished, Started, Waiting
from qwen_trt.serving.service import Service, start_service_for
from qwen_trt.options import app_parser, config_from, config_key
from qwen_trt.serving.session import ChatSession
from qwen_trt.errors import QwenTrtError
from qwen_trt.ui.progress import BackgroundLoad, StageWriter
from qwen_trt.model.tiny import is_tiny_model
from qwen_trt.ui.settings import SLIDERS, params_from, settings_dict, slider_args, slider_defaults
from qwen_trt.ui.kernels import slow_path_note
from qwen_trt.ui.state import ChatState
from qwen_trt.ui.store import QUERY_KEY, new_session_id, process_store
from qwen_trt.ui.stream import StreamView, coalesce, hidden_turns
from qwen_trt.ui.text import (DEMO_MODEL_NOTE, dropped_note, fork_note, forks_note,
                              markdown_html, PAGE_CSS, reply_footer, user_error, waiting_label)
from qwen_trt.ui.transcript import to_json, to_markdown

log = logging.getLogger("qwen_trt.app")

st.set_page_config(page_title="qwen-trt chat", page_icon="💬")
st.html(PAGE_CSS)          # the style of the rendered replies (constant; out of the page flow)


@st.cache_resource(max_entries=1, show_spinner=False,
                   on_release=lambda load: load.done and not load.failed and load.result().close())
def engine_loader(key: str, _cfg) -> BackgroundLoad:
    """One engine per server process, shared by every browser session, loaded in the
    background so every page can show its progress."""
    # this machine's engine (its stage lines shown while it loads), or an OpenAI-compatible server
    return BackgroundLoad(lambda report: start_service_for(
        _cfg, echo=StageWriter(report, prefix="[qwen-trt engine]", also=sys.stderr)))


def engine_service() -> Service:
    cfg = config_from(app_parser().parse_args(sys.argv[1:]), os.environ)
    loader = engine_loader(config_key(cfg), cfg)
    if not loader.done:
        with st.status("Loading the model, once for all sessions…", expanded=True) as box:
            bars: dict[str, object] = {}
            while not loader.wait(0.25):
                for ev in loader.events():
                    if ev.stage not in bars:
                        bars[ev.stage] = st.empty()
                    text = f"{ev.stage}: {ev.detail}" if ev.detail else ev.stage
                    if ev.fraction is None:
                        bars[ev.stage].caption(text)
                    else:
                        bars[ev.stage].progress(ev.fraction, text=text)
            took = f"{loader.seconds or 0:.0f} s"
            box.update(label=f"Loading failed after {took}" if loader.failed
                       else f"Model loaded in {took}",
                       state="error" if loader.failed else "complete", expanded=False)
    if loader.failed:
        engine_loader.clear()          # the next page view tries again
    return loader.result()


@st.fragment
def settings_panel() -> None:
    """In a fragment: moving a slider reruns only this panel, so it never stops a reply being
    written; the new values apply to the next message."""
    st.header("Settings")
    for key, value in slider_defaults().items():   # the value lives in session state only:
        st.session_state.setdefault(key, value)    # a reload puts the saved one there first
    for spec in SLIDERS:
        st.slider(**slider_args(spec), on_change=save_settings)
    st.text_area("System prompt (optional)", key="system_prompt", height=80,
                 on_change=save_settings)


def save_settings() -> None:
    """A reload brings back the sidebar as it was last set, not as of the last reply."""
    state = st.session_state.get("chat_state")
    if state is None:
        return
    try:
        settings = settings_dict(params_from(st.session_state))
    except ValueError:              # shown as one line by main(); nothing to keep
        return
    state.save_settings(process_store(), settings, system_prompt())


def system_prompt() -> str | None:
    return (st.session_state.get("system_prompt") or "").strip() or None


def clear_memory() -> None:
    state = st.session_state.get("chat_state")
    st.session_state["show_all_turns"] = False
    if state is not None:
        state.clear()
        save(state)


def request_stop() -> None:
    st.session_state["stop_requested"] = True


def regenerate() -> None:
    state = st.session_state.get("chat_state")
    text = state.pop_last_turn() if state is not None else None
    if text is not None:
        st.session_state["resend"] = text


def start_edit() -> None:
    state = st.session_state.get("chat_state")
    if state is not None and state.chat.turns():
        st.session_state["edit_text"] = state.chat.messages[-2].content
        st.session_state["editing"] = True


def finish_edit(send: bool) -> None:
    st.session_state["editing"] = False
    text = st.session_state.get("edit_text") or ""
    if send and text.strip():
        state = st.session_state.get("chat_state")
        if state is not None and state.pop_last_turn() is not None:
            st.session_state["resend"] = text


def save(state: ChatState, settings: dict | None = None) -> None:
    """Keep a copy for a reload; a fork when another tab saved this chat meanwhile
    (``settings`` given: no st.* call, safe after a Stop)."""
    if settings is None:
        settings = settings_dict(params_from(st.session_state))
    state.save_to(process_store(), {"settings": settings})


def reloaded_chat() -> dict | None:
    """First run of a page: the chat saved under the URL's id, its settings put back before
    the widgets are drawn."""
    if "chat_state" in st.session_state:
        return None
    sid = st.query_params.get(QUERY_KEY)
    snap = process_store().get(sid) if sid else None
    if snap is not None:
        keys = {spec.key for spec in SLIDERS}
        for key, value in (snap.get("settings") or {}).items():
            if key in keys:
                st.session_state[key] = value
        if snap.get("system_prompt"):
            st.session_state["system_prompt"] = snap["system_prompt"]
    return snap


def chat_state(service, snap: dict | None) -> ChatState:
    """This tab's conversation; after a reload, the one saved under the URL's chat id."""
    state = st.session_state.get("chat_state")
    if state is not None:
        return state
    state = ChatState(ChatSession(service.tokenizer))
    if snap is None:
        state.chat_id = new_session_id()    # never adopt an id the store does not know
        st.query_params[QUERY_KEY] = state.chat_id
    else:
        state.restore(snap, chat_id=st.query_params.get(QUERY_KEY))
    st.session_state["chat_state"] = state
    return state


def chat_links(state: ChatState) -> None:
    """The URL names the chat this tab writes to (a fork's, after one), and a line says when
    this chat was forked from another or into others."""
    if st.query_params.get(QUERY_KEY) != state.chat_id:
        st.query_params[QUERY_KEY] = state.chat_id
    if state.forked_from:
        st.info(fork_note(QUERY_KEY, state.forked_from), icon=":material/fork_right:")
    forks = process_store().forks(state.chat_id)
    if forks:
        st.caption(forks_note(QUERY_KEY, forks))


def show_all_turns() -> None:
    st.session_state["show_all_turns"] = True


def show_history(state: ChatState) -> None:
    turns = state.turns()
    hidden = hidden_turns(len(turns), st.session_state.get("show_all_turns", False))
    if hidden:
        st.button(f"Show {hidden} earlier turns", key="show_all", on_click=show_all_turns,
                  icon=":material/expand_less:", type="tertiary")
    for user, assistant, note in turns[hidden:]:
        with st.chat_message("user"):
            st.html(markdown_html(user.content))
        with st.chat_message("assistant"):
            if note.dropped_turns:
                st.caption(dropped_note(note.dropped_turns))
            st.html(markdown_html(assistant.content or "*(no text)*"))
            st.caption(note.footer)


def turn_actions(state: ChatState) -> None:
    """Under the last reply: regenerate it, or edit the message it answered and resend."""
    if not state.chat.turns() or state.pending is not None:
        return
    if st.session_state.get("editing"):
        with st.form("edit_form", border=False):
            st.text_area("Edit your last message", key="edit_text", height=100)
            send, cancel = st.columns(2)
            send.form_submit_button("Send", on_click=finish_edit, args=(True,), type="primary")
            cancel.form_submit_button("Cancel", on_click=finish_edit, args=(False,))
        return
    regen, edit, _ = st.columns([1, 1, 3])
    regen.button("Regenerate", key="regenerate", on_click=regenerate,
                 icon=":material/refresh:", help="A new reply to the same prompt")
    edit.button("Edit", key="edit", on_click=start_edit, icon=":material/edit:",
                help="Edit your last message and send it again")


def downloads(state: ChatState, service, params) -> None:
    engine = service.info.describe()
    settings = settings_dict(params)
    st.download_button("Download chat (Markdown)", key="dl_md", on_click="ignore",
                       data=lambda: to_markdown(state.snapshot(), settings, engine),
                       file_name="qwen-trt-chat.md", mime="text/markdown",
                       icon=":material/download:")
    st.download_button("Download chat (JSON)", key="dl_json", on_click="ignore",
                       data=lambda: to_json(state.snapshot(), settings, engine),
                       file_name="qwen-trt-chat.json", mime="application/json",
                       icon=":material/data_object:")


def stream_reply(state: ChatState, pending, plan_dropped: int, params):
    """Stream the reply; returns the empty slot under it (for the turn actions)."""
    handle = pending.handle
    settings = settings_dict(params)      # after a Stop, touching st.* raises again
    message = st.chat_message("assistant")
    # Drawn now, so the previous run's Regenerate/Edit buttons at this place on the page
    # (stale until this run ends) are gone while the reply streams.
    below = st.empty()
    with message:
        if plan_dropped:
            st.caption(dropped_note(plan_dropped))
        status, body = st.empty(), st.empty()
        view, shown_label = StreamView(), None
        with body.container():
            blocks, tail = st.container(), st.empty()
        stop = st.empty()
        # A click reruns the page, which keeps the partial reply marked "stopped" and draws
        # it finished (a stopped script run could not draw any more).
        stop.button("Stop", key="stop", on_click=request_stop, icon=":material/stop:")
        saved = False
        try:
            with closing(handle.events(poll_s=0.05)) as events:   # closing cancels if interrupted
                for ev in coalesce(events):
                    if handle.cancelled:          # cleared, or a newer run took over
                        return
                    match ev:
                        case Waiting(position=position, waited_s=waited_s,
                                             engine=engine):
                            label = engine or waiting_label(position, waited_s)
                            if label != shown_label:  # redraw when it changes (at most 1/s)
                                if label:
                                    status.info(label, icon=":material/hourglass_top:")
                                else:
                                    status.empty()
                                shown_label = label
                        case Started():
                            status.empty()
                            tail.html(view.add("").tail)  # the cursor, until the first token
                        case Delta(text=text):
                            update = view.add(text)
                            for block in update.new_blocks:
                                blocks.html(block)
                            tail.html(update.tail)
                        case Failed(error=error):
                            if handle.text:    # e.g. the server went away: keep the partial
                                state.commit_pending(pending)
                            else:
                                state.discard(pending)
                            raise error
                        case Finished():
                            reply = state.commit_pending(pending)
                            stop.empty()
                            forked = state.forked_from
                            save(state, settings)
                            saved = True
                            if reply is not None:
                                body.html(markdown_html(reply.text or "*(no text)*"))
                                st.caption(reply_footer(reply, handle.waited_s))
                            if state.forked_from != forked:   # another tab saved meanwhile
                                chat_links(state)
        except StopException:   # Streamlit's own Stop: keep the partial reply, marked stopped
            state.commit_pending(pending, ended_by="stopped")
            raise
        finally:
            if not saved:
                save(state, settings)
    return below


def main() -> None:
    st.title("qwen-trt chat")
    snap = reloaded_chat()
    with st.sidebar:
        settings_panel()
        st.button("Clear memory", key="clear", on_click=clear_memory, type="primary")
        files = st.container()
    try:
        params = params_from(st.session_state)
    except ValueError as e:
        st.error(str(e), icon=":material/error:")
        st.stop()
    try:
        service = engine_service()
    except Exception as e:  # noqa: BLE001 - shown as one line, never a traceback
        if not isinstance(e, QwenTrtError):
            log.exception("loading the engine failed")
        st.error(user_error(e, "loading the engine"), icon=":material/error:")
        st.stop()
    st.sidebar.caption(f"**Engine:** {service.info.describe()}")
    if slow_path_note(service.info):
        st.sidebar.caption(slow_path_note(service.info))
    if is_tiny_model(service.info.model):
        st.info(DEMO_MODEL_NOTE, icon=":material/science:")

    state = chat_state(service, snap)
    chat_links(state)
    state.chat.system_prompt = system_prompt()
    stopped = st.session_state.pop("stop_requested", False)
    if state.commit_pending(ended_by="stopped" if stopped else "interrupted"):
        save(state)           # a reply interrupted by this rerun: kept, marked
    status = service.status()
    if status.busy:
        more = f"; {status.queued} more waiting" if status.queued else ""
        st.sidebar.caption(f"Engine busy with another session's reply{more}.")
    with files:
        downloads(state, service, params)

    # "disable": no Stop in the chat box (a stopped run cannot draw the reply finished);
    # the reply's own Stop button reruns the page instead
    typed = st.chat_input("Message qwen-trt", key="prompt", submit_mode="disable")
    resend = st.session_state.pop("resend", None)
    text = typed if typed is not None else resend
    pending = plan = error = None
    if text is not None:
        # Submit before drawing the history: the engine starts while the page is drawn.
        try:
            info = service.info
            plan = state.chat.prepare(text, max_input_len=info.max_input_len,
                                      max_seq_len=info.max_seq_len,
                                      max_new_tokens=params.max_new_tokens)
            pending = state.start(text, service.submit_plan(plan, params))
        except Exception as e:  # noqa: BLE001 - shown below the message
            error = e
    show_history(state)
    if text is None:
        if not state.chat.messages:
            st.caption("Type a message below. Replies stream token by token; a Stop button "
                       "under the reply ends it early.")
        turn_actions(state)
        return
    with st.chat_message("user"):
        st.html(markdown_html(text))
    try:
        if error is not None:
            raise error
        below = stream_reply(state, pending, plan.dropped_turns, params=params)
    except Exception as e:  # noqa: BLE001 - shown as one line; the history is kept
        if not isinstance(e, QwenTrtError):
            log.exception("answering failed")
        st.error(user_error(e), icon=":material/warning:")
        return
    if below is None:       # a newer run took this reply over
        return
    with below.container():
        turn_actions(state)


main()
