"""The ``openai`` backend: the app and the CLI as front ends to any OpenAI-compatible server
(``qwen-trt serve``, ``trtllm-serve``, vLLM, SGLang).

It works at the messages level (it sends the chat, not token ids), so it is a *service* with the
surface of :class:`~qwen_trt.serving.service.InferenceService` rather than a token-level
:class:`~qwen_trt.backends.base.Backend`: :meth:`OpenAIService.submit` takes the messages of a
chat plan and returns a handle whose ``events()`` yield Waiting / Started / Delta / Finished /
Failed; ``cancel()`` closes the stream; ``info`` comes from ``/v1/models`` (the context limit
from its ``max_model_len``, or ``--max-seq-len``). History truncation uses the model's own
tokenizer when it is at hand locally, else an estimate calibrated on the server's usage counts.

Error bodies differ between servers (nested ``{"error": {...}}``, flat ``{"object": "error",
...}``, ``{"detail": ...}``, an error event inside the stream); each becomes one line. A server
that goes away mid-reply ends the request with one line and the partial text kept.
"""
from __future__ import annotations

import itertools
import json
import logging
import math
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from urllib.parse import urlsplit

from qwen_trt.backends.base import BackendInfo
from qwen_trt.errors import BackendUnavailableError, ConfigError, QwenTrtError
from qwen_trt.params import Reply, ReplyMetrics, SamplingParams
from qwen_trt.serving.session import PromptPlan
from qwen_trt.serving.events import (Delta, Failed, Finished, RequestHandle, ServiceClosedError,
                                     ServiceStatus, Started)

log = logging.getLogger(__name__)

FINISH = {"stop": "stop", "length": "length", "eos": "stop", "tool_calls": "stop",
          "content_filter": "stop", "function_call": "stop"}


class RemoteServerError(QwenTrtError):
    """The OpenAI-compatible server refused the request, failed, or went away."""


SESSION_HEADER = "X-Session-Id"


def session_key(messages: Sequence[dict]) -> str:
    """A conversation's routing key (``X-Session-Id``): a hash of how it starts (the system
    prompt and the first user message), the same on every turn of one chat, so a proxy hashing
    it (deploy/nginx.conf) sends the whole chat to one replica and its prefix cache."""
    import hashlib

    head = []
    for m in messages:
        head.append([m.get("role"), m.get("content")])
        if m.get("role") == "user":
            break
    raw = json.dumps(head, ensure_ascii=False, sort_keys=True, default=str)
    return hashlib.sha256(raw.encode("utf-8", "surrogatepass")).hexdigest()[:32]


@dataclass(frozen=True)
class OpenAIConfig:
    """Where the server is and what to ask it for; checked here, once."""

    base_url: str
    api_key: str | None = None
    model: str | None = None            # default: the first model the server lists
    max_seq_len: int | None = None      # when the server does not report max_model_len
    tokenizer: str | None = None        # local tokenizer folder / cached id (default: model)
    connect_timeout_s: float = 5.0
    read_timeout_s: float = 600.0

    def __post_init__(self) -> None:
        parts = urlsplit(self.base_url or "")
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise ConfigError(f"--base-url must be an http(s) URL such as http://127.0.0.1:8000/v1, "
                              f"got '{self.base_url}'.")
        if self.max_seq_len is not None and self.max_seq_len < 2:
            raise ConfigError(f"--max-seq-len must be >= 2, got {self.max_seq_len}.")

    @property
    def v1(self) -> str:
        """The API root, ending in /v1 (added when the URL has no /v1 of its own)."""
        url = self.base_url.rstrip("/")
        return url if url.endswith("/v1") else url + "/v1"


