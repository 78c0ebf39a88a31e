"""Speculative decoding, the scheduler's side: which sequences draft, how many tokens, and the
acceptance counters.

The proposer here is draft-free n-gram lookup (:class:`qwen_trt.fast.spec.ngram.NgramIndex`): a
sequence's last few tokens are matched against its prompt and reply so far, and the tokens that
followed the most recent match are drafted. The step side verifies them
(:mod:`qwen_trt.fast.step.executor`: exact acceptance, so the output is the target's).

How many tokens a sequence drafts (``num_tokens=None``, auto) comes from its measured
acceptance and the batch: with a per-token acceptance rate ``a`` a row of ``k`` drafts emits
``(1 - a^(k+1)) / (1 - a)`` tokens a step, and a verify step costs about what a decode step does
while the step's rows stay few (the weights are read once either way), more as the step's
tokens grow. The rule picks the ``k`` with the most tokens per unit of cost, ``0`` when none
pays: a sequence whose drafts keep failing stops drafting, and retries after a while.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from qwen_trt.fast.spec.ngram import NgramIndex
from qwen_trt.params import SamplingParams

METHODS = ("off", "ngram", "eagle3")
MAX_DRAFT = 8                # the most draft tokens a step verifies per sequence
AUTO_MAX = 5                 # auto's most
COOLDOWN_TOKENS = 32         # a sequence whose drafts keep failing drafts again after this many


@dataclass(frozen=True)
class SpecConfig:
    """``method``: off or ngram; ``num_tokens``: draft tokens per step (None: auto, from the
    acceptance and the batch); ``ngram_max`` / ``ngram_min``: the longest and shortest
    suffix matched."""

    method: str = "off"
    num_tokens: int | None = None
    ngram_max: int = 5
    ngram_min: int = 2
    draft: str | None = None          # eagle3: the draft's folder (either published layout)

    @classmethod
    def parse(cls, text: str, num_tokens: int | None = None) -> "SpecConfig":
        """``off`` | ``ngram`` | ``eagle3:PATH`` (the ``--speculative`` value)."""
        method, _, path = text.partition(":")
        return cls(method, num_tokens, draft=path or None)

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative method must be one of {', '.join(METHODS)}, "
                             f"got {self.method!r}")
        if self.num_tokens is not None and not 1 <= self.num_tokens <= MAX_DRAFT:
            raise ValueError(f"num_speculative_tokens must be from 1 to {MAX_DRAFT} (or auto), "
                             f"got {self.num_tokens}")
        if (self.method == "eagle3") != bool(self.draft):
            raise ValueError("speculative decoding with EAGLE-3 needs the draft's folder: "
                             "eagle3:PATH" if self.method == "eagle3" else
                             f"a draft folder goes with eagle3 only, not {self.method}")
        if not 1 <= self.ngram_min <= self.ngram_max <= 16:
            raise ValueError(f"n-gram sizes must satisfy 1 <= min <= max <= 16, got "
                             f"{self.ngram_min}..{self.ngram_max}")


@dataclass(eq=False)
class SeqSpec:
    """One sequence's speculation state."""

    index: NgramIndex
    prompt_len: int = 0
    next: tuple[int, ...] = ()    # a draft model's proposal for the next step (EAGLE-3)
    drafted: float = 0.0          # decayed counts of drafted and accepted tokens
    accepted: float = 0.0
    wait: int = 0                 # tokens to go before it drafts again


@dataclass
class SpecCounters:
    """vLLM's ``spec_decode_*`` counters: verify steps, draft tokens, accepted tokens, and
    accepted tokens per draft position."""

    drafts: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=lambda: [0] * MAX_DRAFT)


def expected_tokens(rate: float, k: int) -> float:
    """Tokens a verify row of ``k`` drafts emits on average at per-token acceptance ``rate``."""
    if rate >= 1.0:
        return k + 1.0
    return (1.0 - rate ** (k + 1)) / (1.0 - rate)


