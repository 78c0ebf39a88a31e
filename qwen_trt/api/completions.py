"""The endpoints around chat: ``POST /v1/completions`` (the legacy text API lm-eval-harness and
load tools use), ``GET /v1/models/{id}``, and vLLM's ``POST /tokenize`` / ``POST /detokenize``.

``/v1/completions``: ``prompt`` is a string, a list of strings, a list of token ids or a list of
lists of token ids; each prompt gets ``n`` choices (choice ``index`` = prompt * n + j). A text
prompt is encoded as the tokenizer encodes text (its control tokens, such as ``<|im_start|>``,
are parsed: the prompt is the caller's whole input, no chat template around it). ``max_tokens``
defaults to 16 as OpenAI's; ``echo`` and ``suffix`` are not supported (400); ``logprobs`` is
0..20 alternatives per token (the legacy object: tokens, token_logprobs, top_logprobs,
text_offset).
"""
from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask

from qwen_trt.api import constraints
from qwen_trt.api.choices import Piece, merge
from qwen_trt.api.errors import ApiError, error_body, excerpt
from qwen_trt.api.limits import context_too_long
from qwen_trt.api.limits import check_text, decode_json
from qwen_trt.api.logprobs import CompletionLogprobs, token_texts
from qwen_trt.api.prompt import PromptTooLong
from qwen_trt.api.protocol import (NEUTRAL, ChatRequest, _bad, _bool, _int, _number,
                                   _stops, parse_n, parse_stop_ids, sampling_penalties, usage)
from qwen_trt.params import DEFAULT_TEMPERATURE, DEFAULT_TOP_K, DEFAULT_TOP_P, MAX_TOP_LOGPROBS

DEFAULT_MAX_TOKENS = 16
MAX_PROMPTS = 64


@dataclass
class ApiContext:
    """What the extra routes need from :func:`qwen_trt.api.server.create_app`."""

    name: str
    created: int
    service: object
    check_auth: Callable
    submit: Callable            # async (ids, [SamplingParams]) -> handles
    generate: Callable          # (handle, req, n_prompt, t0, request) -> Piece* then result
    encode_chat: Callable       # async (messages, tools, gen_prompt, limit) -> ids (PromptTooLong)
    tokenize: Callable          # async (text, add_special_tokens, limit) -> ids (PromptTooLong)
    detokenize: Callable        # async (ids) -> text
    engine_error: type          # the exception _generate raises
    data: Callable              # dict -> one SSE event
    release: Callable = lambda handles: None   # gives back the queue places of handles
    start_chat: Callable | None = None   # async (ChatRequest, t_in) -> ChatRun, submitted
    keepalive_s: float = 0.0    # a silent stream gets a keep-alive comment this often (0 = off)
    check_fits: Callable = lambda choices, what, param: None   # 400: more choices than the queue
    min_tokens: Callable | None = None   # async (text) -> tokens it has at least (the bound)


@dataclass(frozen=True)
class CompletionRequest:
    prompts: tuple               # each a str or a list of token ids
    sampling: ChatRequest        # the sampling fields (messages empty)
    logprobs: int | None = None


def model_card(name: str, created: int, info) -> dict:
    return {"id": name, "object": "model", "created": created, "owned_by": "qwen-trt",
            "root": name, "parent": None, "max_model_len": info.max_seq_len}


def _prompts(raw, vocab: int) -> tuple:
    if isinstance(raw, str):
        check_text(raw, "prompt")
        return (raw,)
    if isinstance(raw, list) and raw:
        if all(isinstance(p, str) for p in raw):
            out = tuple(raw)
        elif all(type(t) is int for t in raw):
            out = (list(raw),)
        elif all(isinstance(p, list) and p and all(type(t) is int for t in p) for p in raw):
            out = tuple(list(p) for p in raw)
        else:
            out = None
        if out is not None:
            if len(out) > MAX_PROMPTS:
                raise _bad("prompt", f"'prompt' takes at most {MAX_PROMPTS} prompts, got "
                                     f"{len(out)}.")
            for i, p in enumerate(out):
                if isinstance(p, str):
                    check_text(p, f"prompt[{i}]")
            for p in out:
                if isinstance(p, list) and any(not 0 <= t < vocab for t in p):
                    raise _bad("prompt", f"'prompt' holds a token id outside 0..{vocab - 1}.")
            return out
    raise _bad("prompt", "'prompt' must be a string, a list of strings, a list of token ids or "
                         "a list of lists of token ids.")


