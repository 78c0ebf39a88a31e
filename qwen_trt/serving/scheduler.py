"""Continuous batching for the fast path: :class:`BatchRunner`, a :class:`~qwen_trt.backends.runner.Runner`.

Every :meth:`BatchRunner.step` spends a token budget (``SchedulerConfig.token_budget``), the
way vLLM V1 does (vllm-project/vllm:vllm/v1/core/sched/scheduler.py):

1. every running sequence whose prompt is done decodes one token (decode rows first: a long
   prompt can never starve the running streams);
2. the rest of the budget goes to prompts, oldest first: a partly prefilled one continues, then
   waiting requests are admitted (up to ``max_batch`` sequences in flight). A prompt longer than
   what is left is prefilled in chunks over several steps (chunked prefill), so a 2k-token
   prompt stalls the other streams by at most one budget-sized step.

A new request first looks up its prompt in the prefix cache
(:class:`~qwen_trt.serving.kv_blocks.BlockAllocator`): the full blocks it shares with an earlier
request (the same chat's history, a shared system prompt) are attached and only the rest is
prefilled; ``TokenEvent.cached_tokens`` says how many were reused. Finished or cancelled
sequences leave at once and their blocks go back (kept reusable until memory is short).

When a decode step finds no free block, the newest running sequence is preempted: its blocks
are freed and it goes back to the front of the queue with its tokens so far, to be recomputed
(vLLM's RECOMPUTE; its own blocks are often still cached).

Thread-confined like every runner: one thread calls every method.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

import torch

from qwen_trt.fast.step.sampling import (Picked, SamplerState, pick_rows, pick_rows_device,
                                    sampler_kind)
from qwen_trt.fast.step.batched import BatchedModel, SeqChunk
from qwen_trt.params import SamplingParams, fit_problem
from qwen_trt.serving.kv_blocks import BlockAllocator, SeqBlocks
from qwen_trt.backends.runner import RunnerStats, StepFinish, TokenEvent

DEFAULT_TOKEN_BUDGET = 1024
DEFAULT_MAX_BATCH = 32


@dataclass(frozen=True)
class SchedulerConfig:
    """``token_budget``: tokens computed per step (decode rows + prefill chunks); 1024 keeps a
    step of prefill near 15 ms on an H200 (ITL target 25 ms) while 8 prompts of 512 tokens
    still start within 4 steps (TTFT target 80 ms)."""

    max_batch: int = DEFAULT_MAX_BATCH
    token_budget: int = DEFAULT_TOKEN_BUDGET
    prefix_caching: bool = True

    def __post_init__(self) -> None:
        if self.max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {self.max_batch}")
        if self.token_budget < self.max_batch:
            raise ValueError(f"token_budget ({self.token_budget}) must be at least max_batch "
                             f"({self.max_batch}): every running sequence decodes each step")


@dataclass(eq=False)   # identity: list membership must not compare token lists
class _Seq:
    rid: int
    tokens: list[int]              # prompt + generated
    prompt_len: int
    params: SamplingParams
    stop: frozenset[int]
    blocks: SeqBlocks = field(default_factory=SeqBlocks)
    computed: int = 0              # tokens whose KV is in the cache
    cached: int = 0                # prompt tokens served by the prefix cache
    generated: int = 0
    reported: bool = False         # first event sent (it carries cached_tokens)
    admitted: bool = False
    row: int = -1                  # its row of the sampler state (kept through preemption)
    constraint: object = None      # its grammar state (backends.grammar.Constraint)
    compiling: object = None       # the Future of its grammar's compile, until admitted
    logprob: object = None         # the TokenLogprob of the token being emitted


@dataclass(eq=False)
class _Inflight:
    """A chained decode step launched but not yet read back: its rows, the handle of its
    tokens' copy to the host, and the sampler's picks (None: the graph's argmax)."""

    seqs: list[_Seq]
    rows: list[int]                # their sampler rows (a row that left keeps it till then)
    handle: tuple[int, int]
    picked: Picked | None = None


@dataclass
class StepPlan:
    """What one step computes: decode rows (one token each), then prefill chunks (seq, n)."""

    decode: list[_Seq]
    prefill: list[tuple[_Seq, int]]


class Scheduler:
    """The policy of :class:`BatchRunner` (module docstring): which sequences run, which wait,
    which are preempted, and what each step computes; the KV blocks and sampler rows they hold.
    It launches nothing: :meth:`schedule` returns a :class:`StepPlan`."""

    def __init__(self, config: SchedulerConfig, alloc: BlockAllocator,
                 sampler: SamplerState) -> None:
        self.config = config
        self.alloc = alloc
        self.sampler = sampler
        self.waiting: deque[_Seq] = deque()
        self.running: list[_Seq] = []
        # One sampler row per sequence in flight (a preempted one keeps its row: its step and
        # generated-token set go on after the recompute).
        self.free_rows = list(range(config.max_batch - 1, -1, -1))
        self.preemptions = 0
        self.prefix_hit_tokens = 0

    def release(self, seq: _Seq) -> None:
        """``seq`` leaves (finished, cancelled, failed): its blocks and row go back."""
        self.alloc.free(seq.blocks)
        if seq.row >= 0:
            self.free_rows.append(seq.row)
            seq.row = -1
        if seq in self.running:
            self.running.remove(seq)
        else:
            try:
                self.waiting.remove(seq)
            except ValueError:
                pass

    def preempt(self, seq: _Seq) -> None:
        self.alloc.free(seq.blocks)
        self.running.remove(seq)
        seq.computed = 0
        seq.admitted = False
        self.waiting.appendleft(seq)
        self.preemptions += 1

    def schedule(self) -> StepPlan:
        budget = self.config.token_budget
        decode: list[_Seq] = []
        for seq in list(self.running):
            if seq.computed < len(seq.tokens) - 1 or seq not in self.running:
                continue                                # still prefilling / preempted below
            while not self.alloc.can_allocate(
                    self.alloc.blocks_for(seq.computed + 1) - len(seq.blocks.table)):
                victim = self.running[-1]
                self.preempt(victim)
                if victim is seq:
                    break
            if seq not in self.running:
                continue
            self.alloc.grow(seq.blocks, seq.computed + 1)
            decode.append(seq)
            budget -= 1
        prefill: list[tuple[_Seq, int]] = []
        candidates = [s for s in self.running if s.computed < len(s.tokens) - 1]
        candidates += list(self.waiting)
        for seq in candidates:
            if budget <= 0:
                break
            if not seq.admitted:
                if seq.compiling is not None:           # its grammar is still compiling
                    continue
                if self.prefilling_same(seq):          # n > 1: prefill the prompt once
                    continue
                if len(self.running) >= self.config.max_batch or (
                        seq.row < 0 and not self.free_rows):
                    break
                hit = self.alloc.match_prefix(seq.blocks, seq.tokens)
                if not self.alloc.can_allocate(
                        self.alloc.blocks_for(min(len(seq.tokens), hit + budget))
                        - len(seq.blocks.table)):
                    self.alloc.free(seq.blocks)         # undo the match; wait for memory
                    break
                seq.computed = hit
                if not seq.reported:
                    seq.cached = hit
                    self.prefix_hit_tokens += hit
                seq.admitted = True
                if seq.row < 0:                         # a new request: its sampler row
                    seq.row = self.free_rows.pop()
                    self.sampler.set(seq.params, seq.row)
                self.waiting.remove(seq)
                self.running.append(seq)
            n = min(len(seq.tokens) - seq.computed, budget)
            need = self.alloc.blocks_for(seq.computed + n) - len(seq.blocks.table)
            if need > self.alloc.num_free:              # take what fits this step
                n = (len(seq.blocks.table) + self.alloc.num_free) * self.alloc.block_size \
                    - seq.computed
                if n <= 0:
                    break
            self.alloc.grow(seq.blocks, seq.computed + n)
            prefill.append((seq, n))
            budget -= n
        return StepPlan(decode, prefill)

    def prefilling_same(self, seq: _Seq) -> bool:
        """Whether a running sequence still prefilling starts with the same full block as
        ``seq`` (identical prompts in flight, ``n > 1``): ``seq`` waits, then takes those
        blocks from the prefix cache instead of computing them again."""
        bs = self.alloc.block_size
        if not self.config.prefix_caching or len(seq.tokens) <= bs:
            return False
        head = seq.tokens[:bs]
        return any(s.computed < len(s.tokens) - 1 and s.computed < s.prompt_len
                   and s.tokens[:bs] == head for s in self.running)


@dataclass
class StepInputs:
    """The batched model's inputs for a :class:`StepPlan`: the flat token ids and positions,
    one chunk per sequence, the rows whose logits are sampled, and those sequences."""

    tokens: list[int]
    positions: list[int]
    chunks: list[SeqChunk]
    logit_rows: list[int]
    sampled: list[_Seq]

    @classmethod
    def build(cls, plan: StepPlan) -> "StepInputs":
        inp = cls([], [], [], [], [])
        for seq in plan.decode:
            inp.chunks.append(SeqChunk(len(inp.tokens), 1, seq.computed + 1,
                                       tuple(seq.blocks.table)))
            inp.logit_rows.append(len(inp.tokens))
            inp.tokens.append(seq.tokens[seq.computed])
            inp.positions.append(seq.computed)
            inp.sampled.append(seq)
        for seq, n in plan.prefill:
            start = len(inp.tokens)
            inp.chunks.append(SeqChunk(start, n, seq.computed + n, tuple(seq.blocks.table)))
            inp.tokens += seq.tokens[seq.computed:seq.computed + n]
            inp.positions += range(seq.computed, seq.computed + n)
            if seq.computed + n == len(seq.tokens):
                inp.logit_rows.append(start + n - 1)
                inp.sampled.append(seq)
        return inp


class BatchRunner:
    """The continuous-batching runner of the fast path (module docstring)."""

    def __init__(self, model: BatchedModel, config: SchedulerConfig | None = None, *,
                 stop_ids: Collection[int] = (), grammars=None) -> None:
        """``stop_ids``: the backend's stop ids (``BackendInfo.stop_token_ids``), added to each
        request's own unless it sets ``ignore_eos``. ``grammars``: a callable returning the
        :class:`~qwen_trt.fast.step.grammar.GrammarBook` of the model's tokenizer (requests
        with a grammar fail without it)."""
        self.model = model
        self.config = config or SchedulerConfig()
        self.stop_ids = frozenset(stop_ids)
        self.sampler = SamplerState(model.max_seq_len, model.cfg.vocab_size, model.device,
                                    rows=self.config.max_batch)
        self.max_concurrency = self.config.max_batch
        self.max_seq_len = model.max_seq_len
        self.alloc = BlockAllocator(model.cache.num_blocks, model.block_size,
                                    prefix_caching=self.config.prefix_caching)
        self.policy = Scheduler(self.config, self.alloc, self.sampler)
        # the policy's queues, as this runner's loop reads them
        self._waiting, self._running = self.policy.waiting, self.policy.running
        self._seqs: dict[int, _Seq] = {}
        self._events: list[TokenEvent] = []
        self._inflight: _Inflight | None = None
        self.chained_steps = 0
        self.last_step: dict = {"kind": "none"}    # what the last step() ran (bench.timeline)
        self.steps = 0
        self.max_step_tokens = 0
        self.last_step_tokens = 0
        self.prompt_tokens = 0
        self._grammars = grammars
        self._compiler = None           # a thread compiling grammars off the step loop
        self._mask_host: torch.Tensor | None = None

    # ---- the Runner contract ---------------------------------------------------------------
    def add(self, request_id: int, prompt_ids: Sequence[int], params: SamplingParams) -> None:
        if request_id in self._seqs:
            raise ValueError(f"request {request_id} is already in the runner")
        n = len(prompt_ids)
        problem = fit_problem(n, params.max_new_tokens, self.max_seq_len, self.max_seq_len)
        if problem is None and self.alloc.blocks_for(n + params.max_new_tokens) > self.alloc.num_usable:
            problem = (f"Prompt ({n} tokens) + max new tokens ({params.max_new_tokens}) does not "
                       f"fit in the KV cache ({self.alloc.num_usable * self.alloc.block_size} "
                       f"tokens).")
        if problem:
            self._events.append(TokenEvent(request_id, finish="error", error=problem))
            return
        seq = _Seq(request_id, list(prompt_ids), n, params, params.stop_ids(self.stop_ids))
        if params.grammar is not None:
            if self._grammars is None:
                self._events.append(TokenEvent(request_id, finish="error", error=(
                    "Constrained decoding needs the model's tokenizer, which this runner "
                    "was built without.")))
                return
            seq.compiling = self._compile(params)
        self._seqs[request_id] = seq
        self._waiting.append(seq)
        self.prompt_tokens += n

    def abort(self, request_id: int) -> None:
        seq = self._seqs.get(request_id)
        if seq is None:
            return
        self._finish(seq, "cancelled", ())

    def has_work(self) -> bool:
        return bool(self._waiting or self._running or self._events or self._inflight)

    def stats(self) -> RunnerStats:
        a = self.alloc.stats()
        return RunnerStats(
            running=len(self._running), waiting=len(self._waiting), kv_blocks_used=a.used,
            kv_blocks_total=a.total, prefix_hit_tokens=self.policy.prefix_hit_tokens,
            prompt_tokens=self.prompt_tokens,
            extra={"steps": self.steps, "max_step_tokens": self.max_step_tokens,
                   "token_budget": self.config.token_budget, "block_size": self.alloc.block_size,
                   "kv_cached_free_blocks": a.cached_free, "kv_evictions": a.evictions,
                   "preemptions": self.policy.preemptions, "max_batch": self.config.max_batch,
                   "chained_steps": self.chained_steps})

    def step(self) -> list[TokenEvent]:
        self.last_step = {"kind": "none"}
        self._grammars_ready()
        events, self._events = self._events, []
        if self._inflight is not None:
            events += self._drain_or_chain()
            return events
        plan = self.policy.schedule()
        decode, prefill = plan.decode, plan.prefill
        if not decode and not prefill and not events:
            self._wait_compiles()
        if decode and not prefill and self.model.can_chain(len(decode)):
            # decode on the GPU, each step's tokens its next inputs: launch now, read the tokens
            # on the next call, by which time the next step is already queued behind this one
            # (the host never stalls it)
            self.model.decode_launch(
                [s.tokens[s.computed] for s in decode], [s.computed for s in decode],
                [s.blocks.table for s in decode])
            self._inflight = self._emit_step(decode, [s.row for s in decode])
            self._count_step(len(decode), len(decode))
            return events
        if decode or prefill:
            events += self._run(decode, prefill)
        return events

    def _count_step(self, tokens: int, decode_rows: int = 0, prefill_tokens: int = 0) -> None:
        self.last_step = {"kind": "prefill" if prefill_tokens else "decode",
                          "decode_rows": decode_rows, "prefill_tokens": prefill_tokens}
        self.steps += 1
        self.last_step_tokens = tokens
        self.max_step_tokens = max(self.max_step_tokens, tokens)

    def _emit_step(self, seqs: list[_Seq], rows: list[int]) -> _Inflight:
        """The tokens of the decode step just launched or chained over ``seqs``: the graph's
        argmax when every row is plain greedy, else the rows' sampler (settings, penalties,
        logprobs, grammar masks from each constraint as of its last accepted token), queued
        behind the step on the device; their copy to the host queued too. ``rows``: the
        sequences' sampler rows (one that left while in flight is picked for, and ignored:
        its row is not handed out again before this chain ends)."""
        b = len(seqs)
        if all(sampler_kind(s.params) == "greedy" for s in seqs):
            return _Inflight(list(seqs), rows, self.model.decode_emit(b))
        picked = pick_rows_device(self.sampler, self.model.decode_logits(b), rows,
                                  [s.params for s in seqs], self._masks(seqs))
        picked.stage()
        return _Inflight(list(seqs), rows, self.model.decode_emit(b, picked.tokens), picked)

    def _chain_ok(self, inf: _Inflight) -> bool:
        """Whether the next step may be launched before this one's tokens are read: the same
        rows (nobody left, nobody waiting to join, no prefill running), none at its limit."""
        if self._waiting or len(self._running) != len(inf.seqs):
            return False
        running = set(map(id, self._running))
        for s in inf.seqs:
            if id(s) not in running or s.computed != len(s.tokens) - 1:
                return False
            # the step in flight yields token generated+1; the chained one generated+2
            if (s.generated + 2 > s.params.max_new_tokens
                    or len(s.tokens) + 2 > self.max_seq_len):
                return False
            if not self.alloc.can_allocate(
                    self.alloc.blocks_for(s.computed + 2) - len(s.blocks.table)):
                return False
        return True

    def _drain_or_chain(self) -> list[TokenEvent]:
        """Read back the step in flight; first, when the same rows go on, chain the next
        step behind it (its inputs are the tokens in flight), whose tokens are picked once
        these are known (a grammar's next mask needs them)."""
        inf = self._inflight
        chained = self._chain_ok(inf)
        if chained:
            grown: dict[int, list[int]] = {}
            for row, s in enumerate(inf.seqs):
                before = len(s.blocks.table)
                self.alloc.grow(s.blocks, s.computed + 2)   # the chained step's position
                if len(s.blocks.table) != before:
                    grown[row] = list(s.blocks.table)
            self.model.decode_chain(len(inf.seqs), grown)
            self._count_step(len(inf.seqs), len(inf.seqs))
            self.chained_steps += 1
        toks = self.model.decode_result(inf.handle)
        lps = inf.picked.result(toks) if inf.picked is not None else None
        self._inflight = None
        running = set(map(id, self._running))
        events: list[TokenEvent] = []
        for i, (seq, tok) in enumerate(zip(inf.seqs, toks)):
            if id(seq) not in running:     # left (stop, length or abort) while in flight
                continue
            seq.computed += 1
            self.alloc.register_full(seq.blocks, seq.tokens, seq.computed)
            if lps is not None:
                seq.logprob = lps[i]
            events += self._emit(seq, tok)
        if chained:
            self._inflight = self._emit_step(inf.seqs, inf.rows)
        events += self._events
        self._events = []
        return events

    def _emit(self, seq: _Seq, tok: int) -> list[TokenEvent]:
        seq.tokens.append(tok)
        seq.generated += 1
        finish: StepFinish | None = None
        if seq.constraint is not None and not seq.constraint.accept(tok):
            self._finish(seq, "error", (), error=f"token {tok} broke the request's grammar")
            return []
        if tok in seq.stop:
            finish = "stop"
        elif seq.generated >= seq.params.max_new_tokens or len(seq.tokens) >= self.max_seq_len:
            finish = "length"
        if finish:
            self._finish(seq, finish, (tok,))
            return []
        return [self._event(seq, (tok,), None)]

    # ---- scheduling ------------------------------------------------------------------------
    def _finish(self, seq: _Seq, finish: StepFinish, new: tuple[int, ...],
                error: str | None = None) -> None:
        self.policy.release(seq)
        del self._seqs[seq.rid]
        self._events.append(self._event(seq, new, finish, error))

    def _event(self, seq: _Seq, new: tuple[int, ...], finish: StepFinish | None,
               error: str | None = None) -> TokenEvent:
        cached = 0 if seq.reported else seq.cached
        seq.reported = True
        lp, seq.logprob = seq.logprob, None
        return TokenEvent(seq.rid, new, finish=finish, cached_tokens=cached, error=error,
                          logprobs=(lp,) if lp is not None and new else ())

    # ---- one model step --------------------------------------------------------------------
    def _run(self, decode: list[_Seq], prefill: list[tuple[_Seq, int]]) -> list[TokenEvent]:
        inp = StepInputs.build(StepPlan(decode, prefill))
        if prefill:
            logits = self.model.forward(inp.tokens, inp.positions, inp.chunks, inp.logit_rows)
        else:
            logits = self.model.decode(inp.tokens, inp.positions, [c.table for c in inp.chunks])
        picked = self._pick(logits, inp.sampled)
        self._count_step(len(inp.tokens), len(decode), sum(n for _, n in prefill))
        for seq in decode:
            seq.computed += 1
        for seq, n in prefill:
            seq.computed += n
        for seq in decode + [s for s, _ in prefill]:
            self.alloc.register_full(seq.blocks, seq.tokens, seq.computed)
        events: list[TokenEvent] = []
        for seq, tok in zip(inp.sampled, picked):
            events += self._emit(seq, tok)
        events += self._events
        self._events = []
        return events

    def _pick(self, logits: torch.Tensor, seqs: list[_Seq]) -> list[int]:
        """One token per row of ``logits`` with each sequence's settings: the shared sampler
        (:func:`qwen_trt.fast.step.sampling.pick_rows`) over those sequences' rows of the
        sampler state, with the grammar masks of the constrained ones (filled on the host
        while the step's forward runs on the GPU: it was launched before this call)."""
        if not seqs:
            return []
        toks, lps = pick_rows(self.sampler, logits, [s.row for s in seqs],
                              [s.params for s in seqs], self._masks(seqs))
        for seq, lp in zip(seqs, lps):
            seq.logprob = lp
        return toks

    # ---- grammars: compiled off the step loop, masks filled per step -----------------------
    def _compile(self, params: SamplingParams):
        from concurrent.futures import ThreadPoolExecutor

        if self._compiler is None:
            self._compiler = ThreadPoolExecutor(1, thread_name_prefix="qwen-trt-grammar")
        book = self._grammars
        return self._compiler.submit(lambda: book().constraint(params.grammar,
                                                               params.max_new_tokens))

    def _grammars_ready(self) -> None:
        """Waiting requests whose grammar compiled may be admitted; a bad one fails."""
        for seq in [s for s in self._waiting if s.compiling is not None]:
            if not seq.compiling.done():
                continue
            fut, seq.compiling = seq.compiling, None
            try:
                seq.constraint = fut.result()
            except Exception as e:  # noqa: BLE001 - this request fails, the others go on
                from qwen_trt.serving.serial import error_line

                self._finish(seq, "error", (), error=error_line(e))

    def _wait_compiles(self) -> None:
        """Nothing to run but compiles: wait a little for one instead of spinning."""
        from concurrent.futures import FIRST_COMPLETED, wait

        futs = [s.compiling for s in self._waiting if s.compiling is not None]
        if futs:
            wait(futs, timeout=0.05, return_when=FIRST_COMPLETED)

    def _masks(self, seqs: list[_Seq]) -> torch.Tensor | None:
        """int32 ``[len(seqs), words]`` grammar masks for a step (all ones for the
        unconstrained rows and for rows that already left), or None when no row is
        constrained."""
        if all(s.constraint is None for s in seqs):
            return None
        st = self.sampler
        if self._mask_host is None:
            self._mask_host = torch.empty(st.mask.shape, dtype=torch.int32,
                                          pin_memory=st.mask.is_cuda)
        host = self._mask_host[:len(seqs)]
        host.fill_(-1)
        for i, seq in enumerate(seqs):
            if seq.constraint is not None and self._seqs.get(seq.rid) is seq:
                seq.constraint.fill(host[i])
        return host


def make_batch_runner(model, config: SchedulerConfig | None = None, *,
                      kv_tokens: int | None = None, block_size: int | None = None,
                      graphs: bool | None = None, warmup: bool = True,
                      checked: bool = False, stop_ids: Collection[int] = (),
                      grammars=None) -> BatchRunner:
    """A :class:`BatchRunner` over the weights of ``model`` (a
    :class:`~qwen_trt.fast.model.model.Qwen3Fast`); its batch-1 static cache is freed. ``kv_tokens``
    caps the paged cache (default: what fits in free GPU memory; 8192 tokens on CPU)."""
    from qwen_trt.fast.step.batched import make_batched
    from qwen_trt.serving.kv_blocks import DEFAULT_BLOCK_SIZE

    bm = make_batched(model, block_size=block_size or DEFAULT_BLOCK_SIZE, kv_tokens=kv_tokens,
                      graphs=graphs, warmup=warmup, checked=checked)
    return BatchRunner(bm, config, stop_ids=stop_ids, grammars=grammars)


def batch_runner_for(backend, config: SchedulerConfig | None = None, *,
                     kv_tokens: int | None = None) -> BatchRunner:
    """The continuous-batching runner over a fast backend's weights (built once, then attached
    to the backend so its ``stream`` goes through it too)."""
    runner = backend.attached_runner
    if runner is None:
        runner = make_batch_runner(backend.take_model(), config, kv_tokens=kv_tokens,
                                   checked=True, stop_ids=backend.info.stop_token_ids,
                                   grammars=getattr(backend, "grammars", None))
        backend.attach_runner(runner)
    return runner
