"""xgrammar's check of a grammar in checker processes, so the API's process never runs it.

xgrammar imports torch and transformers (seconds, hundreds of MB, and a cold import holds the
interpreter), parts of its work hold the interpreter too, and a schema within the size limits
can still run long. So :class:`CheckerPool` keeps up to ``size`` child interpreters
(:func:`child_main`: they import :mod:`qwen_trt.fast.step.grammar` once, say ``ready``, then answer
one JSON line per check) and :meth:`CheckerPool.verdict` — blocking, for a thread — sends a
grammar to an idle one and waits at most the budget for its answer: past it, that child is
killed (its work ends with it) and a fresh one started in the background. Starting a child
does not count against the budget.

With the served model's tokenizer (a folder: ``tokenizer_source``), a child also compiles
the grammar against that vocabulary (the engine's own work, so a spec whose compile runs away
is caught here too) and measures the shortest reply it allows as the engine's closing mode
writes it (``Constraint.shortest``), so a ``max_tokens`` below it is refused up front. The
tokenizer is loaded once per child, before its first check (not budgeted).

Protocol (one JSON line each way): ``{"tokenizer": path}`` -> ``{"ok": true}`` once; then
``{"kind": ..., "spec": ..., "limits": {...}}`` -> ``{"verdict": "", "shortest": n | null}``
(it passes) or ``{"verdict": "<one line>", "shortest": null}``.
"""
from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import threading
from dataclasses import asdict

START_S = 120.0          # a child's start (importing torch and xgrammar) on a loaded machine


class CheckerBusy(Exception):
    """No checker was free within the budget."""


class CheckerUnavailable(Exception):
    """A checker process did not start (its error is on stderr, in the server's log)."""


class CheckerTimeout(Exception):
    """The check ran past the budget (its child was killed)."""


