"""Fakes the engine worker process loads by name (``WorkerSpec(loader="serving_fakes:...")``).

Imported in the spawned child (tests/ is on its sys.path), so it stays light: no torch at import.
"""
from __future__ import annotations

import os
import time
from collections import deque

from qwen_trt.backends.base import Backend, BackendInfo
from qwen_trt.errors import ModelSourceError
from qwen_trt.backends.runner import RunnerStats, TokenEvent

STEP_S = 0.002        # the fake engine's time per token, so streams overlap visibly
SLOW_FIRST_S = 4.0    # a "slow..." prompt's first token: a long prefill inside one step


class EchoBackend(Backend):
    """Replies with the prompt's own ids, over and over up to max_new_tokens (then <|im_end|>
    unless ignore_eos), so each request's reply is known and differs per request. A prompt
    that decodes to "boom..." raises a plain error, "cuda-crash..." a CUDA error; "slow..."
    takes SLOW_FIRST_S before its first token."""

    def __init__(self, tokenizer, model: str) -> None:
        super().__init__()
        self._tokenizer = tokenizer
        self._im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
        self._info = BackendInfo("echo", model, "cpu", "float32", 4095, 4096, (self._im_end,))

    def stream(self, prompt_ids, params):
        cancel = self._begin()
        text = self._tokenizer.decode(list(prompt_ids)[:8])
        if text.startswith("boom"):
            raise RuntimeError("boom\nwith a second line")
        if text.startswith("cuda-crash"):
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        if text.startswith("slow"):
            time.sleep(SLOW_FIRST_S)
        ids = list(prompt_ids)
        budget = params.max_new_tokens
        n = 0
        while n < budget:
            for tid in ids:
                if n >= budget:
                    return
                time.sleep(STEP_S)
                yield tid
                n += 1
                if cancel.is_set():
                    return
            if not params.ignore_eos:
                yield self._im_end
                return


def load_echo(cfg):
    from transformers import AutoTokenizer

    return EchoBackend(AutoTokenizer.from_pretrained(cfg.model), cfg.model)


def load_echo_gated(cfg):
    """:func:`load_echo` with test-controlled faults, read from files the test names in the
    environment (the engine process inherits it): ``SERVING_FAKES_CRASHES``, a file holding a
    count: while above 0, a load takes one off and the process dies at once (exit code 3, a
    crash during the load); ``SERVING_FAKES_GO``: a load waits until that file exists (a load
    as slow as the test needs)."""
    crashes = os.environ.get("SERVING_FAKES_CRASHES")
    if crashes and os.path.exists(crashes):
        with open(crashes) as f:
            left = int(f.read().strip() or 0)
        if left > 0:
            with open(crashes, "w") as f:
                f.write(str(left - 1))
            os._exit(3)
    go = os.environ.get("SERVING_FAKES_GO")
    deadline = time.monotonic() + 120
    while go and not os.path.exists(go) and time.monotonic() < deadline:
        time.sleep(0.02)
    return load_echo(cfg)


def load_fails_clearly(cfg):
    raise ModelSourceError(f"Model folder '{cfg.model}' does not exist: pass --model.")


def load_crashes(cfg):
    raise RuntimeError("CUDA out of memory\nTraceback (most recent call last): ...")


class RoundRobinRunner:
    """A fake continuous-batching runner: up to 4 backend streams, each step advances every
    running one by a token (a real one decodes them in one batched forward)."""

    max_concurrency = 4

    def __init__(self, backend) -> None:
        self.backend = backend
        self.waiting: deque = deque()
        self.running: dict[int, list] = {}     # id -> [generator, params, tokens]
        self.done: list[TokenEvent] = []
        self.peak = 0
        self.prompt_tokens = 0

    def add(self, request_id, prompt_ids, params) -> None:
        self.waiting.append((request_id, list(prompt_ids), params))
        self.prompt_tokens += len(prompt_ids)

    def abort(self, request_id) -> None:
        if request_id in self.running:
            self.running.pop(request_id)[0].close()
        elif any(r[0] == request_id for r in self.waiting):
            self.waiting = deque(r for r in self.waiting if r[0] != request_id)
        else:
            return
        self.done.append(TokenEvent(request_id, finish="cancelled"))

    def has_work(self) -> bool:
        return bool(self.done or self.running or self.waiting)

    def step(self) -> list[TokenEvent]:
        events, self.done = self.done, []
        while self.waiting and len(self.running) < self.max_concurrency:
            rid, ids, params = self.waiting.popleft()
            self.running[rid] = [self.backend.stream(ids, params), params, 0]
        self.peak = max(self.peak, len(self.running))
        for rid, entry in list(self.running.items()):
            gen, params, n = entry
            try:
                tok = next(gen)
            except StopIteration:
                del self.running[rid]
                events.append(TokenEvent(rid, finish="length"))
                continue
            except Exception as e:  # noqa: BLE001
                if "CUDA error" in str(e):
                    raise
                del self.running[rid]
                events.append(TokenEvent(rid, finish="error", error=f"failed: {e}".splitlines()[0]))
                continue
            entry[2] = n = n + 1
            stop = tok in self.backend.stop_ids(params)
            if stop or n >= params.max_new_tokens:
                del self.running[rid]
                gen.close()
                events.append(TokenEvent(rid, (tok,), finish="stop" if stop else "length",
                                         cached_tokens=0))
            else:
                events.append(TokenEvent(rid, (tok,), cached_tokens=3 if n == 1 else 0))
        return events

    def stats(self) -> RunnerStats:
        return RunnerStats(running=len(self.running), waiting=len(self.waiting),
                           prompt_tokens=self.prompt_tokens, extra={"peak": self.peak})


class LazyTokenizerEcho(EchoBackend):
    """:class:`EchoBackend` whose Hugging Face tokenizer, like the fast backend's, is read on
    first use of ``tokenizer`` (it names its folder in ``tokenizer_source``); that first use
    takes a second and writes the time to the file ``SERVING_FAKES_TOKENIZER_MARK`` names."""

    def __init__(self, tokenizer, model: str) -> None:
        super().__init__(tokenizer, model)
        self._source = model
        self._loaded = False

    @property
    def tokenizer_source(self) -> str:
        return self._source

    @property
    def tokenizer(self):
        if not self._loaded:
            time.sleep(1.0)
            mark = os.environ.get("SERVING_FAKES_TOKENIZER_MARK")
            if mark:
                with open(mark, "w") as f:
                    f.write(str(time.time()))
            self._loaded = True
        return self._tokenizer


def load_lazy_tokenizer(cfg):
    from transformers import AutoTokenizer

    return LazyTokenizerEcho(AutoTokenizer.from_pretrained(cfg.model), cfg.model)
