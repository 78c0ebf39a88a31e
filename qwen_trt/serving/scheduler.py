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


from qwen_trt.backends.runner import RunnerStats, StepFinish, TokenEvent
from qwen_trt.fast.step.batched import DEFAULT_MAX_BATCH, BatchedModel
from qwen_trt.fast.step.executor import Inflight, StepExecutor
from qwen_trt.fast.step.plan import StepOutput, StepPlan, StepRow
from qwen_trt.fast.step.sampling import SamplerState
from qwen_trt.params import SamplingParams, fit_problem
from qwen_trt.serving.kv_blocks import BlockAllocator, SeqBlocks
from qwen_trt.serving.speculation import AUTO_MAX, SpecConfig, Speculator

DEFAULT_TOKEN_BUDGET = 1024


@dataclass(frozen=True)
class SchedulerConfig:
    """``token_budget``: tokens computed per step (decode rows + prefill chunks); 1024 keeps a
    step of prefill near 15 ms on an H200 (ITL target 25 ms) while 8 prompts of 512 tokens
    still start within 4 steps (TTFT target 80 ms)."""

    max_batch: int = DEFAULT_MAX_BATCH
    token_budget: int = DEFAULT_TOKEN_BUDGET
    prefix_caching: bool = True
    speculative: SpecConfig = field(default_factory=SpecConfig)

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
    logprobs: tuple = ()           # the TokenLogprobs of the tokens being emitted
    spec: object = None            # its speculation state (serving.speculation.SeqSpec)


@dataclass
class Scheduled:
    """What :meth:`Scheduler.schedule` decided for one step: the plan the model side computes
    and, row for row, the sequences it belongs to (the runner applies the output to them)."""

    plan: StepPlan
    seqs: tuple[_Seq, ...]


class Scheduler:
    """The policy of :class:`BatchRunner` (module docstring): which sequences run, which wait,
    which are preempted, and what each step computes; the KV blocks and sampler rows they hold.
    It launches nothing: :meth:`schedule` returns a :class:`Scheduled` plan. ``drafts``: a
    running sequence's draft tokens for this step (speculative decoding; none by default)."""

    def __init__(self, config: SchedulerConfig, alloc: BlockAllocator,
                 sampler: SamplerState, drafts=None) -> None:
        self.config = config
        self.alloc = alloc
        self.sampler = sampler
        self.drafts = drafts or (lambda seq, batch: ())
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

    def schedule(self) -> Scheduled:
        budget = self.config.token_budget
        rows: list[StepRow] = []
        seqs: list[_Seq] = []
        decoding = [s for s in self.running if s.computed == len(s.tokens) - 1]
        for seq in decoding:
            if seq not in self.running:
                continue                                # preempted below
            while not self.alloc.can_allocate(
                    self.alloc.blocks_for(seq.computed + 1) - len(seq.blocks.table)):
                victim = self.running[-1]
                self.preempt(victim)
                if victim is seq:
                    break
            if seq not in self.running:
                continue
            draft = tuple(self.drafts(seq, len(decoding)))[:max(0, budget - 1)]
            if draft and not self.alloc.can_allocate(
                    self.alloc.blocks_for(seq.computed + 1 + len(draft))
                    - len(seq.blocks.table)):
                draft = ()                              # no room for the drafts: plain decode
            self.alloc.grow(seq.blocks, seq.computed + 1 + len(draft))
            rows.append(StepRow(seq.rid, (seq.tokens[seq.computed],) + draft, seq.computed,
                                tuple(seq.blocks.table), len(draft) + 1, seq.row, seq.params,
                                len(draft), seq.constraint))
            seqs.append(seq)
            budget -= 1 + len(draft)
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
            ends = seq.computed + n == len(seq.tokens)
            rows.append(StepRow(seq.rid, tuple(seq.tokens[seq.computed:seq.computed + n]),
                                seq.computed, tuple(seq.blocks.table), int(ends), seq.row,
                                seq.params, 0, seq.constraint))
            seqs.append(seq)
            budget -= n
        return Scheduled(StepPlan(tuple(rows)), tuple(seqs))

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


