"""The step boundary: what the scheduler hands the model side for one step, and what it gets back.

A :class:`StepPlan` is plain rows, one per sequence, in the shape of vLLM v1's scheduler output:
a :class:`StepRow` names its request, the token ids to compute (their KV is written at positions
``start .. start + n - 1`` through the row's block table) and how many of its last positions
want logits. Decode, prefill chunks and verify rows are the same kind of row with another token
count:

* a decode row: one token, one logit row;
* a prefill chunk: ``n`` prompt tokens, one logit row when the chunk ends the prompt, else none;
* a verify row (speculative decoding): the last accepted token and ``draft`` drafted ones,
  ``draft + 1`` logit rows; the step accepts a prefix of the drafts and samples one more token.

The plan knows no scheduler objects. The :class:`StepOutput` gives per row the tokens it
emitted (the accepted drafts, then the one it sampled) and their logprobs. The executor
(:mod:`qwen_trt.fast.step.executor`) turns a plan into model inputs and picks; the scheduler
(``qwen_trt.serving.scheduler``) decides the plans and applies the outputs.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from qwen_trt.params import SamplingParams, TokenLogprob


@dataclass(frozen=True)
class StepRow:
    """One sequence's rows in a step (module docstring)."""

    rid: int                        # the request
    tokens: tuple[int, ...]         # inputs at positions start .. start + len - 1
    start: int                      # position of tokens[0] (tokens before it are in the KV cache)
    table: tuple[int, ...]          # block table covering start + len positions
    logits: int = 1                 # the last `logits` positions are scored (0: a mid-prompt chunk)
    sampler_row: int = -1           # its row of the sampler state
    params: SamplingParams = field(default_factory=SamplingParams)
    draft: int = 0                  # the last `draft` tokens are drafts to verify (logits = draft + 1)
    constraint: object = None       # its grammar state (fast.step.grammar.Constraint), or None
    # draft probabilities [draft, vocab] for a sampled row whose proposer has them (EAGLE-3);
    # None: the drafts are deterministic (n-gram lookup, a prediction)
    draft_probs: object = None

    def __post_init__(self) -> None:
        if not self.tokens:
            raise ValueError(f"request {self.rid}: a step row needs at least one token")
        if not 0 <= self.logits <= len(self.tokens):
            raise ValueError(f"request {self.rid}: {self.logits} logit rows for "
                             f"{len(self.tokens)} tokens")
        if self.draft and self.logits != self.draft + 1:
            raise ValueError(f"request {self.rid}: a verify row of {self.draft} drafts scores "
                             f"{self.draft + 1} positions, not {self.logits}")

    @property
    def n(self) -> int:
        return len(self.tokens)

    @property
    def ctx(self) -> int:
        """The sequence's context after the step (every token's KV written)."""
        return self.start + len(self.tokens)

    @property
    def decodes(self) -> bool:
        """A decode or verify row (its prompt is done), not a prefill chunk."""
        return self.logits > 0 and (len(self.tokens) == 1 or self.draft > 0)

    @property
    def valid(self) -> int:
        """Positions whose KV the step leaves valid, given the drafts it accepted: a verify
        row's last token and its accepted drafts, every token of any other row."""
        return len(self.tokens) - self.draft

    @property
    def drafts(self) -> tuple[int, ...]:
        return self.tokens[len(self.tokens) - self.draft:] if self.draft else ()


@dataclass(frozen=True)
class StepPlan:
    """The rows of one step; rows of one token (decode) first by convention."""

    rows: tuple[StepRow, ...]

    @property
    def tokens(self) -> int:
        return sum(r.n for r in self.rows)

    @property
    def decode_only(self) -> bool:
        """Every row one token, one logit row: a decode step (graphs per batch bucket)."""
        return all(r.n == 1 and r.logits == 1 for r in self.rows)

    @property
    def verifies(self) -> bool:
        return any(r.draft for r in self.rows)

    def flat(self) -> tuple[list[int], list[int], list[int]]:
        """``(tokens, positions, logit_rows)`` of the flat batch: rows in plan order, the
        logit rows of each row's last ``logits`` positions."""
        toks: list[int] = []
        pos: list[int] = []
        logit_rows: list[int] = []
        for r in self.rows:
            at = len(toks)
            toks += r.tokens
            pos += range(r.start, r.ctx)
            logit_rows += range(at + r.n - r.logits, at + r.n)
        return toks, pos, logit_rows


@dataclass(frozen=True)
class RowOutput:
    """What one row of a step emitted: the accepted drafts then the sampled token (nothing for
    a mid-prompt chunk); ``logprobs`` one per token where the request asked."""

    rid: int
    tokens: tuple[int, ...] = ()
    accepted: int = 0
    logprobs: tuple[TokenLogprob, ...] = ()
    drafts: tuple[int, ...] = ()     # a draft model's proposal for the row's next step


@dataclass(frozen=True)
class StepOutput:
    rows: tuple[RowOutput, ...]

    def by_rid(self) -> dict[int, RowOutput]:
        return {r.rid: r for r in self.rows}
