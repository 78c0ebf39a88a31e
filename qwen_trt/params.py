"""Typed settings and results shared by every backend and every front end."""
from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Literal

# Qwen3-Instruct-2507's recommended sampling defaults (model card).
DEFAULT_TEMPERATURE = 0.7
DEFAULT_TOP_P = 0.8
DEFAULT_TOP_K = 20
DEFAULT_MAX_NEW_TOKENS = 512
MAX_NEW_TOKENS = 262144           # Qwen3-4B-Instruct-2507's whole context

FinishReason = Literal["stop", "length", "cancelled", "error"]
MAX_TOP_LOGPROBS = 20             # OpenAI's top_logprobs limit
GrammarKind = Literal["json_object", "json_schema", "tool_calls"]
GRAMMAR_KINDS = ("json_object", "json_schema", "tool_calls")

DEFAULT_MAX_BATCH = 32      # sequences the fast path decodes together (--max-batch): the one default

@dataclass(frozen=True)
class Grammar:
    """What the reply must match (constrained decoding, :mod:`qwen_trt.fast.step.grammar`).

    ``json_object``: one JSON object. ``json_schema``: ``spec`` is a JSON schema as JSON text;
    the reply is one JSON value valid for it. ``tool_calls``: ``spec`` is JSON text
    ``{"tools": [{"name": str, "parameters": <JSON schema>}], "parallel": bool}``: the whole
    reply is one (``parallel``: one or more, newline-separated) ``<tool_call>\n{"name": <one of
    the names>, "arguments": <an object valid for that tool's parameters>}\n</tool_call>``
    block(s), then the end of the turn. The spec itself is checked by
    :func:`qwen_trt.fast.step.grammar.check_grammar`.
    """

    kind: GrammarKind
    spec: str = ""

    def __post_init__(self) -> None:
        if self.kind not in GRAMMAR_KINDS:
            raise ValueError(f"grammar kind must be one of {', '.join(GRAMMAR_KINDS)}, "
                             f"got {str(self.kind)[:40]!r}")
        if not isinstance(self.spec, str):
            raise ValueError("grammar spec must be JSON text")


