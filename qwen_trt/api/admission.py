"""Places in the API's queue, and the requests in flight (for a shutdown to end them).

A request takes its place (a :class:`Ticket`) when it is accepted, before its response starts:
a streaming response's body runs later, so counting it there would let a burst of streams all
pass the ``--max-queue`` check before any of them counts. All of it runs on the event loop.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from qwen_trt.api.errors import ApiError

SHUTTING_DOWN = "The server is shutting down; retry (on another replica)."


@dataclass(eq=False)
class Ticket:
    """One accepted request: waiting for the engine, then running, then done."""

    admission: Admission
    handle: object = None
    state: str = "waiting"

    def started(self) -> None:
        if self.state == "waiting":
            self.admission.counts.waiting -= 1
            self.admission.counts.running += 1
            self.state = "running"

    def release(self) -> None:
        """Give the place back (once) and cancel the engine request if it still runs."""
        if self.state == "done":
            return
        counts = self.admission.counts
        if self.state == "waiting":
            counts.waiting -= 1
        else:
            counts.running -= 1
        self.state = "done"
        self.admission.live.discard(self)
        handle = self.handle
        if handle is not None and not getattr(handle, "done", False):
            handle.cancel()


@dataclass
class Admission:
    """The ``--max-queue`` check and the tickets of the requests in flight."""

    counts: object                  # .waiting / .running, read by /metrics
    max_queue: int
    retry_after_s: int = 2
    closing: bool = False           # set when the server starts shutting down
    live: set = field(default_factory=set)

    def check(self) -> None:
        """503 when the queue is full or the server is shutting down."""
        if self.closing:
            raise ApiError(503, SHUTTING_DOWN, code="shutting_down",
                           headers={"Retry-After": str(self.retry_after_s), "Connection": "close"})
        if self.counts.waiting >= self.max_queue:
            raise ApiError(503, f"The server is busy: {self.counts.waiting} requests are already "
                                f"waiting (--max-queue {self.max_queue}); retry shortly.",
                           code="queue_full", headers={"Retry-After": str(self.retry_after_s)})

    def check_fits(self, choices: int, what: str, param: str = "n") -> None:
        """400 for a request of more choices than ``--max-queue``: each choice takes a place
        when the request is accepted, so it could never be accepted, however idle the server
        (a 503 would tell the client to retry for ever)."""
        if choices > self.max_queue:
            raise ApiError(400, f"This request asks for {choices} choices ({what}), more than "
                                f"this server ever queues at once (--max-queue "
                                f"{self.max_queue}): ask for at most {self.max_queue}.",
                           param=param, code="too_many_choices")

    def take(self) -> Ticket:
        """A place in the queue (the check and the count at once, no await between)."""
        self.check()
        ticket = Ticket(self)
        self.counts.waiting += 1
        self.live.add(ticket)
        return ticket

    def in_flight(self) -> int:
        return len(self.live)

    def cancel_all(self) -> int:
        """Cancel the engine request of every ticket (their responses end with an error)."""
        n = 0
        for ticket in list(self.live):
            handle = ticket.handle
            if handle is not None and not getattr(handle, "done", False):
                handle.cancel()
                n += 1
        return n