class _Child:
    def __init__(self) -> None:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        self.proc = subprocess.Popen(
            [sys.executable, "-c", "from qwen_trt.api.grammar_check import child_main; "
                                   "child_main()"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, close_fds=True)
        self.ready = False

    def read_line(self, timeout: float) -> bytes | None:
        """One line from the child, or None past ``timeout`` (or when it died)."""
        fd = self.proc.stdout
        if select.select([fd], [], [], max(0.0, timeout))[0]:
            line = fd.readline()
            return line or None
        return None

    def kill(self) -> None:
        try:
            self.proc.kill()
            self.proc.wait(5)
        except (OSError, subprocess.TimeoutExpired):
            pass


class CheckerPool:
    """Up to ``size`` checker processes, started on first use (with ``tokenizer_source``, a
    folder, each loads that tokenizer first)."""

    def __init__(self, size: int = 2, tokenizer_source: str | None = None) -> None:
        self.size = size
        self.tokenizer_source = tokenizer_source
        self._idle: list[_Child] = []
        self._slots = threading.BoundedSemaphore(size)
        self._lock = threading.Lock()

    def verdict(self, kind: str, spec: str, limits) -> tuple[str, int | None]:
        """``("", shortest)`` when the grammar passes ``limits`` (a ``GrammarLimits``: this
        process's settings, not the child's) and builds (``shortest``: the fewest tokens of a
        reply, None without a tokenizer), else ``(line, None)`` with the line that refuses it;
        raises
        :class:`CheckerBusy`, :class:`CheckerUnavailable` or :class:`CheckerTimeout`."""
        budget_s = limits.budget_s
        if not self._slots.acquire(timeout=budget_s):
            raise CheckerBusy()
        try:
            child = self._take()
            ok = False
            try:
                child.proc.stdin.write(json.dumps({"kind": kind, "spec": spec,
                                                   "limits": asdict(limits)}).encode() + b"\n")
                child.proc.stdin.flush()
                line = child.read_line(budget_s)
                if line is None:
                    raise CheckerTimeout()
                ok = True
                got = json.loads(line)
                return got["verdict"], got.get("shortest")
            except (OSError, ValueError, KeyError):
                raise CheckerTimeout() from None
            finally:
                if ok:
                    with self._lock:
                        self._idle.append(child)
                else:
                    child.kill()
                    self._replace()
        finally:
            self._slots.release()

    def _take(self) -> _Child:
        with self._lock:
            while self._idle:
                child = self._idle.pop()
                if child.proc.poll() is None:
                    return child
        return self._start()

    def _start(self) -> _Child:
        """A new child, ready (its imports done, the tokenizer loaded); CheckerUnavailable."""
        child = _Child()
        line = child.read_line(START_S)
        if line == b"ready\n" and self.tokenizer_source is not None:
            child.proc.stdin.write(json.dumps({"tokenizer": self.tokenizer_source}).encode()
                                   + b"\n")
            child.proc.stdin.flush()
            line = child.read_line(START_S)
            line = b"ready\n" if line and json.loads(line).get("ok") else None
        if line != b"ready\n":
            child.kill()
            raise CheckerUnavailable()
        return child

    def _replace(self) -> None:
        """Start a child in the background for the one just killed, so the next check does not
        wait for its start."""
        def run() -> None:
            try:
                child = self._start()
            except (CheckerUnavailable, OSError, ValueError):
                return
            with self._lock:
                if len(self._idle) < self.size:
                    self._idle.append(child)
                    return
            child.kill()
        threading.Thread(target=run, daemon=True, name="qwen-trt-grammar-checker").start()

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for child in idle:
            child.kill()


def child_main() -> None:
    """A checker process: import the grammar module, then answer checks until stdin closes."""
    out = os.fdopen(os.dup(1), "wb")         # the answers; anything printed goes to stderr
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    from qwen_trt.errors import first_line
    from qwen_trt.fast.step.grammar import (SHORTEST_CAP, Constraint, GrammarBook, GrammarLimits,
                                            _xgr, check_grammar)
    from qwen_trt.params import Grammar

    _xgr()                                   # the imports, before saying ready
    out.write(b"ready\n")
    out.flush()
    book = None
    for line in sys.stdin.buffer:
        req = json.loads(line)
        if "tokenizer" in req:
            try:
                from transformers import AutoTokenizer

                from qwen_trt.model.template import default_stop_ids

                tok = AutoTokenizer.from_pretrained(req["tokenizer"])
                book = GrammarBook(tok, len(tok), default_stop_ids(tok))
                answer = {"ok": True}
            except Exception as e:  # noqa: BLE001 - the parent reports it did not start
                print(f"grammar checker: no tokenizer ({first_line(e)})", file=sys.stderr)
                answer = {"ok": False}
            out.write(json.dumps(answer).encode() + b"\n")
            out.flush()
            continue
        shortest = None
        try:
            grammar, limits = Grammar(req["kind"], req["spec"]), GrammarLimits(**req["limits"])
            check_grammar(grammar, limits)
            verdict = ""
            if book is not None:
                compiled = book.compile(grammar, limits)
                try:
                    shortest = Constraint(book, compiled, SHORTEST_CAP).shortest
                except ValueError:
                    shortest = None          # longer than SHORTEST_CAP: left to the engine
        except ValueError as e:
            verdict = first_line(e) or "invalid"
        except Exception as e:  # noqa: BLE001 - one line back; the API answers 400 with it
            verdict = f"the grammar could not be checked ({type(e).__name__})"
        out.write(json.dumps({"verdict": verdict, "shortest": shortest}).encode() + b"\n")
        out.flush()


_POOLS: dict[str | None, CheckerPool] = {}
_POOL_LOCK = threading.Lock()


def pool(tokenizer_source: str | None = None) -> CheckerPool:
    """This process's checker pool for ``tokenizer_source`` (a tokenizer folder, or None)."""
    with _POOL_LOCK:
        got = _POOLS.get(tokenizer_source)
        if got is None:
            got = _POOLS[tokenizer_source] = CheckerPool(tokenizer_source=tokenizer_source)
        return got
