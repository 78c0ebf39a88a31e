"""Runs :class:`Qwen3Fast` for one request at a time: bucketed prefill, graph-replayed decode.

On CUDA (the default there) the decode step -- model forward plus token choice plus advancing
the position -- is captured as one CUDA graph per (KV-length bucket, sampler kind). Its forward
is our Triton kernels (``kernels="triton"``, checked against the PyTorch decode at build) or the
PyTorch ops compiled by inductor (``kernels="torch"``). The prefill's layer function is compiled
once with a dynamic length and the prefill captured per prompt-length bucket. Everything is
compiled and captured in :meth:`FastDecoder.warmup`, at load time.

Host/device traffic per token is one 8-byte copy into pinned memory. The engine keeps one
step in flight: it launches step n+1 before waiting for token n, so the GPU never idles on the
host; when the caller stops early the extra step's result is simply dropped. A request with a
grammar runs one step at a time instead: its mask for step n+1 (filled on the host from token
n, copied into the sampler's mask buffer, which the ``+mask`` graphs read) needs token n first.
Logprobs (``+logprobs`` graphs) are copied out of the sampler's buffers behind each step.

On CPU (CI) the same code runs eagerly, without compile or graphs.
"""
from __future__ import annotations

import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import dataclass, field

import torch

from qwen_trt.fast.compile_cache import skipped_checks
from qwen_trt.fast.step.checks import choose_kernels
from qwen_trt.fast.step.graphs import capture
from qwen_trt.fast.model.model import Qwen3Fast, prefill_layer
from qwen_trt.fast.step.sampling import Kind, SamplerState, logprob_of, pick, sampler_kind
from qwen_trt.params import SamplingParams
from qwen_trt.progress import StageClock

PREFILL_GRAPH_MAX = 4096   # prompts longer than this run compiled but not graph-captured
PREFILL_PAD = 512          # ...padded to a multiple of this (bounds recompiles/autotune)
MIN_PREFILL_BUCKET = 16
MIN_KV_BUCKET = 256
DECODE_COMPILE_OPTIONS = {"coordinate_descent_tuning": True}   # M=1 matmuls -> fused GEMV


def pow2_buckets(lo: int, hi: int) -> tuple[int, ...]:
    """lo, 2lo, 4lo, ... below ``hi``, then ``hi`` itself."""
    out, b = [], lo
    while b < hi:
        out.append(b)
        b *= 2
    out.append(hi)
    return tuple(out)


def bucket_for(n: int, buckets: Sequence[int]) -> int:
    for b in buckets:
        if b >= n:
            return b
    raise ValueError(f"{n} exceeds the largest bucket {buckets[-1]}")


@dataclass
class DecoderStats:
    """What load/warm-up cost (for the benchmark and the UI)."""

    compile: bool = False
    graphs: bool = False
    attention: str = "math"     # decode attention: "triton" kernels or "math" (masked matmuls)
    kernels: str = "torch"      # decode step: "triton" (fused kernels, no compile) or "torch"
    warmup_s: float = 0.0
    load_s: float = 0.0         # the weights read onto the device
    checks_s: float = 0.0       # the Triton self-checks of the constructor
    # the constructor's parts: attention_check_s, decode_check_s, compile_setup_s,
    # decoder_setup_s
    checks_parts: dict[str, float] = field(default_factory=dict)
    checks_note: str = ""       # e.g. which self-checks a warm compile cache let us skip
    prefill_graphs: int = 0
    decode_graphs: int = 0
    notes: list[str] = field(default_factory=list)


class _HostTokens:
    """Token ids coming back to the host: a pinned ring + events on CUDA, plain reads on CPU."""

    def __init__(self, device: torch.device, slots: int = 4) -> None:
        self.cuda = device.type == "cuda"
        self.slots = slots
        self.i = 0
        if self.cuda:
            self.buf = torch.zeros(slots, dtype=torch.long, pin_memory=True)
            self.events = [torch.cuda.Event() for _ in range(slots)]

    def push(self, tok: torch.Tensor) -> Callable[[], int]:
        if not self.cuda:
            value = int(tok.item())
            return lambda: value
        i = self.i
        self.i = (i + 1) % self.slots
        self.buf[i:i + 1].copy_(tok, non_blocking=True)
        self.events[i].record()
        buf, ev = self.buf, self.events[i]

        def get() -> int:
            ev.synchronize()
            return int(buf[i])
        return get