@dataclass(eq=False)
class _Chain:
    """A chained decode step in flight: the executor's handle and the sequences of its rows."""

    inflight: Inflight
    seqs: tuple[_Seq, ...]


class BatchRunner:
    """The continuous-batching runner of the fast path (module docstring): the scheduler's
    plans run by a :class:`~qwen_trt.fast.step.executor.StepExecutor`, the outputs applied
    to the sequences and sent as events."""

    def __init__(self, model: BatchedModel, config: SchedulerConfig | None = None, *,
                 stop_ids: Collection[int] = (), grammars=None, oracle=None) -> None:
        """``stop_ids``: the backend's stop ids (``BackendInfo.stop_token_ids``), added to each
        request's own unless it sets ``ignore_eos``. ``grammars``: a callable returning the
        :class:`~qwen_trt.fast.step.grammar.GrammarBook` of the model's tokenizer (requests
        with a grammar fail without it). ``oracle``: benchmarks' controlled drafts
        (:class:`~qwen_trt.serving.speculation.Speculator`)."""
        self.model = model
        self.config = config or SchedulerConfig()
        self.stop_ids = frozenset(stop_ids)
        self.spec = Speculator(self.config.speculative, oracle)
        # (the second stream of uniforms always: a request's prediction drafts with speculation
        # off too)
        self.sampler = SamplerState(model.max_seq_len, model.cfg.vocab_size, model.device,
                                    rows=self.config.max_batch, speculative=True)
        self.executor = StepExecutor(model, self.sampler)
        if self.config.speculative.method == "eagle3":
            drafter = getattr(model, "drafter", None)
            if drafter is None:
                raise ValueError("EAGLE-3 speculation needs the batched model built with its "
                                 "draft (make_batch_runner)")
            self.executor.drafter = drafter
        self.max_concurrency = self.config.max_batch
        self.max_seq_len = model.max_seq_len
        self.alloc = BlockAllocator(model.cache.num_blocks, model.block_size,
                                    prefix_caching=self.config.prefix_caching)
        self.policy = Scheduler(self.config, self.alloc, self.sampler, drafts=self._drafts)
        # the policy's queues, as this runner's loop reads them
        self._waiting, self._running = self.policy.waiting, self.policy.running
        self._seqs: dict[int, _Seq] = {}
        self._events: list[TokenEvent] = []
        self._inflight: _Chain | None = None
        self.chained_steps = 0
        self.last_step: dict = {"kind": "none"}    # what the last step() ran (bench.timeline)
        self.steps = 0
        self.max_step_tokens = 0
        self.last_step_tokens = 0
        self.prompt_tokens = 0
        self._grammars = grammars
        self._compiler = None           # a thread compiling grammars off the step loop

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
        if self.spec.on or params.prediction:
            seq.spec = self.spec.start(seq.tokens, params)
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
        extra = {"steps": self.steps, "max_step_tokens": self.max_step_tokens,
                 "token_budget": self.config.token_budget, "block_size": self.alloc.block_size,
                 "kv_cached_free_blocks": a.cached_free, "kv_evictions": a.evictions,
                 "preemptions": self.policy.preemptions, "max_batch": self.config.max_batch,
                 "chained_steps": self.chained_steps}
        if self.spec.on or self.spec.stats.drafts:
            extra["spec_decode"] = self.spec.counters()
        return RunnerStats(
            running=len(self._running), waiting=len(self._waiting), kv_blocks_used=a.used,
            kv_blocks_total=a.total, prefix_hit_tokens=self.policy.prefix_hit_tokens,
            prompt_tokens=self.prompt_tokens, extra=extra)

    def step(self) -> list[TokenEvent]:
        self.last_step = {"kind": "none"}
        self._grammars_ready()
        events, self._events = self._events, []
        if self._inflight is not None:
            events += self._drain_or_chain()
            return events
        sched = self.policy.schedule()
        plan = sched.plan
        if not plan.rows and not events:
            self._wait_compiles()
        if self.executor.can_chain(plan) and self.spec.may_chain(sched.seqs):
            # decode on the GPU, each step's tokens its next inputs: launch now, read the tokens
            # on the next call, by which time the next step is already queued behind this one
            # (the host never stalls it)
            self._inflight = _Chain(self.executor.launch(plan, self._seqs), sched.seqs)
            self._count_step(plan)
            return events
        if plan.rows:
            events += self._run(sched)
        return events

    def _count_step(self, plan: StepPlan) -> None:
        decode = sum(1 for r in plan.rows if r.decodes)
        prefill = sum(r.n for r in plan.rows if not r.decodes)
        drafts = sum(r.draft for r in plan.rows)
        self.last_step = {"kind": "prefill" if prefill else "verify" if drafts else "decode",
                          "decode_rows": decode, "prefill_tokens": prefill}
        if drafts:
            self.last_step["draft_tokens"] = drafts
        tokens = plan.tokens
        self.steps += 1
        self.last_step_tokens = tokens
        self.max_step_tokens = max(self.max_step_tokens, tokens)

    def _chain_ok(self, ch: _Chain) -> bool:
        """Whether the next step may be launched before this one's tokens are read: the same
        rows (nobody left, nobody waiting to join, no prefill running), none at its limit."""
        if self._waiting or len(self._running) != len(ch.seqs):
            return False
        if not self.spec.may_chain(ch.seqs):
            return False
        running = set(map(id, self._running))
        for s in ch.seqs:
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
        ch = self._inflight
        chained = self._chain_ok(ch)
        if chained:
            grown: dict[int, list[int]] = {}
            for row, s in enumerate(ch.seqs):
                before = len(s.blocks.table)
                self.alloc.grow(s.blocks, s.computed + 2)   # the chained step's position
                if len(s.blocks.table) != before:
                    grown[row] = list(s.blocks.table)
            self.executor.chain(ch.inflight, grown)
            self._count_step(StepPlan(ch.inflight.rows))
            self.chained_steps += 1
        out = self.executor.collect(ch.inflight)
        self._inflight = None
        events = self._apply(ch.seqs, out, StepPlan(ch.inflight.rows))
        if chained:
            self._inflight = _Chain(self.executor.pick_chained(ch.inflight, self._seqs), ch.seqs)
        events += self._events
        self._events = []
        return events

    def _apply(self, seqs: Sequence[_Seq], out: StepOutput, plan: StepPlan) -> list[TokenEvent]:
        """A step's output applied to its sequences: their computed KV, the tokens emitted
        (an event each sequence), the prefix cache's full blocks. A sequence that left while
        its step was in flight is skipped."""
        events: list[TokenEvent] = []
        for seq, res, row in zip(seqs, out.rows, plan.rows):
            if self._seqs.get(seq.rid) is not seq:     # left (stop, length or abort)
                continue
            seq.computed += row.valid + res.accepted
            if row.draft and seq.spec is not None:
                self.spec.record(seq.spec, row.draft, res.accepted)
            self.alloc.register_full(seq.blocks, seq.tokens, seq.computed)
            if seq.spec is not None:
                seq.spec.next = res.drafts
            if res.tokens:
                seq.logprobs = res.logprobs
                events += self._emit(seq, res.tokens)
        return events

    def _emit(self, seq: _Seq, toks: Sequence[int]) -> list[TokenEvent]:
        """Append ``toks`` (one step's emitted tokens) to ``seq``; it finishes at the first
        stop id, at its length limit or at a token its grammar refuses (the rest dropped)."""
        lps = seq.logprobs
        for i, tok in enumerate(toks):
            seq.tokens.append(tok)
            seq.generated += 1
            if seq.spec is not None:
                self.spec.extend(seq.spec, tok)
            finish: StepFinish | None = None
            if seq.constraint is not None and not seq.constraint.accept(tok):
                self._finish(seq, "error", (), error=f"token {tok} broke the request's grammar")
                return []
            if tok in seq.stop:
                finish = "stop"
            elif seq.generated >= seq.params.max_new_tokens or len(seq.tokens) >= self.max_seq_len:
                finish = "length"
            if finish:
                seq.logprobs = lps[:i + 1]
                self._finish(seq, finish, tuple(toks[:i + 1]))
                return []
        return [self._event(seq, tuple(toks), None)]

    # ---- scheduling ------------------------------------------------------------------------
    def _finish(self, seq: _Seq, finish: StepFinish, new: tuple[int, ...],
                error: str | None = None) -> None:
        if seq.row >= 0:
            self.executor.forget(seq.row)
        self.policy.release(seq)
        del self._seqs[seq.rid]
        self._events.append(self._event(seq, new, finish, error))

    def _event(self, seq: _Seq, new: tuple[int, ...], finish: StepFinish | None,
               error: str | None = None) -> TokenEvent:
        cached = 0 if seq.reported else seq.cached
        seq.reported = True
        lps, seq.logprobs = seq.logprobs, ()
        return TokenEvent(seq.rid, new, finish=finish, cached_tokens=cached, error=error,
                          logprobs=tuple(lps) if new else ())

    # ---- one model step --------------------------------------------------------------------
    def _run(self, sched: Scheduled) -> list[TokenEvent]:
        out = self.executor.run(sched.plan, self._seqs)
        self._count_step(sched.plan)
        events = self._apply(sched.seqs, out, sched.plan)
        events += self._events
        self._events = []
        return events

    # ---- speculation ------------------------------------------------------------------------
    def _drafts(self, seq: _Seq, batch: int) -> Sequence[int]:
        """Draft tokens for ``seq``'s next step (the speculator's proposer and adaptive
        count), bounded so no draft runs past the request's limits; none for a constrained
        sequence (its grammar's masks are per position)."""
        if seq.spec is None or seq.constraint is not None:
            return ()
        room = min(seq.params.max_new_tokens - seq.generated, self.max_seq_len - len(seq.tokens)) - 1
        if room <= 0:
            return ()
        return self.spec.propose(seq.spec, batch, room)

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


