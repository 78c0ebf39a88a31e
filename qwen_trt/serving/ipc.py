"""The engine process's pipe: one end of a ``socket.socketpair`` carrying pickled messages.

Chosen by measurement over ``multiprocessing.Pipe`` (``python -m qwen_trt.bench.ipc``,
docs/benchmarks.md): the same socketpair underneath, but ``Connection`` pickles through
``ForkingPickler`` and reads each message with two syscalls, where this reads whatever has
arrived into a buffer (often several steps' messages per ``recv``). pyzmq is not installed,
and would add a dependency for what a socketpair already does in microseconds.

Each message is a 4-byte big-endian length, then the pickle. Not thread-safe: one thread sends,
one thread receives (the worker has one loop; the client writes through an :class:`Outbox`,
and one reader thread receives).
"""
from __future__ import annotations

import pickle
import queue
import select
import socket
import struct
import threading

_HEADER = struct.Struct("!I")


class SocketConn:
    """``send`` / ``recv`` / ``poll`` / ``close`` like ``multiprocessing.connection.Connection``."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._buf = bytearray()

    def send(self, obj) -> None:
        self.sock.sendall(frame(obj))

    def recv(self):
        """The next message; blocks. ``EOFError`` when the other end has closed."""
        self._fill(_HEADER.size)
        (n,) = _HEADER.unpack_from(self._buf)
        self._fill(_HEADER.size + n)
        return self._take()

    def has_message(self) -> bool:
        """Whether a whole message is already buffered (:meth:`recv` would not read)."""
        if len(self._buf) < _HEADER.size:
            return False
        (n,) = _HEADER.unpack_from(self._buf)
        return len(self._buf) >= _HEADER.size + n

    def recv_ready(self) -> list:
        """The whole messages that have arrived, reading only what the socket holds now (one
        non-blocking read; for an event loop's reader callback). ``EOFError`` once the other end
        has closed and nothing whole is left."""
        try:
            chunk = self.sock.recv(1 << 16, socket.MSG_DONTWAIT)
        except BlockingIOError:
            chunk = None
        if chunk is not None:
            self._buf += chunk
        out = []
        while self.has_message():
            out.append(self._take())
        if chunk == b"" and not out:
            raise EOFError("the other end of the engine pipe closed")
        return out

    def _take(self):
        (n,) = _HEADER.unpack_from(self._buf)
        end = _HEADER.size + n
        obj = pickle.loads(self._buf[_HEADER.size:end])
        del self._buf[:end]
        return obj

    def poll(self, timeout: float = 0.0) -> bool:
        """Whether :meth:`recv` has data to read (a message, or the end of the stream)."""
        if len(self._buf) >= _HEADER.size:
            return True
        return bool(select.select([self.sock], [], [], timeout)[0])

    def close(self) -> None:
        self.sock.close()

    def _fill(self, n: int) -> None:
        while len(self._buf) < n:
            chunk = self.sock.recv(max(1 << 16, n - len(self._buf)))
            if not chunk:
                raise EOFError("the other end of the engine pipe closed")
            self._buf += chunk


def frame(obj) -> bytes:
    """``obj`` as one message on the wire (length, then the pickle)."""
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    return _HEADER.pack(len(data)) + data


class Outbox:
    """Writes messages to ``conn`` without ever blocking its caller, in order.

    A message is written at once from the calling thread when nothing is queued and the socket
    takes it whole without blocking (the usual case: a request reaches the engine process with
    no thread hand-off); otherwise what is left goes to the sender thread, which writes it
    (blocking) and every later message behind it. :meth:`close` (from any thread) lets the
    sender close the socket after what is queued; the socket is only closed and written from
    the calling threads under one lock, so no write ever lands on a closed (or reused) file
    descriptor. A write error marks the outbox broken: later messages are dropped (the
    reader sees the other end go)."""

    def __init__(self, conn: SocketConn, name: str = "qwen-trt-sender") -> None:
        self.conn = conn
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._queued = 0               # messages handed to the sender, not yet written
        self._closed = False
        self.broken = False
        self.direct = 0                # messages written by the calling thread
        self._nowait = getattr(socket, "MSG_DONTWAIT", None)
        threading.Thread(target=self._run, daemon=True, name=name).start()

    def put(self, msg) -> None:
        data = frame(msg)
        with self._lock:
            if self._closed or self.broken:
                return
            if not self._queued and self._nowait is not None:
                try:
                    n = self.conn.sock.send(data, self._nowait)
                except BlockingIOError:
                    n = 0
                except (OSError, ValueError):
                    self.broken = True
                    return
                if n == len(data):
                    self.direct += 1
                    return
                data = data[n:]
            self._queued += 1
            self._q.put(data)

    def close(self) -> None:
        self._q.put(None)

    def _run(self) -> None:
        while True:
            data = self._q.get()
            if data is None:
                with self._lock:
                    self._closed = True
                    self.conn.close()
                return
            if not self.broken:
                try:
                    self.conn.sock.sendall(data)
                except (OSError, ValueError):
                    self.broken = True
            with self._lock:
                self._queued -= 1


def pair() -> tuple[SocketConn, socket.socket]:
    """(the parent's end, the raw socket to hand to the spawned child)."""
    a, b = socket.socketpair()
    return SocketConn(a), b
