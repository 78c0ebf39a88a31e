"""Per-browser-session chat state, kept in ``st.session_state`` but independent of Streamlit.

A reply being streamed is a :class:`PendingReply`. It is committed to the history exactly once:
by the run that streamed it when it finishes, or — when a new message or a click interrupted
that run — by the next run, which cancels the request and keeps the partial text marked as
interrupted. Streamlit may run the old and the new script thread at the same time for a moment
(fast reruns), so committing is guarded by a lock.
"""
from __future__ import annotations

import threading
from dataclasses import asdict, dataclass, field
from typing import Literal

from qwen_trt.serving.session import ChatSession, Message
from qwen_trt.params import Reply, ReplyMetrics, SamplingParams
from qwen_trt.serving.events import RequestHandle
from qwen_trt.ui.store import Saved, SessionStore
from qwen_trt.ui.text import reply_footer

# How long an interrupting run waits for the cancelled request to stop (it stops before its
# next token, so this is normally one token's time).
CANCEL_WAIT_S = 2.0


# Why a reply ended early: the user pressed Stop, or a new message / click reran the page.
EndedBy = Literal["stopped", "interrupted"]


@dataclass
class TurnNote:
    """What is shown under one assistant reply, and what the transcript records about it."""

    footer: str
    dropped_turns: int = 0
    metrics: dict = field(default_factory=dict)    # Reply.to_json() minus the text
    params: dict = field(default_factory=dict)     # the SamplingParams it was generated with


@dataclass
class PendingReply:
    user_text: str
    handle: RequestHandle


