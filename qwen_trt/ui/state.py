"""Per-browser-session chat state, kept in ``st.session_state`` but independent of Streamlit.

A reply being streamed is a :class:`PendingReply`. It is committed to the history exactly once:
by the run that streamed it when it finishes, or — when a new message or a click interrupted
that run — by the next run, which cancels the request and keeps the partial text marked as
interrupted. Streamlit may run the old and the new script thread at the same time for a moment
(fast reruns), so committing is guarded by a lock.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field

from qwen_trt.chat.session import ChatSession, Message
from qwen_trt.params import Reply, ReplyMetrics
from qwen_trt.serving.service import RequestHandle
from qwen_trt.ui.text import reply_footer

# How long an interrupting run waits for the cancelled request to stop (it stops before its
# next token, so this is normally one token's time).
CANCEL_WAIT_S = 2.0


@dataclass
class TurnNote:
    """What is shown under one assistant reply."""

    footer: str
    dropped_turns: int = 0


@dataclass
class PendingReply:
    user_text: str
    handle: RequestHandle


@dataclass
class ChatState:
    chat: ChatSession
    notes: list[TurnNote] = field(default_factory=list)    # one per completed turn
    pending: PendingReply | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

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

    def commit_pending(self, pending: PendingReply | None = None) -> Reply | None:
        """Commit ``pending`` (default: the current one) to the history, once.

        If its request is still queued or running it is cancelled first and the partial reply
        is kept, marked interrupted. Returns the committed reply, or None if there was nothing
        to commit (already committed, or cleared).
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
            self.notes.append(TurnNote(reply_footer(reply, waited), reply.dropped_turns))
        return reply

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