def step_cost(batch: int, k: int) -> float:
    """A step's cost relative to a chained decode step of ``batch`` rows, when each row verifies
    ``k`` drafts: a verify step is not chained (+10 %), and rows beyond 32 stop being free
    (the weights' read stops hiding the extra rows' arithmetic)."""
    if k == 0:
        return 1.0
    rows = batch * (k + 1)
    return 1.15 + 0.02 * k + max(0, rows - 32) / 128


def auto_tokens(rate: float, batch: int, cap: int = AUTO_MAX) -> int:
    """The draft count with the most tokens per unit of cost (0: no drafting pays)."""
    best, best_k = 1.0, 0
    for k in range(1, cap + 1):
        v = expected_tokens(rate, k) / step_cost(batch, k)
        if v > best * 1.02:
            best, best_k = v, k
    return best_k


class Speculator:
    """The runner's speculation policy (module docstring)."""

    def __init__(self, config: SpecConfig, oracle=None) -> None:
        """``oracle``: benchmarks only (:mod:`qwen_trt.bench.speculative`): an object whose
        ``propose(seq_spec, generated, k)`` drafts replace the n-gram lookup's after the lookup
        has run (so its cost is spent) and whose ``has(seq_spec)`` says whether it would draft,
        for a controlled acceptance."""
        self.config = config
        self.on = config.method != "off"
        self.oracle = oracle
        self.stats = SpecCounters()

    def start(self, prompt: Sequence[int], params: SamplingParams) -> SeqSpec:
        index = NgramIndex(self.config.ngram_max, self.config.ngram_min)
        index.extend(prompt)
        return SeqSpec(index, len(prompt))

    def extend(self, s: SeqSpec, token: int) -> None:
        s.index.extend((token,))
        if s.wait:
            s.wait -= 1

    def rate(self, s: SeqSpec) -> float:
        prior_d, prior_a = 2.0, 1.2          # a prior of 60 % over two tokens
        return (s.accepted + prior_a) / (s.drafted + prior_d)

    def propose(self, s: SeqSpec, batch: int, room: int) -> tuple[int, ...]:
        if s.wait:
            return ()
        k = self.config.num_tokens or auto_tokens(self.rate(s), batch)
        k = min(k, room, MAX_DRAFT)
        if k <= 0:
            # drafting does not pay at this acceptance: pause, and let the estimate drift back
            # towards the prior, so the sequence tries again (its text may have changed)
            s.wait = COOLDOWN_TOKENS
            s.drafted *= 0.5
            s.accepted *= 0.5
            return ()
        draft = s.next if self.config.method == "eagle3" else s.index.propose(k)
        if self.oracle is not None:
            draft = self.oracle.propose(s, len(s.index.tokens) - s.prompt_len, k)
        return tuple(draft)[:k]

    def has_draft(self, s: SeqSpec) -> bool:
        """Whether ``s`` would draft at its next step (its suffix matches; not cooling down)."""
        if s.wait > 1:
            return False
        if self.oracle is not None:
            return self.oracle.has(s)
        if self.config.method == "eagle3":
            return True                 # the draft runs after every step: never chained
        return bool(s.index.propose(1))

    def record(self, s: SeqSpec, drafted: int, accepted: int) -> None:
        decay = 0.95
        s.drafted = s.drafted * decay + drafted
        s.accepted = s.accepted * decay + accepted
        st = self.stats
        st.drafts += 1
        st.draft_tokens += drafted
        st.accepted_tokens += accepted
        for i in range(accepted):
            st.accepted_per_pos[i] += 1

    def may_chain(self, seqs: Sequence) -> bool:
        """Whether a decode step of these sequences may chain (its tokens stay on the device):
        only while none of them would draft next step (a chain's inputs are on the device,
        so a draft needs the host's turn). The lookup is a few dictionary probes a row, made
        while the step in flight runs."""
        if not self.on:
            return True
        return not any(q.spec is not None and q.constraint is None and self.has_draft(q.spec)
                       for q in seqs)

    def counters(self) -> dict:
        st = self.stats
        return {"drafts": st.drafts, "draft_tokens": st.draft_tokens,
                "accepted_tokens": st.accepted_tokens,
                "accepted_per_pos": list(st.accepted_per_pos),
                "mean_acceptance_length": round(1 + st.accepted_tokens / st.drafts, 3)
                if st.drafts else None}