@dataclass(frozen=True)
class TokenLogprob:
    """One generated token's log-probability, and the ``top`` alternatives (id, logprob), most
    likely first (as many as ``SamplingParams.logprobs`` asks for)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens. temperature 0 (or top_p 0, or top_k 1) means greedy; top_k 0, top_p 1
    and min_p 0 disable those filters.

    ``logprobs``: None (off) or how many top alternatives to report per token (0..20; 0 = the
    chosen token's logprob only). A logprob is the log-softmax of the logits after the
    penalties and the grammar mask, before temperature, top-k, top-p and min-p.
    ``grammar``: constrained decoding (:class:`Grammar`).

    A request stops at the backend's stop ids (``BackendInfo.stop_token_ids``: ``<|im_end|>``,
    ``<|endoftext|>``, resolved once at load) and at the extra ``stop_token_ids`` given here;
    ``ignore_eos`` turns every stop off.
    """

    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    temperature: float = DEFAULT_TEMPERATURE
    top_p: float = DEFAULT_TOP_P
    top_k: int = DEFAULT_TOP_K
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False  # benchmarks only: generate exactly max_new_tokens
    presence_penalty: float = 0.0     # -2..2: subtracted once from each token already generated
    repetition_penalty: float = 1.0   # (0, 2]: HF semantics over the tokens generated so far
    frequency_penalty: float = 0.0    # -2..2: subtracted once per time a token was generated
    min_p: float = 0.0                # [0, 1]: drop tokens below min_p x the top token's prob
    logprobs: int | None = None
    grammar: Grammar | None = None
    prediction: tuple[int, ...] = ()  # predicted output's token ids: drafts for speculation
    logit_bias: tuple[tuple[int, float], ...] = ()   # (token id, -100..100) added to its logit

    def __post_init__(self) -> None:
        for tok, bias in self.logit_bias:
            if type(tok) is not int or tok < 0 or isinstance(bias, bool) \
                    or not isinstance(bias, (int, float)) or not -100 <= bias <= 100:
                raise ValueError(f"logit_bias entries must be (token id >= 0, bias in -100..100), "
                                 f"got ({tok!r}, {bias!r})")
        for name in ("max_new_tokens", "top_k"):
            if type(getattr(self, name)) is not int:
                raise ValueError(f"{name} must be a whole number, got {getattr(self, name)!r}")
        for name in ("temperature", "top_p", "presence_penalty", "repetition_penalty",
                     "frequency_penalty", "min_p"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) \
                    or not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number, got {value!r}")
        if not 1 <= self.max_new_tokens <= MAX_NEW_TOKENS:
            raise ValueError(f"max_new_tokens must be from 1 to {MAX_NEW_TOKENS} (the model's "
                             f"context), got {self.max_new_tokens}")
        if self.seed is not None and (type(self.seed) is not int or not 0 <= self.seed < 2**64):
            raise ValueError(f"seed must be a whole number from 0 to 2**64 - 1, got {self.seed!r}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 <= self.top_p <= 1:
            raise ValueError(f"top_p must be in [0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not -2 <= self.presence_penalty <= 2:
            raise ValueError(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        if not 0 < self.repetition_penalty <= 2:
            raise ValueError(f"repetition_penalty must be in (0, 2], got {self.repetition_penalty}")
        if not -2 <= self.frequency_penalty <= 2:
            raise ValueError(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.logprobs is not None and (type(self.logprobs) is not int
                                          or not 0 <= self.logprobs <= MAX_TOP_LOGPROBS):
            raise ValueError(f"logprobs must be None or a whole number from 0 to "
                             f"{MAX_TOP_LOGPROBS}, got {self.logprobs!r}")
        if self.grammar is not None and not isinstance(self.grammar, Grammar):
            raise ValueError("grammar must be a qwen_trt.params.Grammar")

    def stop_ids(self, model_stop_ids: Iterable[int]) -> frozenset[int]:
        """The ids that end this request: the model's (``BackendInfo.stop_token_ids``) and this
        request's own; none with ``ignore_eos``. The one home of the stop rule."""
        if self.ignore_eos:
            return frozenset()
        return frozenset(model_stop_ids) | frozenset(self.stop_token_ids)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1 or self.top_p == 0

    @property
    def penalized(self) -> bool:
        """Whether a penalty changes any logit (neutral values keep the plain samplers)."""
        return (self.presence_penalty != 0 or self.repetition_penalty != 1
                or self.frequency_penalty != 0 or bool(self.logit_bias))


def prompt_budget(max_input_len: int, max_seq_len: int, max_new_tokens: int) -> int:
    """The longest prompt that still leaves room for ``max_new_tokens`` new tokens."""
    return min(max_input_len, max_seq_len - max_new_tokens)


def fit_problem(n_prompt: int, max_new_tokens: int, max_input_len: int,
                max_seq_len: int) -> str | None:
    """Whether a prompt of ``n_prompt`` tokens plus ``max_new_tokens`` new ones fits an engine's
    limits: None if it does, else the one line saying why not. The one home of that rule
    (backends, the batched runner, the HTTP API and the chat session all ask here)."""
    if n_prompt == 0:
        return "The prompt is empty: there is nothing to answer."
    if n_prompt > prompt_budget(max_input_len, max_seq_len, max_new_tokens):
        return (f"The prompt ({n_prompt} tokens) + max new tokens ({max_new_tokens}) exceeds this "
                f"backend's limits (prompt {max_input_len}, prompt + reply {max_seq_len} tokens): "
                "shorten the prompt or lower max new tokens.")
    return None


class SampledToken(int):
    """A generated token id (it is the ``int``) with its :class:`TokenLogprob`."""

    logprob: TokenLogprob

    def __new__(cls, logprob: TokenLogprob) -> "SampledToken":
        tok = super().__new__(cls, logprob.token_id)
        tok.logprob = logprob
        return tok

    def __reduce__(self):
        return SampledToken, (self.logprob,)


@dataclass
class ReplyMetrics:
    """Timing of one reply, measured around the backend's token stream."""

    ttft_ms: float = 0.0          # request start -> first new token
    tokens: int = 0               # new tokens, the stop token included
    decode_tok_s: float = 0.0     # (tokens - 1) / (time after the first token)
    total_ms: float = 0.0
    prompt_tokens: int = 0
    finish_reason: FinishReason = "stop"
    cached_tokens: int | None = None   # prompt tokens served from the prefix cache, if known
    steps: int | None = None      # engine steps that emitted its tokens, where known: tokens /
                                  # steps > 1 with speculative decoding (accepted drafts)

    @property
    def tokens_per_step(self) -> float | None:
        return self.tokens / self.steps if self.steps else None


@dataclass
class Reply:
    """A finished (or interrupted) assistant reply."""

    text: str
    metrics: ReplyMetrics
    dropped_turns: int = 0
    token_ids: list[int] = field(default_factory=list)

    def to_json(self) -> dict:
        m = self.metrics
        return {
            "text": self.text,
            "finish_reason": m.finish_reason,
            "ttft_ms": round(m.ttft_ms, 2),
            "tokens": m.tokens,
            "tok_s": round(m.decode_tok_s, 2),
            "total_ms": round(m.total_ms, 2),
            "prompt_tokens": m.prompt_tokens,
            "dropped_turns": self.dropped_turns,
            **({"tokens_per_step": round(m.tokens_per_step, 3)}
               if m.tokens_per_step is not None else {}),
        }
