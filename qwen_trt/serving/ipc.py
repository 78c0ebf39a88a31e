"""The engine process's pipe: one end of a ``socket.socketpair`` carrying pickled messages.

Chosen by measurement over ``multiprocessing.Pipe`` (``python -m qwen_trt.bench.ipc``,
docs/benchmarks.md): the same socketpair underneath, but ``Connection`` pickles through
``ForkingPickler`` and reads each message with two syscalls, where this reads whatever has
arrived into a buffer (often several steps' messages per ``recv``). pyzmq is not installed,
and would add a dependency for what a socketpair already does in microseconds.

Each message is a 4-byte big-endian length, then the pickle. Not thread-safe: one thread sends,
one thread receives (the client has a sender thread and a reader thread; the worker one loop).
"""
from __future__ import annotations

import pickle
import select
import socket
import struct

_HEADER = struct.Struct("!I")


class SocketConn:
    """``send`` / ``recv`` / ``poll`` / ``close`` like ``multiprocessing.connection.Connection``."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._buf = bytearray()

    def send(self, obj) -> None:
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        self.sock.sendall(_HEADER.pack(len(data)) + data)

    def recv(self):
        """The next message; blocks. ``EOFError`` when the other end has closed."""
        self._fill(_HEADER.size)
        (n,) = _HEADER.unpack_from(self._buf)
        end = _HEADER.size + n
        self._fill(end)
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


def pair() -> tuple[SocketConn, socket.socket]:
    """(the parent's end, the raw socket to hand to the spawned child)."""
    a, b = socket.socketpair()
    return SocketConn(a), b