def parse_completion_request(obj, vocab: int) -> CompletionRequest:
    if not isinstance(obj, dict):
        raise ApiError(400, "The request body must be a JSON object.")
    prompts = _prompts(obj.get("prompt"), vocab)
    model = obj.get("model")
    if model is not None and not isinstance(model, str):
        raise _bad("model", "'model' must be a string.")
    for name, neutral in NEUTRAL.items():
        if name in obj and not neutral(obj[name]):
            raise _bad(name, f"'{name}' = {excerpt(obj[name])} is not supported by this "
                             "server (send its default or leave it out).",
                       code="unsupported_parameter")
    for name in ("logit_bias", "prediction"):      # chat completions only, here
        if obj.get(name) not in (None, {}, []):
            raise _bad(name, f"'{name}' is supported on /v1/chat/completions, not on "
                             "/v1/completions.", code="unsupported_parameter")
    if obj.get("suffix") not in (None, ""):
        raise _bad("suffix", "'suffix' is not supported by this server.",
                   code="unsupported_parameter")
    lp = obj.get("logprobs")
    if lp is not None and (type(lp) is not int or not 0 <= lp <= MAX_TOP_LOGPROBS):
        raise _bad("logprobs", f"'logprobs' must be a whole number from 0 to {MAX_TOP_LOGPROBS}.")
    stream = _bool(obj, "stream", False)
    opts = obj.get("stream_options")
    if opts is not None and not isinstance(opts, dict):
        raise _bad("stream_options", "'stream_options' must be an object.")
    sampling = ChatRequest(
        messages=(), model=model or None, stream=stream,
        include_usage=_bool(opts or {}, "include_usage", False) and stream,
        continuous_usage=_bool(opts or {}, "continuous_usage_stats", False) and stream,
        max_tokens=_int(obj, "max_tokens", DEFAULT_MAX_TOKENS, 1),
        temperature=_number(obj, "temperature", DEFAULT_TEMPERATURE, 0.0, 2.0),
        top_p=_number(obj, "top_p", DEFAULT_TOP_P, 0.0, 1.0),
        top_k=max(_int(obj, "top_k", DEFAULT_TOP_K, -1), 0),
        seed=_int(obj, "seed", None, 0, 2**64 - 1),          # as the chat endpoint's
        stop=_stops(obj.get("stop")), ignore_eos=_bool(obj, "ignore_eos", False),
        penalties=sampling_penalties(obj), logprobs=lp, n=parse_n(obj),
        min_p=_number(obj, "min_p", 0.0, 0.0, 1.0), stop_token_ids=parse_stop_ids(obj))
    return CompletionRequest(prompts=prompts, sampling=sampling, logprobs=lp)


def _room(n: int, max_tokens: int, info) -> None:
    if n == 0:
        raise _bad("prompt", "'prompt' is empty: there is nothing to complete.")
    if n > _prompt_room(max_tokens, info):
        raise _too_long(n, max_tokens, info)


def _prompt_room(max_tokens: int, info) -> int:
    """The most tokens a prompt may have with ``max_tokens`` to generate (may be < 1)."""
    return min(info.max_input_len, info.max_seq_len - max_tokens)


def _too_long(n: int, max_tokens: int, info, at_least: bool = False) -> ApiError:
    """The 400 for a prompt of ``n`` tokens (``at_least``: at least ``n``) that cannot fit."""
    return context_too_long(info.max_seq_len, info.max_input_len, n, max_tokens, what="prompt",
                            bound=at_least)


