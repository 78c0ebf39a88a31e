"""One choice of a chat completion: the reply's text pieces (after stop strings) in, OpenAI's
message / stream deltas out, with tool calls parsed (:mod:`qwen_trt.api.tools`) and logprobs
rendered (:mod:`qwen_trt.api.logprobs`). The whole reply and the stream are built by the same
steps, so the streamed content joined equals the whole reply's content."""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

from qwen_trt.api.logprobs import TokenTexts, chat_entries
from qwen_trt.api.tools import CallArguments, CallStart, ToolCall, ToolCallParser, ToolSpec
from qwen_trt.params import TokenLogprob


@dataclass(frozen=True)
class Piece:
    """Reply text that is safe to send, with the logprobs of the tokens it completes and the
    number of tokens generated since the previous piece."""

    text: str
    logprobs: tuple[TokenLogprob, ...] = ()
    tokens: int = 0


class ChatChoice:
    def __init__(self, index: int, tools: ToolSpec, texts: TokenTexts | None = None,
                 top_logprobs: int | None = None) -> None:
        self.index = index
        self._parser = ToolCallParser() if tools.parse else None
        self._texts = texts if top_logprobs is not None else None
        self._top = top_logprobs or 0
        self.content: list[str] = []
        self.calls: list[ToolCall] = []
        self._started = 0                     # calls begun
        self.logprobs: list[dict] = []        # every entry, for the whole reply
        self._pending: list[dict] = []        # entries not yet sent in a chunk
        self.tokens = 0

    @property
    def wants_logprobs(self) -> bool:
        return self._texts is not None

    def _deltas(self, pieces: Sequence) -> list[dict]:
        out: list[dict] = []
        for p in pieces:
            if isinstance(p, str):
                if p:
                    self.content.append(p)
                    out.append({"content": p})
            elif isinstance(p, CallStart):
                # Name first, then the arguments as they are written (OpenAI's and vLLM's order).
                self._started += 1
                out.append({"tool_calls": [{"index": self._started - 1, "id": p.id,
                                            "type": "function",
                                            "function": {"name": p.name, "arguments": ""}}]})
            elif isinstance(p, CallArguments):
                if p.text:
                    out.append({"tool_calls": [{"index": self._started - 1,
                                                "function": {"arguments": p.text}}]})
            elif isinstance(p, ToolCall):
                self.calls.append(p)       # whole: its pieces went out before it
        return out

    def feed(self, piece: Piece) -> list[dict]:
        """Stream deltas for ``piece`` (maybe none yet: text held back)."""
        self.tokens += piece.tokens
        if self._texts is not None and piece.logprobs:
            entries = chat_entries(self._texts, piece.logprobs, self._top)
            self.logprobs += entries
            self._pending += entries
        if self._parser is None:
            return self._deltas([piece.text])
        return self._deltas(self._parser.feed(piece.text))

    def finish(self) -> list[dict]:
        """The deltas of whatever was held back, at the end of the reply."""
        return self._deltas(self._parser.finish()) if self._parser is not None else []

    def take_logprobs(self) -> dict | None:
        """The ``logprobs`` of the next chunk: the entries not sent yet."""
        if self._texts is None:
            return None
        out, self._pending = self._pending, []
        return {"content": out, "refusal": None}

    def finish_reason(self, reason: str) -> str:
        return "tool_calls" if self.calls and reason == "stop" else reason

    def message(self) -> dict:
        text = "".join(self.content)
        msg = {"role": "assistant", "content": (text or None) if self.calls else text,
               "refusal": None}
        if self.calls:
            msg["tool_calls"] = [c.to_dict() for c in self.calls]
        return msg

    def choice(self, reason: str) -> dict:
        lp = {"content": self.logprobs, "refusal": None} if self._texts is not None else None
        return {"index": self.index, "message": self.message(), "logprobs": lp,
                "finish_reason": self.finish_reason(reason)}


async def merge(gens: Sequence[AsyncIterator]) -> AsyncIterator[tuple[int, object]]:
    """Items of several async iterators as they come, as ``(which, item)``; an error in one
    is raised here (the others are closed)."""
    if len(gens) == 1:
        async for item in gens[0]:
            yield 0, item
        return
    q: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i: int, gen: AsyncIterator) -> None:
        try:
            async for item in gen:
                await q.put((i, item))
            await q.put((i, done))
        except BaseException as e:  # noqa: BLE001 - handed to the reader
            await q.put((i, e))

    tasks = [asyncio.create_task(pump(i, g)) for i, g in enumerate(gens)]
    left = len(tasks)
    try:
        while left:
            i, item = await q.get()
            if item is done:
                left -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        for t in tasks:
            try:
                await t
            except BaseException:  # noqa: BLE001 - cancelled or already reported
                pass