def make_batch_runner(model, config: SchedulerConfig | None = None, *,
                      kv_tokens: int | None = None, block_size: int | None = None,
                      graphs: bool | None = None, warmup: bool = True,
                      checked: bool = False, stop_ids: Collection[int] = (),
                      grammars=None) -> BatchRunner:
    """A :class:`BatchRunner` over the weights of ``model`` (a
    :class:`~qwen_trt.fast.model.model.Qwen3Fast`); its batch-1 static cache is freed. ``kv_tokens``
    caps the paged cache (default: what fits in free GPU memory; 8192 tokens on CPU)."""
    from qwen_trt.fast.step.build import make_batched
    from qwen_trt.serving.kv_blocks import DEFAULT_BLOCK_SIZE

    config = config or SchedulerConfig()
    spec = config.speculative
    k = spec.num_tokens or AUTO_MAX
    draft = None
    if spec.method == "eagle3":     # checked against the target before any warm-up
        from qwen_trt.fast.spec.eagle3 import load_eagle3

        draft = load_eagle3(spec.draft, model.cfg, dtype=model.dtype, device=model.device)
    bm = make_batched(model, block_size=block_size or DEFAULT_BLOCK_SIZE, kv_tokens=kv_tokens,
                      graphs=graphs, warmup=False, checked=checked, max_batch=config.max_batch,
                      verify_tokens=k)
    if draft is not None:
        from qwen_trt.fast.spec.drafter import EagleDrafter

        bm.drafter = EagleDrafter(draft, bm, slots=config.max_batch, k=k)
    if warmup:
        bm.warmup()
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