def http_error_line(status: int | None, body: str | bytes | None, where: str) -> str:
    """One line from any server's error body (nested, flat, FastAPI ``detail``, plain text)."""
    if isinstance(body, bytes):
        body = body.decode("utf-8", "replace")
    msg = (body or "").strip()
    try:
        obj = json.loads(msg) if msg else None
    except ValueError:
        obj = None
    if isinstance(obj, dict):
        err = obj.get("error", obj)
        if isinstance(err, dict):
            found = err.get("message") or err.get("detail") or err.get("msg")
            msg = found if isinstance(found, str) else json.dumps(found or err)
        elif isinstance(err, str):
            msg = err
    msg = " ".join(msg.split())[:500] or "(no message)"
    head = f"The server at {where}"
    if status == 401:
        return f"{head} refused the API key (401): {msg}. Set --api-key / QWEN_TRT_API_KEY."
    if status is None:
        return f"{head} reported an error mid-reply: {msg}"
    return f"{head} answered {status}: {msg}"


class EstimatingTokenizer:
    """Stands in for the model's tokenizer when none is at hand: renders ChatML text and counts
    about one token per ``bytes_per_token`` UTF-8 bytes, learning the ratio from the server's
    usage (slightly pessimistic, so prompts err on the short side)."""

    eos_token_id = None
    added_tokens_decoder: dict = {}

    def __init__(self, bytes_per_token: float = 3.0) -> None:
        self.bytes_per_token = bytes_per_token

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=True, **_):
        text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
        return text + ("<|im_start|>assistant\n" if add_generation_prompt else "")

    def count(self, text: str) -> int:
        return math.ceil(len(text.encode("utf-8")) / self.bytes_per_token)

    def encode(self, text: str, add_special_tokens: bool = False, **_) -> list[int]:
        return [0] * self.count(text)

    def __call__(self, text: str, **_) -> dict:
        return {"input_ids": self.encode(text)}

    def calibrate(self, text: str, tokens: int) -> None:
        if tokens > 0:
            self.bytes_per_token = max(1.0, 0.9 * len(text.encode("utf-8")) / tokens)


def _local_tokenizer(name: str | None):
    """The model's tokenizer if it is on this machine (a folder or the hub cache); never downloads."""
    if not name:
        return None
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(name, local_files_only=True)
    except Exception:  # noqa: BLE001 - not here: estimate instead
        return None


class RemoteHandle(RequestHandle):
    """One request streaming from the server: the engine's handle, with messages for a prompt."""

    def __init__(self, service: "OpenAIService", request_id: int, messages: Sequence[dict],
                 params: SamplingParams, dropped_turns: int) -> None:
        super().__init__(service, request_id, (), params, dropped_turns)
        # role and content only: other servers may refuse fields they do not know (token_ids)
        self.messages = [{"role": m["role"], "content": m["content"]} for m in messages]
        self._response = None
        self._lock = threading.Lock()