def _over_context(e: PromptTooLong, info, param: str) -> ApiError:
    """The 400 of /tokenize for a prompt longer than the model's context."""
    least = "at least " if e.at_least else ""
    return ApiError(400, f"This model's maximum context length is {info.max_seq_len} tokens. "
                         f"However, your {param} resulted in {least}{e.tokens} tokens (/tokenize "
                         "counts up to the context length).", param=param,
                    code="context_length_exceeded")


async def _release_async(release, handles) -> None:
    """``release(handles)`` on the event loop (a response's background task: a plain function
    there would be run in a worker thread)."""
    release(handles)


def add_routes(app: FastAPI, ctx: ApiContext) -> None:
    info = ctx.service.info

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str, request: Request):
        ctx.check_auth(request)
        if model_id != ctx.name:
            return JSONResponse(error_body(f"The model '{model_id[:80]}' does not exist here; "
                                           f"this server serves '{ctx.name}'.", 404,
                                           param="model", code="model_not_found"),
                                status_code=404)
        return model_card(ctx.name, ctx.created, info)

    def check_model(model_id) -> None:
        if model_id is not None and model_id != ctx.name:
            raise ApiError(404, f"The model '{str(model_id)[:80]}' does not exist here; this "
                                f"server serves '{ctx.name}' (see /v1/models).", param="model",
                           code="model_not_found")

    @app.post("/v1/completions")
    async def completions(request: Request):
        ctx.check_auth(request)
        obj = await _json(request)
        tokenizer = ctx.service.tokenizer
        req = parse_completion_request(obj, len(tokenizer))
        check_model(req.sampling.model)
        constraints.check_backend(ctx.service.info, None, "", req.logprobs)
        s = req.sampling
        k = len(req.prompts)
        ctx.check_fits(k * s.n, f"{k} prompt{'s' if k > 1 else ''} x n = {s.n}",
                       "n" if s.n > 1 else "prompt")
        room = _prompt_room(s.max_tokens, info)
        for p in req.prompts:          # every prompt's cheap check before any tokenising
            if isinstance(p, list):
                _room(len(p), s.max_tokens, info)
            elif ctx.min_tokens is not None:
                at_least = await ctx.min_tokens(p)
                if at_least > room:
                    raise _too_long(at_least, s.max_tokens, info, at_least=True)
        ids_list = []
        for p in req.prompts:
            if isinstance(p, list):
                ids = p
            else:
                try:
                    ids = await ctx.tokenize(p, True, max(room, 0))
                except PromptTooLong as e:
                    raise _too_long(e.tokens, s.max_tokens, info, e.at_least) from None
            _room(len(ids), s.max_tokens, info)
            ids_list.append(ids)
        handles = []
        try:
            for ids in ids_list:
                handles += await ctx.submit(ids, s.choice_params(s.max_tokens))
        except ApiError:
            ctx.release(handles)       # cancels them, and frees their places in the queue
            raise
        n_prompt = [len(ids) for ids in ids_list for _ in range(s.n)]
        texts = token_texts(tokenizer) if req.logprobs is not None else None
        lps = [CompletionLogprobs(texts, req.logprobs) if texts else None for _ in handles]
        t0 = time.perf_counter()
        gens = [ctx.generate(h, s, n_prompt[i], t0, None if s.stream else request)
                for i, h in enumerate(handles)]
        cid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())

        def body(choices: list[dict], use: dict | None = None) -> dict:
            out = {"id": cid, "object": "text_completion", "created": created,
                   "model": ctx.name, "choices": choices}
            if use is not None:
                out["usage"] = use
            return out

        def total(results) -> dict:
            return usage(sum(len(ids) for ids in ids_list),
                         sum(r.completion_tokens for r in results))

        if s.stream:
            return StreamingResponse(_stream(gens, lps, s, body, total, n_prompt),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache",
                                              "X-Accel-Buffering": "no"},
                                     background=BackgroundTask(_release_async, ctx.release,
                                                               handles))
        parts: list[list[str]] = [[] for _ in handles]
        got: list[list] = [[] for _ in handles]
        results: list = [None] * len(handles)
        try:
            async for i, item in merge(gens):
                if isinstance(item, Piece):
                    parts[i].append(item.text)
                    got[i] += item.logprobs
                else:
                    results[i] = item
        except ctx.engine_error as e:
            raise ApiError(e.status, str(e)) from e
        if any(r is None for r in results):
            return Response(status_code=499)
        return body([{"index": i, "text": "".join(parts[i]),
                      "logprobs": lps[i].render(got[i]) if lps[i] else None,
                      "finish_reason": results[i].finish_reason}
                     for i in range(len(handles))], total(results))

    async def _stream(gens, lps, s: ChatRequest, body, total, n_prompt) -> AsyncIterator[str]:
        results: list = [None] * len(gens)
        running = [0] * len(gens)
        try:
            async for i, item in merge(gens):
                if isinstance(item, Piece):
                    running[i] += item.tokens
                    if not item.text and not item.logprobs:
                        continue
                    live = (usage(sum(n_prompt), sum(running)) if s.continuous_usage else None)
                    yield ctx.data(body([{"index": i, "text": item.text,
                                          "logprobs": lps[i].render(item.logprobs)
                                          if lps[i] else None,
                                          "finish_reason": None}], live))
                else:
                    results[i] = item
                    running[i] = item.completion_tokens
                    yield ctx.data(body([{"index": i, "text": "",
                                          "logprobs": lps[i].render(()) if lps[i] else None,
                                          "finish_reason": item.finish_reason}]))
            if s.include_usage:
                yield ctx.data(body([], total(results)))
        except ctx.engine_error as e:
            yield ctx.data(error_body(str(e), e.status))
        yield "data: [DONE]\n\n"

    async def _object_body(request: Request) -> dict:
        """The checked JSON object body of a /tokenize or /detokenize request."""
        ctx.check_auth(request)
        obj = await _json(request)
        if not isinstance(obj, dict):
            raise ApiError(400, "The request body must be a JSON object.")
        check_model(obj.get("model"))
        return obj

    @app.post("/tokenize")
    async def tokenize(request: Request):
        obj = await _object_body(request)
        if "messages" in obj:
            from qwen_trt.api.protocol import parse_messages
            from qwen_trt.api.tools import parse_tools

            messages = parse_messages(obj.get("messages"))
            spec = parse_tools(obj)
            try:
                ids = await ctx.encode_chat(messages, spec.tools if spec.render else None,
                                            _bool(obj, "add_generation_prompt", True),
                                            info.max_seq_len)
            except PromptTooLong as e:
                raise _over_context(e, info, "messages") from None
        else:
            prompt = obj.get("prompt")
            if not isinstance(prompt, str):
                raise _bad("prompt", "'prompt' must be a string (or send 'messages').")
            check_text(prompt, "prompt")
            try:
                ids = await ctx.tokenize(prompt, _bool(obj, "add_special_tokens", True),
                                         info.max_seq_len)
            except PromptTooLong as e:
                raise _over_context(e, info, "prompt") from None
        strs = None
        if _bool(obj, "return_token_strs", False):
            texts = token_texts(ctx.service.tokenizer)
            strs = [texts.text(t) for t in ids]
        return {"count": len(ids), "max_model_len": info.max_seq_len, "tokens": list(ids),
                "token_strs": strs}

    @app.post("/detokenize")
    async def detokenize(request: Request):
        obj = await _object_body(request)
        tokens = obj.get("tokens")
        if isinstance(tokens, list) and len(tokens) > info.max_seq_len:
            raise _bad("tokens", f"'tokens' takes at most {info.max_seq_len} ids (the model's "
                                 f"context length), got {len(tokens)}.")
        vocab = len(ctx.service.tokenizer)
        if not isinstance(tokens, list) or not all(type(t) is int and 0 <= t < vocab
                                                    for t in tokens):
            raise _bad("tokens", f"'tokens' must be a list of token ids in 0..{vocab - 1}.")
        return {"prompt": await ctx.detokenize(tokens)}


async def _json(request: Request):
    """The decoded body (400, as the chat endpoint's, for bad JSON or nesting too deep)."""
    return decode_json(await request.body())

