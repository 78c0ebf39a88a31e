"""Typed settings and results shared by every backend and every front end."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

# Qwen3-Instruct-2507's recommended sampling defaults (model card).
DEFAULT_TEMPERATURE = 0.7
DEFAULT_TOP_P = 0.8
DEFAULT_TOP_K = 20
DEFAULT_MAX_NEW_TOKENS = 512
MAX_NEW_TOKENS = 262144           # Qwen3-4B-Instruct-2507's whole context

FinishReason = Literal["stop", "length", "cancelled", "error"]


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens. temperature 0 means greedy; top_k 0 and top_p 1 disable those filters.

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

    def __post_init__(self) -> None:
        for name in ("max_new_tokens", "top_k"):
            if type(getattr(self, name)) is not int:
                raise ValueError(f"{name} must be a whole number, got {getattr(self, name)!r}")
        for name in ("temperature", "top_p", "presence_penalty", "repetition_penalty"):
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
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not -2 <= self.presence_penalty <= 2:
            raise ValueError(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        if not 0 < self.repetition_penalty <= 2:
            raise ValueError(f"repetition_penalty must be in (0, 2], got {self.repetition_penalty}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1

    @property
    def penalized(self) -> bool:
        """Whether a penalty changes any logit (neutral values keep the plain samplers)."""
        return self.presence_penalty != 0 or self.repetition_penalty != 1


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
        }