class OpenAIService:
    """Streams chats from an OpenAI-compatible server; one thread per request."""


    def __init__(self, cfg: OpenAIConfig) -> None:
        import httpx

        self.cfg = cfg
        headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
        self._http = httpx.Client(base_url=cfg.v1, headers=headers, timeout=httpx.Timeout(
            cfg.read_timeout_s, connect=cfg.connect_timeout_s))
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._live: set[RemoteHandle] = set()
        self._served = 0
        self._closed = False
        try:
            model, ctx = self._discover()
        except BaseException:
            self._http.close()
            raise
        self.model = model
        local = _local_tokenizer(cfg.tokenizer or cfg.model or model)
        self.exact_tokens = local is not None
        self._tokenizer = local if local is not None else EstimatingTokenizer()
        self._info = BackendInfo(name="openai", model=f"{model} @ {cfg.v1}", device="remote",
                                 dtype="-", max_input_len=ctx - 1, max_seq_len=ctx,
                                 stop_token_ids=())      # the server stops at its own

    # -- discovery -----------------------------------------------------------------------------
    def _discover(self) -> tuple[str, int]:
        import httpx

        where = self.cfg.v1
        try:
            r = self._http.get("/models")
        except httpx.HTTPError as e:
            raise BackendUnavailableError(
                f"Cannot reach the OpenAI-compatible server at {where} ({type(e).__name__}): is it "
                "running, and is --base-url right?") from None
        if r.status_code != 200:
            raise BackendUnavailableError(http_error_line(r.status_code, r.content, where))
        try:
            data = r.json()["data"]
            listed = {m["id"]: m for m in data}
        except (ValueError, KeyError, TypeError):
            raise BackendUnavailableError(f"The server at {where} answered /models with something "
                                          "that is not an OpenAI model list.") from None
        if not listed:
            raise BackendUnavailableError(f"The server at {where} lists no models.")
        model = self.cfg.model or next(iter(listed))
        if model not in listed:
            raise ConfigError(f"The server at {where} does not serve '{model}'; it lists: "
                              f"{', '.join(listed)}.")
        ctx = self.cfg.max_seq_len or listed[model].get("max_model_len")
        if not isinstance(ctx, int) or ctx < 2:
            raise ConfigError(f"The server at {where} does not say its context limit "
                              "(max_model_len): pass --max-seq-len.")
        return model, ctx

    # -- the service surface -------------------------------------------------------------------
    @property
    def info(self) -> BackendInfo:
        return self._info

    @property
    def tokenizer(self):
        return self._tokenizer

    def submit(self, messages: Sequence[dict], params: SamplingParams,
               dropped_turns: int = 0) -> RemoteHandle:
        with self._lock:
            if self._closed:
                raise ServiceClosedError("The connection to the server was closed: reload the page.")
            handle = RemoteHandle(self, next(self._ids), messages, params, dropped_turns)
            self._live.add(handle)
        threading.Thread(target=self._run, args=(handle,), name=f"openai-{handle.id}",
                         daemon=True).start()
        return handle

    def submit_plan(self, plan: PromptPlan, params: SamplingParams) -> RemoteHandle:
        return self.submit(plan.messages, params, plan.dropped_turns)

    # the handle's owner: nothing queues here (the server queues); cancel closes the stream,
    # which the server sees as the client going away
    def _position(self, handle: RemoteHandle) -> int:
        return 0

    def _cancel(self, handle: RemoteHandle) -> None:
        with handle._lock:
            resp = handle._response
        if resp is not None:
            try:
                resp.close()
            except Exception:  # noqa: BLE001 - the reader thread ends either way
                pass

    def status(self) -> ServiceStatus:
        with self._lock:
            return ServiceStatus(busy=False, queued=0, served=self._served,
                                 state="closed" if self._closed else "ready")

    def close(self, timeout: float = 5.0, **_) -> None:
        with self._lock:
            self._closed = True
            live = list(self._live)
        for h in live:
            h.cancel()
        for h in live:
            h.wait(timeout)
        self._http.close()

    # -- one request ---------------------------------------------------------------------------
    def _body(self, handle: RemoteHandle) -> dict:
        p = handle.params
        body = {"model": self.model, "messages": handle.messages, "stream": True,
                "stream_options": {"include_usage": True}, "max_tokens": p.max_new_tokens,
                "temperature": p.temperature, "top_p": p.top_p}
        if p.top_k:
            body["top_k"] = p.top_k        # vLLM / SGLang / qwen-trt extra field
        if p.seed is not None:
            body["seed"] = p.seed
        if getattr(p, "presence_penalty", 0):
            body["presence_penalty"] = p.presence_penalty
        if getattr(p, "repetition_penalty", 1) != 1:
            body["repetition_penalty"] = p.repetition_penalty   # vLLM / SGLang extra field
        return body

    def _run(self, handle: RemoteHandle) -> None:
        try:
            self._stream(handle)
        except Exception as e:  # noqa: BLE001 - never a hung caller
            log.debug("openai request failed", exc_info=True)
            if not handle.done:
                handle._emit(Failed(RemoteServerError(
                    f"The request to {self.cfg.v1} failed ({type(e).__name__}: {e})"
                    .splitlines()[0])))
        finally:
            with self._lock:
                self._live.discard(handle)
                self._served += 1

    def _stream(self, handle: RemoteHandle) -> None:
        import httpx

        where = self.cfg.v1
        m = ReplyMetrics(finish_reason="cancelled")
        t0 = time.perf_counter()
        t_first = t_last = None
        chunks = 0
        usage = None
        finish = None
        if handle.cancelled:
            handle._emit(Finished(self._reply(handle, m)))
            return
        try:
            with self._http.stream("POST", "/chat/completions", json=self._body(handle),
                                   headers={SESSION_HEADER: session_key(handle.messages)}) as r:
                with handle._lock:
                    handle._response = r
                if handle.cancelled:
                    r.close()
                if r.status_code != 200:
                    handle._emit(Failed(RemoteServerError(http_error_line(r.status_code, r.read(),
                                                                     where))))
                    return
                handle.started_at = time.monotonic()
                handle.state = "running"
                handle._emit(Started(waited_s=handle.waited_s))
                for line in r.iter_lines():
                    if handle.cancelled:
                        break
                    if not line.startswith("data:"):
                        continue                      # blank lines, ": keep-alive" comments
                    data = line[5:].strip()
                    if data == "[DONE]":
                        break
                    try:
                        obj = json.loads(data)
                    except ValueError:
                        continue
                    if not isinstance(obj, dict):
                        continue
                    if "error" in obj or obj.get("object") == "error":
                        handle._emit(Failed(RemoteServerError(http_error_line(None, data, where))))
                        return
                    if obj.get("usage"):
                        usage = obj["usage"]
                    for choice in obj.get("choices") or []:
                        text = (choice.get("delta") or {}).get("content")
                        if text:
                            t_last = time.perf_counter()
                            if t_first is None:
                                t_first = t_last
                                m.ttft_ms = (t_first - t0) * 1e3
                            chunks += 1
                            handle._emit(Delta(text))
                        if choice.get("finish_reason"):
                            finish = choice["finish_reason"]
        except Exception as e:  # noqa: BLE001 - closing the stream from cancel() lands here too
            if not handle.cancelled:
                if not isinstance(e, httpx.HTTPError):
                    raise
                gone = "went away mid-reply" if handle.started_at else "cannot be reached"
                handle._emit(Failed(RemoteServerError(
                    f"The server at {where} {gone} ({type(e).__name__}); "
                    + ("the partial reply is kept." if handle.text else "try again."))))
                return
        finally:
            with handle._lock:
                handle._response = None
        m.total_ms = ((t_last or time.perf_counter()) - t0) * 1e3
        prompt = usage.get("prompt_tokens") if isinstance(usage, dict) else None
        m.tokens = (usage.get("completion_tokens") if isinstance(usage, dict) else None) or chunks
        m.prompt_tokens = prompt or self._tokenizer_count(handle.messages)
        if t_first is not None and m.tokens > 1 and t_last > t_first:
            m.decode_tok_s = (m.tokens - 1) / (t_last - t_first)
        if handle.cancelled:
            m.finish_reason = "cancelled"
        elif finish is None:
            handle._emit(Failed(RemoteServerError(
                f"The server at {where} went away mid-reply (the stream ended without a finish); "
                + ("the partial reply is kept." if handle.text else "try again."))))
            return
        else:
            m.finish_reason = FINISH.get(finish, "stop")
            if prompt and isinstance(self._tokenizer, EstimatingTokenizer):
                self._tokenizer.calibrate(self._render(handle.messages), prompt)
        handle._emit(Finished(self._reply(handle, m)))

    def _render(self, messages) -> str:
        return self._tokenizer.apply_chat_template(messages, tokenize=False,
                                                   add_generation_prompt=True)

    def _tokenizer_count(self, messages) -> int:
        try:
            return len(self._tokenizer.encode(self._render(messages), add_special_tokens=False))
        except Exception:  # noqa: BLE001 - a count for the footer only
            return 0

    @staticmethod
    def _reply(handle: RemoteHandle, m: ReplyMetrics) -> Reply:
        return Reply(text=handle.text, metrics=m, dropped_turns=handle.dropped_turns)