@dataclass
class ChatState:
    chat: ChatSession
    notes: list[TurnNote] = field(default_factory=list)    # one per completed turn
    pending: PendingReply | None = None
    chat_id: str | None = None        # its id in the reload store (the page URL's ?chat=)
    version: int = 0                  # the store's version of it this tab last saw
    forked_from: str | None = None    # set when a save found another tab's newer version
    settings: dict | None = None      # the sidebar's values as last changed (save_settings)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _save_lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def turns(self) -> list[tuple[Message, Message, TurnNote]]:
        pairs = self.chat.turns()
        notes = self.notes + [TurnNote("")] * (len(pairs) - len(self.notes))
        return [(u, a, n) for (u, a), n in zip(pairs, notes)]

    def start(self, user_text: str, handle: RequestHandle) -> PendingReply:
        """Record the request now streaming (an older pending one is committed first)."""
        self.commit_pending()
        pending = PendingReply(user_text, handle)
        with self._lock:
            self.pending = pending
        return pending

    def commit_pending(self, pending: PendingReply | None = None,
                       ended_by: EndedBy = "interrupted") -> Reply | None:
        """Commit ``pending`` (default: the current one) to the history, once.

        If its request is still queued or running it is cancelled first and the partial reply
        is kept, marked ``ended_by`` ("stopped" for the Stop button, "interrupted" for a rerun).
        Returns the committed reply, or None if there was nothing to commit (already
        committed, or cleared).
        """
        with self._lock:
            pending = pending or self.pending
            if pending is None or self.pending is not pending:
                return None
        handle = pending.handle
        if not handle.done:
            handle.cancel()           # a queued request is finished at once, a running one
            handle.wait(CANCEL_WAIT_S)  # stops before its next token
        try:
            reply = handle.result(timeout=0)
        except Exception:  # failed, or still stuck behind another request: keep what we have
            reply = Reply(text=handle.text, metrics=ReplyMetrics(finish_reason="cancelled"),
                          dropped_turns=handle.dropped_turns)
        interrupted = reply.metrics.finish_reason == "cancelled"
        with self._lock:   # check and append in one step: a racing rerun waits, then sees it
            if self.pending is not pending:
                return None              # committed by the other run, or cleared meanwhile
            self.pending = None
            self.chat.add_exchange(pending.user_text, reply.text, interrupted=interrupted,
                                   reply_ids=reply.token_ids)
            waited = handle.waited_s if handle.started_at is not None else 0.0
            metrics = {k: v for k, v in reply.to_json().items() if k != "text"}
            if interrupted:
                metrics["finish_reason"] = ended_by
            metrics["waited_s"] = round(waited, 3)
            self.notes.append(TurnNote(reply_footer(reply, waited, ended_by), reply.dropped_turns,
                                       metrics, _params_dict(handle.params)))
        return reply

    def pop_last_turn(self) -> str | None:
        """Remove the newest completed turn (for regenerate / edit) and return its user text;
        None when there is none, or a reply is still streaming."""
        with self._lock:
            if self.pending is not None or not self.chat.turns():
                return None
            user = self.chat.messages[-2].content
            del self.chat.messages[-2:]
            if len(self.notes) > len(self.chat.turns()):
                self.notes.pop()
            return user

    def snapshot(self) -> dict:
        """The committed conversation as plain data (for the reload store and the transcript)."""
        with self._lock:
            return {"system_prompt": self.chat.system_prompt,
                    "messages": [asdict(m) for m in self.chat.messages],
                    "notes": [asdict(n) for n in self.notes]}

    def save_to(self, store: SessionStore, extra: dict | None = None) -> Saved | None:
        """Save the conversation (plus ``extra``) under :attr:`chat_id` as the next version
        of what this tab saw. If another tab saved that chat meanwhile, this one continues as
        a new chat: :attr:`chat_id` becomes the fork's id and :attr:`forked_from` the
        original's. None when the state has no id."""
        with self._save_lock:             # an old and a new script run may save at once
            if self.chat_id is None:
                return None
            extra = dict(extra or {})
            if self.settings is not None:     # newer than what a long reply started with
                extra["settings"] = self.settings
            saved = store.save(self.chat_id, dict(self.snapshot(), **extra), self.version)
            self.chat_id, self.version = saved.sid, saved.version
            if saved.forked_from is not None:
                self.forked_from = saved.forked_from
            return saved

    def save_settings(self, store: SessionStore, settings: dict,
                      system_prompt: str | None) -> None:
        """Keep the sidebar's ``settings`` and ``system_prompt`` for a reload as soon as they
        change: written into the saved chat in place (its version stays, so no fork), or, for a
        chat not saved yet, as its first save."""
        fields = {"settings": settings, "system_prompt": system_prompt}
        with self._save_lock:
            # later saves of the conversation carry these, not the values a reply started with
            self.settings = dict(settings)
            self.chat.system_prompt = system_prompt      # read by the next prepare()
            if self.chat_id is None:
                return
            if store.update(self.chat_id, fields):
                return
            saved = store.save(self.chat_id, dict(self.snapshot(), **fields), self.version)
            self.chat_id, self.version = saved.sid, saved.version
            if saved.forked_from is not None:
                self.forked_from = saved.forked_from

    def restore(self, snap: dict, chat_id: str | None = None) -> None:
        """Replace the conversation with ``snap`` (from :meth:`snapshot`, or the reload store
        under ``chat_id``, with its version)."""
        with self._lock:
            if chat_id is not None:
                self.chat_id, self.version = chat_id, int(snap.get("version", 0))
                self.forked_from = snap.get("forked_from")
            self.pending = None
            self.chat.messages[:] = [Message(**m) for m in snap.get("messages", [])]
            self.notes[:] = [TurnNote(**n) for n in snap.get("notes", [])]

    def discard(self, pending: PendingReply) -> None:
        """Drop ``pending`` without committing it (its request failed)."""
        with self._lock:
            if self.pending is pending:
                self.pending = None
        pending.handle.cancel()

    def clear(self) -> None:
        """Forget the conversation at once; a reply still streaming is cancelled and dropped."""
        with self._lock:
            pending, self.pending = self.pending, None
            self.chat.clear()
            self.notes.clear()
        if pending is not None:
            pending.handle.cancel()


def _params_dict(params: SamplingParams | None) -> dict:
    if params is None:
        return {}
    out = asdict(params)
    out.pop("stop_token_ids", None)
    out.pop("ignore_eos", None)
    return out