class FastDecoder:
    def __init__(self, model: Qwen3Fast, *, compile: bool | None = None,
                 graphs: bool | None = None, kv_buckets: Sequence[int] | None = None,
                 prefill_buckets: Sequence[int] | None = None,
                 attention: str = "auto", kernels: str = "auto") -> None:
        if attention not in ("auto", "triton", "math"):
            raise ValueError(f"attention must be auto, triton or math, got {attention!r}")
        if kernels not in ("auto", "triton", "torch"):
            raise ValueError(f"kernels must be auto, triton or torch, got {kernels!r}")
        on_cuda = model.device.type == "cuda"
        self.model = model.eval()
        self.stats = DecoderStats()
        clock = StageClock()
        choice = choose_kernels(model, attention, kernels, clock)
        self.stats.notes += choice.notes
        attention, kernels = choice.attention, choice.decode
        skipped = skipped_checks()
        if skipped:
            self.stats.checks_note = (f"skipped {', '.join(skipped)}: passed on an earlier "
                                      "start (compile cache)")
        if attention == "triton":   # reads only slots <= pos: no KV-length buckets needed
            kv_buckets = (model.max_seq_len,)
        self.device = model.device
        self.max_seq_len = model.max_seq_len
        self.compile = on_cuda if compile is None else compile
        self.graphs = (on_cuda if graphs is None else graphs) and on_cuda
        n = self.max_seq_len
        self.kv_buckets = tuple(kv_buckets or pow2_buckets(min(MIN_KV_BUCKET, n), n))
        self.prefill_buckets = tuple(prefill_buckets or pow2_buckets(
            min(MIN_PREFILL_BUCKET, n), min(n, PREFILL_GRAPH_MAX)))
        if self.kv_buckets[-1] != n:
            raise ValueError("the last KV bucket must equal max_seq_len")
        dev = self.device
        self.tok = torch.zeros(1, dtype=torch.long, device=dev)
        self.pos = torch.zeros(1, dtype=torch.long, device=dev)
        self.ids = torch.zeros(n, dtype=torch.long, device=dev)
        self.last = torch.zeros(1, dtype=torch.long, device=dev)
        self.positions = torch.arange(n, device=dev)
        self.logits = torch.zeros(1, model.cfg.vocab_size, dtype=model.dtype, device=dev)
        self.sampler = SamplerState(n, model.cfg.vocab_size, dev)
        self._mask_host = torch.full(self.sampler.mask.shape[1:], -1, dtype=torch.int32,
                                     pin_memory=on_cuda)
        self._host = _HostTokens(dev)
        self.stats.compile, self.stats.graphs, self.stats.attention, self.stats.kernels = (
            self.compile, self.graphs, attention, kernels)
        clock.mark("decoder_setup_s")
        if self.compile:
            # The Triton decode is already fused by hand: it is captured as is.
            self._decode_fn = model.decode if kernels == "triton" else torch.compile(
                model.decode, fullgraph=True, options=DECODE_COMPILE_OPTIONS)
            # One compile of one layer serves all layers and every prompt length: seconds
            # instead of a minute for the whole 36-layer graph on a cold cache. FP8 weights on
            # tensor cores too: compiled, their activation quantization fuses with the ops
            # around it (H200, 512 tokens: first token 7.7 ms, against 18.7 ms eager and
            # 11.0 ms dequantizing).
            self._prefill_layer = torch.compile(prefill_layer, fullgraph=True)
        else:
            self._decode_fn = model.decode
            self._prefill_layer = prefill_layer
        clock.mark("compile_setup_s")     # the first torch.compile imports dynamo (~1-2 s)
        self._pool = torch.cuda.graph_pool_handle() if self.graphs else None
        self._decode_graphs: dict[tuple[int, Kind], torch.cuda.CUDAGraph] = {}
        self._prefill_graphs: dict[int, torch.cuda.CUDAGraph] = {}
        clock.mark("decoder_setup_s")
        self.stats.checks_parts = dict(clock.parts)

    # ---- the two steps, as plain functions of the static buffers -------------------------
    def _prefill_layer_fn(self, cfg, x, pos, *rest):
        if self.compile:   # one compile for every prompt length
            torch._dynamo.maybe_mark_dynamic(x, 0)
            torch._dynamo.maybe_mark_dynamic(pos, 0)
        return self._prefill_layer(cfg, x, pos, *rest)

    def _prefill_step(self, length: int) -> None:
        ids = self.ids[:length]
        self.logits.copy_(self.model.prefill(ids, self.last, layer_fn=self._prefill_layer_fn))

    def _decode_step(self, kv_len: int, kind: Kind) -> None:
        kv_pos = self.positions[:kv_len]
        if self.compile and self.model.decode_impl == "torch":
            torch._dynamo.maybe_mark_dynamic(kv_pos, 0)
        logits = self._decode_fn(self.tok, self.pos, kv_pos)
        self.tok.copy_(pick(logits, kind, self.sampler))
        self.pos.add_(1)
        self.sampler.advance(self.tok, kind)

    # ---- compile + capture ---------------------------------------------------------------
    def _decode_graph(self, kv_len: int, kind: Kind) -> torch.cuda.CUDAGraph:
        key = (kv_len, kind)
        graph = self._decode_graphs.get(key)
        if graph is None:
            # A capture may happen mid-request (a sampler kind not warmed up): its warm-up runs
            # write only the spare cache slot past max_seq_len, which no request uses.
            state = (self.pos, self.tok, self.sampler.step, self.sampler.seen,
                     self.sampler.counts)
            saved = [b.clone() for b in state]

            def reset() -> None:
                self.pos.fill_(self.max_seq_len)
                self.sampler.step.zero_()

            graph = capture(lambda: self._decode_step(kv_len, kind), reset, self._pool)
            for b, v in zip(state, saved):
                b.copy_(v)
            self._decode_graphs[key] = graph
            self.stats.decode_graphs = len(self._decode_graphs)
        return graph

    def _prefill_graph(self, length: int) -> torch.cuda.CUDAGraph:
        graph = self._prefill_graphs.get(length)
        if graph is None:
            # A capture may happen mid-request (a bucket not warmed up): its runs move the
            # row whose logits are kept, so that is put back afterwards.
            saved = self.last.clone()

            def reset() -> None:
                self.last.fill_(length - 1)

            graph = capture(lambda: self._prefill_step(length), reset, self._pool)
            self.last.copy_(saved)
            self._prefill_graphs[length] = graph
            self.stats.prefill_graphs = len(self._prefill_graphs)
        return graph

    def warmup(self, kinds: Sequence[Kind] = ("greedy", "topk"),
               prefill: bool = True) -> DecoderStats:
        """Compile and capture everything a normal request needs (at load, not on request 1).
        ``prefill=False`` captures only the decode graphs (for profiling the decode step)."""
        t = time.perf_counter()
        with torch.inference_mode():
            if self.graphs:
                from tqdm import tqdm

                jobs = [(self._prefill_graph, (b,)) for b in self.prefill_buckets
                        if prefill] + [
                    (self._decode_graph, (b, kind)) for b in self.kv_buckets for kind in kinds]
                desc = "fast path: compiling + capturing CUDA graphs (minutes on a cold cache)"
                for fn, args in tqdm(jobs, desc=desc, unit="graph", file=sys.stderr):
                    fn(*args)
            else:
                params = SamplingParams(max_new_tokens=2, temperature=0)
                for _ in self.generate([0, 1, 2], params):
                    pass
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        self.stats.warmup_s = time.perf_counter() - t
        return self.stats

    # ---- one request ---------------------------------------------------------------------
    def _run_prefill(self, prompt_ids: Sequence[int]) -> None:
        t = len(prompt_ids)
        if self.graphs and t <= self.prefill_buckets[-1]:
            length = bucket_for(t, self.prefill_buckets)
        elif self.compile:
            length = min(-(-t // PREFILL_PAD) * PREFILL_PAD, self.max_seq_len)
        else:
            length = t
        self.ids[:t].copy_(torch.tensor(list(prompt_ids), dtype=torch.long))
        self.last.fill_(t - 1)
        if self.graphs and length in self.prefill_buckets:
            self._prefill_graph(length).replay()
        else:
            self._prefill_step(length)

    def _run_decode(self, pos: int, kind: Kind) -> None:
        kv_len = bucket_for(pos + 1, self.kv_buckets)
        if self.graphs:
            self._decode_graph(kv_len, kind).replay()
        else:
            self._decode_step(kv_len, kind)

    def generate(self, prompt_ids: Sequence[int], params: SamplingParams,
                 cancel: threading.Event | None = None,
                 stop_ids: Collection[int] = (), constraint=None) -> Iterator[int]:
        """Yield new token ids; same contract as :meth:`Backend.stream` (the caller checked the
        request with ``Backend.check_request``; stops at ``stop_ids`` and
        ``params.stop_token_ids`` unless ``params.ignore_eos``; at most ``max_new_tokens``;
        stops when ``cancel`` is set or the generator is closed). ``constraint``: the request's
        :class:`~qwen_trt.fast.step.grammar.Constraint` when it has a grammar."""
        t = len(prompt_ids)
        n = params.max_new_tokens
        stop = params.stop_ids(stop_ids)
        kind = sampler_kind(params)
        k = params.logprobs
        pending = deque([self._start(prompt_ids, params, kind, k, constraint)])
        launched, emitted = 1, 0
        while pending:
            if constraint is None and launched < n:   # keep one step in flight
                pending.append(self._step(t + launched - 1, kind, k))
                launched += 1
            tok_id = pending.popleft()()
            emitted += 1
            if constraint is not None:
                if not constraint.accept(tok_id):
                    from qwen_trt.fast.step.grammar import GrammarError

                    raise GrammarError(f"token {int(tok_id)} broke the request's grammar")
                if launched < n and tok_id not in stop:   # the next step needs this token
                    self._load_mask(constraint)
                    pending.append(self._step(t + launched - 1, kind, k))
                    launched += 1
            yield tok_id
            if tok_id in stop or emitted >= n or (cancel is not None and cancel.is_set()):
                return

    def _load_mask(self, constraint) -> None:
        """The grammar's mask for the next step into the sampler (the graphs read it)."""
        constraint.fill(self._mask_host)
        self.sampler.mask[0].copy_(self._mask_host, non_blocking=True)

    def _getter(self, k: int | None) -> Callable[[], int]:
        """The getter of this step's token (a SampledToken with its logprobs when ``k`` is
        set: copied out of the sampler behind the step, before the next one overwrites them)."""
        if k is None:
            return self._host.push(self.tok)
        st = self.sampler
        snap = (st.lp_token[0].clone(), st.lp_top[0, :k].clone(), st.lp_top_id[0, :k].clone())
        get = self._host.push(self.tok)

        def with_logprob() -> int:
            from qwen_trt.params import SampledToken

            return SampledToken(logprob_of(get(), *snap))
        return with_logprob

    @torch.inference_mode()
    def _start(self, prompt_ids: Sequence[int], params: SamplingParams,
               kind: Kind, k: int | None = None, constraint=None) -> Callable[[], int]:
        """Prefill and choose the first token; returns a getter for its id."""
        self.sampler.set(params)
        if constraint is not None:
            self._load_mask(constraint)
        self._run_prefill(prompt_ids)
        self.tok.copy_(pick(self.logits, kind, self.sampler))
        self.pos.fill_(len(prompt_ids))
        self.sampler.advance(self.tok, kind)
        return self._getter(k)

    @torch.inference_mode()
    def _step(self, pos: int, kind: Kind, k: int | None = None) -> Callable[[], int]:
        """Launch the decode step for the token at ``pos``; returns a getter for the next id."""
        self._run_decode(pos, kind)
        return self._getter(k)
