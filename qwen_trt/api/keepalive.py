"""SSE comment heartbeats: a stream that stays silent (a client queued behind others, a long
prefill) gets ``: keep-alive`` lines, which every SSE client ignores, so proxies and load
balancers with an idle timeout do not cut it."""
from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

KEEPALIVE = ": keep-alive\n\n"
DEFAULT_KEEPALIVE_S = 10.0


async def with_keepalive(items: AsyncIterator[str], every_s: float) -> AsyncIterator[str]:
    """``items``, plus :data:`KEEPALIVE` whenever ``every_s`` seconds pass without one (never
    with ``every_s`` 0). Leaving early (the client went away) cancels the pending item, so
    ``items`` runs its own clean-up (which cancels the request)."""
    it = items.__aiter__()
    if not every_s or every_s <= 0:
        async for item in it:
            yield item
        return
    pending: asyncio.Future | None = None
    try:
        while True:
            if pending is None:
                pending = asyncio.ensure_future(it.__anext__())
            done, _ = await asyncio.wait({pending}, timeout=every_s)
            if not done:
                yield KEEPALIVE
                continue
            task, pending = pending, None
            try:
                item = task.result()
            except StopAsyncIteration:
                return
            yield item
    finally:
        if pending is not None:
            pending.cancel()
            with contextlib.suppress(BaseException):   # its CancelledError, or its own error
                await pending
        aclose = getattr(it, "aclose", None)
        if aclose is not None:
            await aclose()
