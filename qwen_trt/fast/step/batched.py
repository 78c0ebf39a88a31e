"""The batched forward of the fast path: many sequences per step over a paged KV cache.

One step takes a flat batch of rows: decode rows (one token of a running sequence) first, then
prefill chunks (several prompt tokens of one sequence, starting anywhere: after a prefix-cache
hit or an earlier chunk). Every row is projected together (one matrix product per weight,
``M = rows``); attention runs per sequence over its own tokens through its block table.

On CUDA every step replays a CUDA graph:

* decode-only steps: a graph per batch-size bucket (1, 2, 4, 8, 16, 32; the batch is padded
  up, padded rows write the scratch block) and context width (1k, 2k, 4k, 8k tokens, the
  longest: the narrowest that holds every row), attention by
  :func:`~qwen_trt.fast.kernels.paged_kernels.paged_decode_attention` (flash-decoding). Bucket 1 keeps
  the batch-1 decoder's fused Triton GEMVs (``model.decode_impl == "triton"``); larger buckets
  pick the small-batch Triton projections or cuBLAS by timing at warm-up. Decode steps of the
  same rows chain (:meth:`BatchedModel.decode_launch`): each step's tokens (its argmax inside
  the graph, or the sampler's picks written by :meth:`BatchedModel.decode_emit`) are the next
  step's inputs on the device.
* steps that prefill (any mix of prefill chunks and decode rows): a graph per token-count
  bucket (16 .. 1024 rows, padded up), attention by
  :func:`~qwen_trt.fast.kernels.paged_kernels.paged_varlen_attention`, which reads every sequence's
  rows, lengths and block table on the device, so one graph serves any mix of sequences and
  context lengths (no per-context buckets, no K/V gather, no mask tensor).

Token choice runs on the device after the step, per row, with each row's own settings, by the
one sampler of both torch paths (:mod:`qwen_trt.fast.step.sampling`, driven by the runner). On
CPU (and where a Triton self-check failed) the step runs eagerly with the math attention
(:func:`~qwen_trt.fast.kernels.paged_kernels.paged_attention_ref`), which CI tests on the tiny model.

The weights are the :class:`~qwen_trt.fast.model.model.Qwen3Fast` ones; its static batch-1 cache is
not used (:func:`~qwen_trt.fast.step.build.make_batched` shrinks it).
"""
from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from qwen_trt.errors import first_line
from qwen_trt.fast import compile_cache
from qwen_trt.fast.model.kv_cache import DEFAULT_BLOCK_SIZE, SCRATCH_BLOCK, LayerKVCache
from qwen_trt.fast.model.model import Qwen3Fast, mlp, rms_norm, split_norm_rope
from qwen_trt.fast.kernels.linear import dense, linear, prefill_weight
from qwen_trt.fast.kernels.paged_kernels import (VARLEN_BLOCK_Q, VARLEN_TILES, paged_attention_ref,
                                         paged_rope_cache, paged_rope_decode_attention,
                                         paged_varlen_attention, triton, varlen_max_tiles,
                                         varlen_tiles)
from qwen_trt.fast.step.graphs import capture, replay_ms
from qwen_trt.fast.options import options
from qwen_trt.params import DEFAULT_MAX_BATCH



def graph_buckets(max_batch: int = DEFAULT_MAX_BATCH) -> tuple[int, ...]:
    """The decode graphs' batch buckets for ``max_batch`` rows: powers of two below it, then
    ``max_batch`` itself (a step pads its rows up to the next bucket)."""
    if max_batch < 1:
        raise ValueError(f"max_batch must be >= 1, got {max_batch}")
    out, b = [], 1
    while b < max_batch:
        out.append(b)
        b *= 2
    return tuple(out) + (max_batch,)


GRAPH_BUCKETS = graph_buckets()
# Decode graphs per context width too (tokens; the last is the model's max_seq_len): the
# attention's grid spans every split of its table's width, so a graph as wide as the longest
# context a row can have launches ~18x the programs a 1.7k-token batch needs (H200, 32 rows,
# 36 layers: 5.8 ms of attention per step at the 32k width, 3.3 ms at 2k; bench.paged_attn).
WIDTH_TOKENS = (1024, 2048, 4096, 8192)
# rows of a step that prefills: a step is padded to the next bucket, so above 256 rows they
# are 128 apart (a lone 638-token prompt ran as a 1024-row step, 1.6x its compute)
STEP_TOKEN_BUCKETS = (16, 32, 64, 128, 256, 384, 512, 640, 768, 896, 1024)


def _pre_attention(x: torch.Tensor, ln: torch.Tensor, w: torch.Tensor, eps: float):
    """RMSNorm + fused q/k/v projection of every row."""
    return linear(rms_norm(x, ln, eps), w)


def _post_attention(x: torch.Tensor, o: torch.Tensor, wo: torch.Tensor, ln: torch.Tensor,
                    w_gate_up: torch.Tensor, w_down: torch.Tensor, eps: float):
    """o projection + residual, then the MLP block (the model's :func:`mlp`)."""
    x = x + linear(o, wo)
    gate, up = linear(rms_norm(x, ln, eps), w_gate_up).chunk(2, dim=-1)
    return x + linear(F.silu(gate) * up, w_down)


def _pre_triton(x: torch.Tensor, ln: torch.Tensor, w: torch.Tensor, eps: float):
    """:func:`_pre_attention` with the norm as :func:`~qwen_trt.fast.kernels.bgemm.rms_rows`."""
    from qwen_trt.fast.kernels.bgemm import rms_rows

    return linear(rms_rows(x, ln, eps), w)


def _post_triton(x: torch.Tensor, o: torch.Tensor, wo: torch.Tensor, ln: torch.Tensor,
                 w_gate_up: torch.Tensor, w_down: torch.Tensor, eps: float):
    """:func:`_post_attention` with the residual add fused into the norm
    (:func:`~qwen_trt.fast.kernels.bgemm.rms_rows`) and SiLU·up as one kernel (``silu_mul_rows``):
    the kernels inductor makes of it, the same rounding, without ``torch.compile``."""
    from qwen_trt.fast.kernels.bgemm import rms_rows, silu_mul_rows

    h, n = rms_rows(x, ln, eps, residual=linear(o, wo))
    return h + linear(silu_mul_rows(linear(n, w_gate_up)), w_down)


def _compile_for_any_rows(fn, n_row_args: int):
    """``fn`` compiled once for every row count: dim 0 of its first ``n_row_args`` arguments
    (the activations) is symbolic, the weights' shapes stay constants in the generated kernels
    (``torch.compile(dynamic=True)`` would make them symbolic too: 1.06x slower steps)."""
    compiled = torch.compile(fn, fullgraph=True)

    def call(*args):
        for a in args[:n_row_args]:
            torch._dynamo.maybe_mark_dynamic(a, 0)
        return compiled(*args)
    return call


class PagedKVCache(LayerKVCache):
    """Per layer K and V ``[kv_heads, num_blocks * block_size, head_dim]``: slot
    ``block * block_size + offset`` holds one token. Block 0 is scratch (padding rows)."""

    def __init__(self, layers: int, kv_heads: int, head_dim: int, num_blocks: int,
                 block_size: int, dtype: torch.dtype, device) -> None:
        super().__init__(layers, (kv_heads, num_blocks * block_size, head_dim), dtype, device)
        self.num_blocks = num_blocks
        self.block_size = block_size


@dataclass(frozen=True)
class SeqChunk:
    """One sequence's rows in a step: rows ``start .. start + n - 1`` of the flat batch are its
    tokens at positions ``ctx - n .. ctx - 1``; ``table`` its block table."""

    start: int
    n: int
    ctx: int
    table: tuple[int, ...]


@dataclass(frozen=True)
class VarlenMeta:
    """A step's sequences on the device, as :func:`paged_varlen_attention` reads them."""

    tables: torch.Tensor      # [S, max_blocks] int32
    ctx: torch.Tensor         # [S] int32: context after the step
    qstart: torch.Tensor      # [S] int32: first row
    qlen: torch.Tensor        # [S] int32: rows
    tile_seq: torch.Tensor    # [tiles] int32 (-1: padding)
    tile_q0: torch.Tensor     # [tiles] int32


@dataclass
class BatchedStats:
    graphs: bool = False
    gemv_bucket1: bool = False
    attention: str = "math"
    buckets: tuple[int, ...] = ()
    warmup_s: float = 0.0
    step_graphs: int = 0                                         # token buckets captured
    phases_s: dict[str, float] = field(default_factory=dict)     # warm-up time per phase
    # token bucket -> {tile shape: ms} of the varlen attention at warm-up
    varlen_ms: dict[int, dict[str, float]] = field(default_factory=dict)
    bucket_impl: dict[int, str] = field(default_factory=dict)   # gemv | bgemm | torch
    bucket_ms: dict[int, dict[str, float]] = field(default_factory=dict)  # replay ms, warm-up
    notes: list[str] = field(default_factory=list)
    late_captures: int = 0       # graphs captured after the warm-up (each beside live requests)


class BatchedModel:
    """Steps of many sequences over a :class:`PagedKVCache` with the weights of ``model``."""

    def __init__(self, model: Qwen3Fast, *, num_blocks: int, block_size: int = DEFAULT_BLOCK_SIZE,
                 max_seq_len: int | None = None, graphs: bool | None = None,
                 buckets: Sequence[int] = GRAPH_BUCKETS, verify_tokens: int = 0) -> None:
        """``buckets``: the decode graphs' batch buckets (:func:`graph_buckets` of the
        runner's ``max_batch``: the largest is the most sequences a step holds);
        ``verify_tokens``: the most draft tokens a sequence verifies in a step (the step
        graphs then return up to ``1 + verify_tokens`` logit rows a sequence)."""
        self.model = model
        self.cfg = model.cfg
        self.device = model.device
        self.block_size = block_size
        self.max_seq_len = min(max_seq_len or model.max_seq_len, model.max_seq_len)
        self.max_blocks = -(-self.max_seq_len // block_size)
        self.cache = PagedKVCache(self.cfg.layers, self.cfg.kv_heads, self.cfg.head_dim,
                                  num_blocks, block_size, model.dtype, self.device)
        on_cuda = self.device.type == "cuda"
        self.stats = BatchedStats()
        self._warmed = False          # warmup() done: a graph captured later is a late one
        # The paged Triton kernels need what the batch-1 attention self-check established.
        self.triton = (on_cuda and triton is not None and model.attn_impl == "triton"
                       and block_size >= 16 and block_size & (block_size - 1) == 0)
        self.gemv1 = self.triton and model.decode_impl == "triton"
        self.graphs = bool(on_cuda and self.triton and (graphs is None or graphs))
        self.buckets = tuple(sorted(buckets))
        self.stats.graphs, self.stats.gemv_bucket1 = self.graphs, self.gemv1
        self.stats.attention = "triton" if self.triton else "math"
        self.stats.buckets = self.buckets if self.graphs else ()
        # Steps that prefill: the Triton varlen attention (checked at warm-up, else the math
        # step) and, around it, the norms / activation / residual adds as fused kernels for any
        # row count (inside a graph nothing is left of their host cost): by default two Triton
        # kernels (_pre_triton / _post_triton: no torch.compile, so no dynamo import at start;
        # the same step times on the H200), with KernelOptions.step_triton=False the pieces
        # compiled by torch.compile; step_compile=False keeps the plain PyTorch ops (to debug).
        self.varlen = self.triton
        self.step_graphs = False
        # (block_q, warps) of the varlen attention per token bucket: timed at warm-up
        self.varlen_tile: dict[int, tuple[int, int]] = {}
        self.aux_layers: tuple[int, ...] = ()     # capture_aux: hidden states for a draft
        self._aux: torch.Tensor | None = None
        self._capturing: int | None = None
        self._pre, self._post = _pre_attention, _post_attention
        if self.triton and options().step_compile and options().step_triton:
            self._pre, self._post = _pre_triton, _post_triton
        elif self.triton and options().step_compile:
            self._pre = _compile_for_any_rows(_pre_attention, 1)
            self._post = _compile_for_any_rows(_post_attention, 2)
        # decode graphs by (bucket, width in blocks); the widths: WIDTH_TOKENS, then all
        self.widths = tuple(sorted({-(-t // block_size) for t in WIDTH_TOKENS
                                    if t < self.max_blocks * block_size} | {self.max_blocks}))
        self._graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self._pool = torch.cuda.graph_pool_handle() if self.graphs else None
        if self.graphs:
            n, dev = self.buckets[-1], self.device
            # One device buffer per dtype, filled by one host->device copy each step:
            # rows tok | pos | slot (int64), then lens | block tables (int32).
            self.g_meta = torch.zeros(4, n, dtype=torch.long, device=dev)
            self.g_tok, self.g_pos, self.g_slot = self.g_meta[0], self.g_meta[1], self.g_meta[2]
            self.g_live = self.g_meta[3]                  # 1 for real rows, 0 for padding
            self.g_i32 = torch.zeros(n * (1 + self.max_blocks), dtype=torch.int32, device=dev)
            self.g_lens = self.g_i32[:n]
            self.g_tables = self.g_i32[n:].view(n, self.max_blocks)
            self.g_logits = torch.zeros(n, self.cfg.vocab_size, dtype=model.dtype, device=dev)
            self.h_meta = torch.zeros(4, n, dtype=torch.long, pin_memory=True)
            # chained greedy steps: next tokens come back through two pinned slots
            self.h_next = torch.zeros(2, n, dtype=torch.long, pin_memory=True)
            self._next_events = [torch.cuda.Event(), torch.cuda.Event()]
            self._next_slot = 0
            self._fgraphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
            self._chain_ctx = 0     # the chained batch's longest context after its last step
            self.h_meta_np = self.h_meta.numpy()
            self.h_i32 = torch.zeros(n * (1 + self.max_blocks), dtype=torch.int32,
                                     pin_memory=True)
            self.h_lens_np = self.h_i32[:n].numpy()
            self.h_tables_np = self.h_i32[n:].view(n, self.max_blocks).numpy()
            # Steps that prefill: one graph per token bucket over these buffers (host copies
            # pinned): rows tok | pos | slot (int64); logit rows (int64); then int32: per
            # sequence ctx | qstart | qlen, per tile seq | q0, per sequence its block table.
            t_max, s_max = STEP_TOKEN_BUCKETS[-1], n
            nt = varlen_max_tiles(t_max, s_max)
            self.s_max, self.t_buckets = s_max, STEP_TOKEN_BUCKETS
            # logit rows a step returns: one a sequence, 1 + verify_tokens with drafts
            self.l_max = min(t_max, s_max * (1 + verify_tokens))
            self.s_meta = torch.zeros(3, t_max, dtype=torch.long, device=dev)
            self.s_rows = torch.zeros(self.l_max, dtype=torch.long, device=dev)
            self.s_i32 = torch.zeros(3 * s_max + 2 * nt + s_max * self.max_blocks,
                                     dtype=torch.int32, device=dev)
            self.s_logits = torch.zeros(self.l_max, self.cfg.vocab_size, dtype=model.dtype,
                                        device=dev)
            self.h_s_meta = torch.zeros(3, t_max, dtype=torch.long, pin_memory=True)
            self.h_s_rows = torch.zeros(self.l_max, dtype=torch.long, pin_memory=True)
            self.h_s_i32 = torch.zeros_like(self.s_i32, device="cpu").pin_memory()
            self._s_graphs: dict[int, torch.cuda.CUDAGraph] = {}
            self.step_graphs = True

    # ---- shared pieces ---------------------------------------------------------------------
    def slot_of(self, table: Sequence[int], pos: int) -> int:
        return table[pos // self.block_size] * self.block_size + pos % self.block_size

    def _slots_tensor(self, table: Sequence[int], n: int) -> torch.Tensor:
        bs = self.block_size
        return torch.tensor([table[t // bs] * bs + t % bs for t in range(n)], dtype=torch.long,
                            device=self.device)

    def _head(self, x: torch.Tensor) -> torch.Tensor:
        m = self.model
        return F.linear(rms_norm(x, m.ln_final, self.cfg.rms_eps), m._head())

    def _tables_tensor(self, tables: Sequence[Sequence[int]]) -> torch.Tensor:
        t = torch.zeros(len(tables), self.max_blocks, dtype=torch.int32)
        for i, row in enumerate(tables):
            t[i, :len(row)] = torch.tensor(row, dtype=torch.int32)
        return t.to(self.device)

    # ---- steps that prefill: decode rows and prefill chunks together ---------------------
    @torch.inference_mode()
    def forward(self, tokens: Sequence[int], positions: Sequence[int],
                chunks: Sequence[SeqChunk], logit_rows: Sequence[int]) -> torch.Tensor:
        """Rows ``tokens``/``positions`` grouped by ``chunks`` (decode chunks, ``n == 1``,
        first); writes every row's K/V and returns the logits ``[len(logit_rows), vocab]``.
        A graph replay on CUDA when the rows fit a token bucket and the sequences the graphs'
        width; else the same step eagerly (math attention where the Triton kernels are off)."""
        if not self.varlen:
            return self._forward_math(tokens, positions, chunks, logit_rows)
        n = len(tokens)
        bucket = next((t for t in self.t_buckets if t >= n), None) if (
            self.graphs and self.step_graphs and len(chunks) <= self.s_max
            and len(logit_rows) <= self.l_max) else None
        if bucket is None:   # eager, with the same kernels
            tile = self._tile(n)
            meta_np, rows_np, i32_np = self._stage(tokens, positions, chunks, logit_rows, n,
                                                   len(chunks), len(chunks), tile)
            dev = self.device
            meta = torch.from_numpy(meta_np).to(dev)
            return self._varlen_body(meta[0], meta[1], meta[2],
                                     self._varlen_meta(torch.from_numpy(i32_np).to(dev),
                                                       len(chunks), n),
                                     torch.from_numpy(rows_np).to(dev), tile)
        t_max = self.t_buckets[-1]
        self._stage(tokens, positions, chunks, logit_rows, t_max, self.s_max, self.l_max,
                    self._tile(bucket),
                    (self.h_s_meta.numpy(), self.h_s_rows.numpy(), self.h_s_i32.numpy()))
        self.s_meta[:, :bucket].copy_(self.h_s_meta[:, :bucket], non_blocking=True)
        self.s_rows.copy_(self.h_s_rows, non_blocking=True)
        self.s_i32.copy_(self.h_s_i32, non_blocking=True)
        self._step_graph(bucket).replay()
        self._aux = None                            # this step's aux: in s_aux
        return self.s_logits[:len(logit_rows)]

    def _tile(self, rows: int) -> tuple[int, int]:
        """The varlen attention's (block_q, warps) for a step of ``rows`` rows: its token
        bucket's (the largest bucket's beyond it), as timed at warm-up."""
        b = next((t for t in STEP_TOKEN_BUCKETS if t >= rows), STEP_TOKEN_BUCKETS[-1])
        return self.varlen_tile.get(b, (VARLEN_BLOCK_Q, 4))

    def _stage(self, tokens: Sequence[int], positions: Sequence[int],
               chunks: Sequence[SeqChunk], logit_rows: Sequence[int], t_cap: int, s_cap: int,
               rows_cap: int, tile: tuple[int, int],
               out: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """A step's inputs as host arrays (the layout of the graphs' buffers, see __init__):
        padded rows are token 0 at position 0 writing the scratch block, padded tiles -1;
        tiles of ``tile[0]`` query rows."""
        bs, n = self.block_size, len(tokens)
        nt = varlen_max_tiles(t_cap, s_cap)
        if out is None:
            out = (np.zeros((3, t_cap), np.int64), np.zeros(rows_cap, np.int64),
                   np.zeros(3 * s_cap + 2 * nt + s_cap * self.max_blocks, np.int32))
        meta, rows, i32 = out
        meta[:2].fill(0)
        meta[0, :n] = tokens
        pos = np.asarray(positions, dtype=np.int64)
        meta[1, :n] = pos
        meta[2].fill(SCRATCH_BLOCK * bs)
        ctx, qstart, qlen = i32[:s_cap], i32[s_cap:2 * s_cap], i32[2 * s_cap:3 * s_cap]
        tile_seq, tile_q0 = i32[3 * s_cap:3 * s_cap + nt], i32[3 * s_cap + nt:3 * s_cap + 2 * nt]
        tables = i32[3 * s_cap + 2 * nt:].reshape(s_cap, self.max_blocks)
        i32.fill(0)
        for s_i, c in enumerate(chunks):
            tab = np.asarray(c.table, dtype=np.int64)
            p = pos[c.start:c.start + c.n]
            meta[2, c.start:c.start + c.n] = tab[p // bs] * bs + p % bs
            ctx[s_i], qstart[s_i], qlen[s_i] = c.ctx, c.start, c.n
            tables[s_i, :len(tab)] = tab
        ts, tq = varlen_tiles([c.n for c in chunks], tile[0])
        tile_seq.fill(-1)
        tile_seq[:len(ts)] = ts
        tile_q0[:len(tq)] = tq
        rows.fill(0)
        rows[:len(logit_rows)] = logit_rows
        return meta, rows, i32

    def _varlen_meta(self, i32: torch.Tensor, s_cap: int, t_cap: int,
                     tiles: int | None = None) -> VarlenMeta:
        """Views of a staged int32 buffer (:meth:`_stage`); ``tiles`` of the tile arrays."""
        nt = varlen_max_tiles(t_cap, s_cap)
        k = nt if tiles is None else tiles
        o = 3 * s_cap
        return VarlenMeta(tables=i32[o + 2 * nt:].view(s_cap, self.max_blocks),
                          ctx=i32[:s_cap], qstart=i32[s_cap:2 * s_cap], qlen=i32[2 * s_cap:o],
                          tile_seq=i32[o:o + k], tile_q0=i32[o + nt:o + nt + k])

    def _varlen_body(self, tok: torch.Tensor, pos: torch.Tensor, slots: torch.Tensor,
                     meta: VarlenMeta, rows: torch.Tensor, tile: tuple[int, int]) -> torch.Tensor:
        """One step that prefills, on CUDA (eager or captured): cuBLAS projections of every
        row, the fused q/k norm + RoPE + K/V write, one varlen attention; logits of ``rows``."""
        cfg, m = self.cfg, self.model
        eps = cfg.rms_eps
        x = F.embedding(tok, m.embed)
        dt = m.dtype        # packed projections: dequantized, then cuBLAS (or FP8 GEMMs)
        pw = self._step_weight()
        aux = []
        for i, layer in enumerate(m.layers):
            if i in self.aux_layers:
                aux.append(x)
            kc, vc = self.cache.kv(i)
            qkv = self._pre(x, layer.ln_in, pw(layer.wqkv, dt), eps)
            q = paged_rope_cache(qkv, layer.q_norm, layer.k_norm, m.cos, m.sin, pos, slots,
                                 kc, vc, eps, cfg.heads)
            o = paged_varlen_attention(q, kc, vc, meta.tables, meta.ctx, meta.qstart, meta.qlen,
                                       meta.tile_seq, meta.tile_q0, self.block_size, *tile)
            x = self._post(x, o.reshape(-1, cfg.q_size), pw(layer.wo, dt), layer.ln_post,
                           pw(layer.w_gate_up, dt), pw(layer.w_down, dt), eps)
        if self.aux_layers:         # the hidden states a draft reads (EAGLE-3), every row
            self._keep_aux(torch.cat(aux, dim=-1))
        return self._head(x.index_select(0, rows))

    def capture_aux(self, layers: Sequence[int]) -> None:
        """Keep the hidden states entering ``layers`` (concatenated, every row of every step that
        prefills or verifies) for a draft model (EAGLE-3): :meth:`aux` reads them after the step.
        Call before warm-up: the step graphs copy them into a static buffer."""
        self.aux_layers = tuple(layers)
        if self.step_graphs:
            self.s_aux = torch.zeros(self.t_buckets[-1], len(layers) * self.cfg.hidden,
                                     dtype=self.model.dtype, device=self.device)
            self._s_graphs.clear()

    def _keep_aux(self, aux: torch.Tensor) -> None:
        if self._capturing is not None:            # inside a step graph: its static buffer
            self.s_aux[:aux.shape[0]].copy_(aux)
        else:
            self._aux = aux

    def aux(self, rows: int) -> torch.Tensor:
        """The aux hidden states ``[rows, n_aux * hidden]`` of the last step's first ``rows``
        rows (:meth:`capture_aux`)."""
        return self._aux[:rows] if self._aux is not None else self.s_aux[:rows]

    def _step_weight(self):
        """How a step that prefills takes its weights: FP8 ones marked for tensor cores as
        they are (:func:`~qwen_trt.fast.kernels.linear.prefill_weight`) only when
        ``QWEN_TRT_FP8_PREFILL=tensorcore`` asks and its pieces are not compiled by
        ``torch.compile``, else dense. Under ``auto`` the runner dequantizes: on the H200 its
        tensor-core steps were slower (8 prompts of 512 at once: first token 243 ms against
        50 ms; docs/benchmarks.md), while the batch-1 decoder's compiled prefill is faster."""
        tc = options().fp8_prefill == "tensorcore"
        return prefill_weight if tc and self._pre in (_pre_triton, _pre_attention) else dense

    def _forward_math(self, tokens: Sequence[int], positions: Sequence[int],
                      chunks: Sequence[SeqChunk], logit_rows: Sequence[int]) -> torch.Tensor:
        """The eager step with PyTorch ops and the math attention (CPU; CUDA fallback)."""
        cfg, m, dev = self.cfg, self.model, self.device
        tok = torch.tensor(list(tokens), dtype=torch.long, device=dev)
        pos = torch.tensor(list(positions), dtype=torch.long, device=dev)
        slots = torch.tensor([self.slot_of(c.table, p) for c in chunks
                              for p in positions[c.start:c.start + c.n]], dtype=torch.long,
                             device=dev)
        ctx_slots = [self._slots_tensor(c.table, c.ctx) for c in chunks]
        q_pos = [torch.arange(c.ctx - c.n, c.ctx, device=dev) for c in chunks]
        x = F.embedding(tok, m.embed)
        aux = []
        for i, layer in enumerate(m.layers):
            if i in self.aux_layers:
                aux.append(x)
            kc, vc = self.cache.kv(i)
            qkv = _pre_attention(x, layer.ln_in, dense(layer.wqkv, m.dtype), cfg.rms_eps)
            q, k, v = split_norm_rope(qkv, pos, m.cos, m.sin, layer.q_norm, layer.k_norm,
                                      cfg.heads, cfg.kv_heads, cfg.head_dim, cfg.rms_eps)
            kc.index_copy_(1, slots, k.transpose(0, 1))
            vc.index_copy_(1, slots, v.transpose(0, 1))
            o = torch.empty_like(q)
            for c, cs, qp in zip(chunks, ctx_slots, q_pos):
                o[c.start:c.start + c.n] = paged_attention_ref(q[c.start:c.start + c.n], kc, vc,
                                                               cs, qp)
            x = _post_attention(x, o.reshape(-1, cfg.q_size), dense(layer.wo, m.dtype),
                                layer.ln_post, dense(layer.w_gate_up, m.dtype),
                                dense(layer.w_down, m.dtype), cfg.rms_eps)
        if self.aux_layers:
            self._keep_aux(torch.cat(aux, dim=-1))
        rows = torch.tensor(list(logit_rows), dtype=torch.long, device=dev)
        return self._head(x.index_select(0, rows))

    def _step_graph(self, bucket: int) -> torch.cuda.CUDAGraph:
        graph = self._s_graphs.get(bucket)
        if graph is None:
            s_cap, t_max = self.s_max, self.t_buckets[-1]
            tile = self._tile(bucket)
            meta = self._varlen_meta(self.s_i32, s_cap, t_max,
                                     tiles=varlen_max_tiles(bucket, s_cap, tile[0]))

            def reset() -> None:   # every row padding: scratch slot, position 0, no tiles
                self._stage([], [], [], [], t_max, s_cap, self.l_max, tile,
                            (self.h_s_meta.numpy(), self.h_s_rows.numpy(), self.h_s_i32.numpy()))
                self.s_meta.copy_(self.h_s_meta)
                self.s_rows.copy_(self.h_s_rows)
                self.s_i32.copy_(self.h_s_i32)

            nl = min(bucket, self.l_max)        # a step has no more logit rows than tokens

            def body() -> None:
                tok, pos, slots = (self.s_meta[j, :bucket] for j in range(3))
                self._capturing = bucket
                try:
                    self.s_logits[:nl].copy_(self._varlen_body(tok, pos, slots, meta,
                                                               self.s_rows[:nl], tile))
                finally:
                    self._capturing = None

            if self._warmed:
                self.stats.late_captures += 1
            graph = capture(body, reset, self._pool)
            self._s_graphs[bucket] = graph
            self.stats.step_graphs = len(self._s_graphs)
        return graph

    # ---- decode-only steps: CUDA graphs per batch bucket ----------------------------------
    @torch.inference_mode()
    def decode(self, tokens: Sequence[int], positions: Sequence[int],
               tables: Sequence[Sequence[int]]) -> torch.Tensor:
        """One decode row per sequence (token ``tokens[b]`` at ``positions[b]``); returns
        logits ``[B, vocab]``. A graph replay on CUDA when ``B`` fits a bucket."""
        b = len(tokens)
        if not self.graphs or b > self.buckets[-1]:
            chunks = [SeqChunk(i, 1, p + 1, tuple(t)) for i, (p, t) in
                      enumerate(zip(positions, tables))]
            return self.forward(tokens, positions, chunks, list(range(b)))
        bucket = next(x for x in self.buckets if x >= b)
        self.decode_meta(tokens, positions, tables, bucket)
        self._graph(bucket, self.width_for(max(positions) + 1)).replay()
        return self.g_logits[:b]

    def width_for(self, ctx: int) -> int:
        """The narrowest decode-graph width (blocks) that holds ``ctx`` tokens."""
        need = -(-ctx // self.block_size)
        return next((w for w in self.widths if w >= need), self.widths[-1])

    # ---- chained decode: each step's tokens stay on the device as the next step's inputs ---
    def can_chain(self, b: int) -> bool:
        """Whether a decode step of ``b`` rows may use :meth:`decode_launch` (CUDA graphs;
        ``QWEN_TRT_CHAIN=0`` turns it off)."""
        return self.graphs and b <= self.buckets[-1] and options().chain

    @torch.inference_mode()
    def decode_launch(self, tokens: Sequence[int], positions: Sequence[int],
                      tables: Sequence[Sequence[int]]) -> None:
        """Like :meth:`decode`, but the graph also takes each row's argmax as its next input
        token (:meth:`decode_emit` may replace it with the sampler's pick) and advances its
        position, length and slot on the device, so :meth:`decode_chain` can launch the next
        step before the host has seen these tokens. Nothing waits here."""
        b = len(tokens)
        bucket = next(x for x in self.buckets if x >= b)
        if bucket not in self.stats.bucket_impl:
            self._graph(bucket)
        self.decode_meta(tokens, positions, tables, bucket)
        self._chain_ctx = max(positions) + 1
        self._chain_replay(bucket)

    def decode_meta(self, tokens: Sequence[int], positions: Sequence[int],
                    tables: Sequence[Sequence[int]], bucket: int) -> None:
        """Stage one decode step's inputs and copy them to the graph's buffers (two copies).
        The pinned staging is free: the previous step's results were read on the host since.
        Padded rows: token 0 at position 0, length 1, the scratch block, not live."""
        bs = self.block_size
        meta, lens, tabs = self.h_meta_np, self.h_lens_np, self.h_tables_np
        b = len(tokens)
        meta.fill(0)
        lens.fill(1)
        tabs.fill(0)
        pos = np.asarray(positions, dtype=np.int64)
        meta[0, :b] = tokens
        meta[1, :b] = pos
        meta[2, :b] = [row[p // bs] * bs + p % bs for row, p in zip(tables, positions)]
        meta[2, b:] = SCRATCH_BLOCK * bs
        meta[3, :b] = 1
        lens[:b] = pos + 1
        for i, row in enumerate(tables):
            tabs[i, :len(row)] = row
        self.g_meta.copy_(self.h_meta, non_blocking=True)
        self.g_i32.copy_(self.h_i32, non_blocking=True)

    @torch.inference_mode()
    def decode_chain(self, b: int, table_rows: dict[int, Sequence[int]]) -> None:
        """The next step of the batch of the last launch (same rows), its inputs already on
        the device (the last :meth:`decode_emit`); ``table_rows`` are rows whose block table
        grew (uploaded first)."""
        bucket = next(x for x in self.buckets if x >= b)
        for row, table in table_rows.items():   # pinned + async: no wait on the step in flight
            src = torch.tensor(table, dtype=torch.int32).pin_memory()
            self.g_tables[row, :len(table)].copy_(src, non_blocking=True)
        self._chain_ctx += 1
        self._chain_replay(bucket)

    def _chain_replay(self, bucket: int) -> None:
        """Replay the chained graph of ``bucket`` as wide as the batch's context now (the
        graphs of one bucket share their buffers, so a chain moves on to a wider one)."""
        self._fgraph(bucket, self.width_for(self._chain_ctx)).replay()

    def decode_logits(self, b: int) -> torch.Tensor:
        """The logits ``[b, vocab]`` of the decode step just launched or chained (for a
        sampler queued behind it)."""
        return self.g_logits[:b]

    @torch.inference_mode()
    def decode_emit(self, b: int, tokens: torch.Tensor | None = None) -> tuple[int, int]:
        """The tokens of the step just launched or chained: the graph's argmax, or ``tokens``
        (``b`` ids on the device: the rows' sampler, queued behind the step), which become the
        next step's inputs; their copy to the host is queued. Returns a handle for
        :meth:`decode_result`; nothing waits here."""
        if tokens is not None:
            self.g_tok[:b].copy_(tokens)
        slot = self._next_slot
        self._next_slot ^= 1
        self.h_next[slot, :b].copy_(self.g_tok[:b], non_blocking=True)
        self._next_events[slot].record()
        return slot, b

    def decode_result(self, handle: tuple[int, int]) -> list[int]:
        slot, b = handle
        self._next_events[slot].synchronize()
        return self.h_next[slot, :b].tolist()

    def _locate(self, b: int) -> None:
        """Start of a chained step (inside the graph): each row's slot and length from its
        position and block table, which the host may have grown since the last step."""
        bs = self.block_size
        pos = self.g_pos[:b]
        blk = self.g_tables[:b].gather(1, (pos // bs).unsqueeze(1)).squeeze(1).long()
        self.g_slot[:b].copy_(blk * bs + pos % bs)
        self.g_lens[:b].copy_(pos + 1)

    def _advance(self, b: int) -> None:
        """End of a chained step (inside the graph): next token = argmax; live rows move one
        position on (padding rows stay at position 0 of the scratch block)."""
        self.g_tok[:b].copy_(torch.argmax(self.g_logits[:b], dim=-1))
        self.g_pos[:b].add_(self.g_live[:b])

    def _decode_body(self, b: int, impl: str, width: int | None = None) -> None:
        """One decode step of the first ``b`` rows of the static buffers. ``impl``: ``gemv``
        (b == 1: the batch-1 decoder's fused GEMVs), ``bgemm`` (the small-batch
        Triton projections of :mod:`qwen_trt.fast.kernels.bgemm`) or
        ``torch`` (cuBLAS + PyTorch ops)."""
        cfg, m = self.cfg, self.model
        eps = cfg.rms_eps
        pos, slots = self.g_pos[:b], self.g_slot[:b]
        tables, lens = self.g_tables[:b, :width or self.max_blocks], self.g_lens[:b]
        x = F.embedding(self.g_tok[:b], m.embed)                    # [b, hidden]
        # norms + RoPE + cache write inside the first attention kernel (fast/paged_kernels.py)
        if impl == "gemv":
            from qwen_trt.fast.kernels.gemv import gemv
        elif impl == "bgemm":
            from qwen_trt.fast.kernels.bgemm import bgemm, rms_rows
        for i, layer in enumerate(m.layers):
            kc, vc = self.cache.kv(i)
            if impl == "gemv":
                qkv = gemv(layer.wqkv, x.view(cfg.hidden), ln=layer.ln_in, eps=eps).view(1, -1)
            elif impl == "bgemm":
                qkv = bgemm(layer.wqkv, rms_rows(x, layer.ln_in, eps))
            else:   # dense: a decode step never runs FP8 weights on tensor cores
                qkv = linear(rms_norm(x, layer.ln_in, eps), dense(layer.wqkv, m.dtype))
            o = paged_rope_decode_attention(qkv, layer.q_norm, layer.k_norm, m.cos, m.sin,
                                            pos, slots, kc, vc, tables, lens,
                                            self.block_size, eps, cfg.heads)
            if impl == "gemv":
                xv = gemv(layer.wo, o.view(cfg.q_size), residual=x.view(cfg.hidden))
                act = gemv(layer.w_gate_up, xv, ln=layer.ln_post, eps=eps, gate_up=True)
                x = gemv(layer.w_down, act, residual=xv).view(1, cfg.hidden)
            elif impl == "bgemm":
                x = bgemm(layer.wo, o.view(b, cfg.q_size), residual=x)
                act = bgemm(layer.w_gate_up, rms_rows(x, layer.ln_post, eps), gate_up=True)
                x = bgemm(layer.w_down, act, residual=x)
            else:
                x = x + linear(o.view(b, cfg.q_size), dense(layer.wo, m.dtype))
                x = mlp(cfg, x, layer.ln_post, dense(layer.w_gate_up, m.dtype),
                        dense(layer.w_down, m.dtype))
        if impl == "gemv":
            logits = gemv(m._head(), x.view(cfg.hidden), ln=m.ln_final, eps=eps).view(1, -1)
        elif impl == "bgemm":
            logits = bgemm(m._head(), rms_rows(x, m.ln_final, eps))
        else:
            logits = self._head(x)
        self.g_logits[:b].copy_(logits)

    def _impls(self, bucket: int) -> tuple[str, ...]:
        if not self.triton:
            return ("torch",)
        if bucket == 1:
            return ("gemv",) if self.gemv1 else ("torch",)
        # A GEMV-form kernel (products in registers, no tensor-core padding of M) measured slower
        # than bgemm at 2/4/8 rows on the H200 (3.63/5.31/9.07 vs 3.50/3.69/3.80 ms per step)
        # and was removed.
        return ("bgemm", "torch")

    def _capture(self, bucket: int, impl: str, feedback: bool = False,
                 width: int | None = None) -> torch.cuda.CUDAGraph:
        """A decode graph of ``bucket`` rows whose attention reads ``width`` blocks of each
        row's table (default: all); ``feedback``: the chained form (:meth:`decode_launch`)."""
        def reset() -> None:   # padded rows only: scratch block, length 1
            self.g_live[:bucket].zero_()
            self.g_tok[:bucket].zero_()
            self.g_pos[:bucket].zero_()
            self.g_slot[:bucket].fill_(SCRATCH_BLOCK * self.block_size)
            self.g_lens[:bucket].fill_(1)
            self.g_tables[:bucket].zero_()

        def body() -> None:
            if feedback:
                self._locate(bucket)
            self._decode_body(bucket, impl, width)
            if feedback:
                self._advance(bucket)

        if self._warmed:
            self.stats.late_captures += 1
        saved = [self.g_meta.clone(), self.g_i32.clone()]
        graph = capture(body, reset, self._pool)
        self.g_meta.copy_(saved[0])
        self.g_i32.copy_(saved[1])
        return graph

    def _fgraph(self, bucket: int, width: int) -> torch.cuda.CUDAGraph:
        """The chained decode graph of ``bucket`` at ``width`` (captured on first use)."""
        graph = self._fgraphs.get((bucket, width))
        if graph is None:
            graph = self._fgraphs[(bucket, width)] = self._capture(
                bucket, self.stats.bucket_impl[bucket], feedback=True, width=width)
        return graph

    def _graph(self, bucket: int, width: int | None = None) -> torch.cuda.CUDAGraph:
        """The decode graph of ``bucket`` at ``width`` (default: the widest). The first of a
        bucket picks its projections by timing (at that width); the others reuse the pick."""
        width = width or self.widths[-1]
        graph = self._graphs.get((bucket, width))
        if graph is None and bucket in self.stats.bucket_impl:
            graph = self._capture(bucket, self.stats.bucket_impl[bucket], width=width)
            self._graphs[(bucket, width)] = graph
        if graph is None:
            impls = self._impls(bucket)
            cache = compile_cache.active()
            known = (cache.pick("bucket_impl", bucket, impls) if cache is not None
                     and len(impls) > 1 else None)
            if known is not None:               # timed by an earlier start: capture it alone
                impls = (known,)
            if len(impls) == 1:
                best, graph = impls[0], self._capture(bucket, impls[0], width=width)
            else:   # keep the faster of the Triton and cuBLAS projections for this bucket
                timed = {}
                for impl in impls:
                    try:
                        g = self._capture(bucket, impl, width=width)
                    except Exception as e:  # noqa: BLE001 - a kernel that fails to build
                        self.stats.notes.append(f"bucket {bucket} {impl}: {type(e).__name__}: "
                                                + first_line(e, 200))
                        continue
                    timed[impl] = (replay_ms(g, 10, warmup=1), g)
                best = min(timed, key=lambda k: timed[k][0])
                graph = timed[best][1]
                self.stats.bucket_ms[bucket] = {k: round(v[0], 4) for k, v in timed.items()}
                if cache is not None and len(timed) > 1:
                    cache.remember("bucket_impl", bucket, best)
            self.stats.bucket_impl[bucket] = best
            self._graphs[(bucket, width)] = graph
        return graph

    def _check_step(self, graph: bool) -> str | None:
        """A mixed step (a decode row of one sequence beside a chunk after a prefix of another)
        through the varlen path (a graph replay, or eagerly) and through the math path: None
        if the logits agree, else a one-line reason."""
        bs = self.block_size
        n_blocks = min(8, (self.cache.num_blocks - 1) // 2)
        if n_blocks < 2:
            return None
        pad = (SCRATCH_BLOCK,) * (self.max_blocks - n_blocks)
        ta = tuple(range(1, n_blocks + 1)) + pad
        tb = tuple(range(n_blocks + 1, 2 * n_blocks + 1)) + pad
        total = min(n_blocks * bs, 200)
        g = torch.Generator().manual_seed(0)
        toks = torch.randint(1, self.cfg.vocab_size, (2, total), generator=g).tolist()
        first = total // 2
        for seq, table in zip(toks, (ta, tb)):    # prefixes, written by the math path
            self._forward_math(seq[:first], list(range(first)),
                               [SeqChunk(0, first, first, table)], [first - 1])
        rest = total - first
        args = ([toks[0][first]] + toks[1][first:], [first] + list(range(first, total)),
                [SeqChunk(0, 1, first + 1, ta), SeqChunk(1, rest, total, tb)], [0, rest])
        ref = self._forward_math(*args).float()
        saved, self.step_graphs = self.step_graphs, graph and self.step_graphs
        try:
            got = self.forward(*args).float()
        finally:
            self.step_graphs = saved
        err = ((got - ref).norm() / ref.norm()).item()
        tol = 1e-3 if self.model.dtype == torch.float32 else 1e-1
        if not err < tol:
            what = "step graphs" if graph else "the varlen attention step"
            return f"{what} differ from the math step ({err:.2e})"
        return None

    def _pick_varlen_tile(self) -> None:
        """Per token bucket ``T``, time the varlen attention's tile shapes on a chunk of ``T``
        rows after a 1536-token prefix (a later turn of a long chat, or the second step of a
        long prompt) and keep the fastest: small chunks over long contexts want more, smaller
        tiles; large chunks fewer, larger ones."""
        cfg, bs, dev = self.cfg, self.block_size, self.device
        kc, vc = self.cache.kv(0)
        i32 = lambda v: torch.tensor(v, dtype=torch.int32, device=dev)  # noqa: E731
        cache = compile_cache.active()
        for n in STEP_TOKEN_BUCKETS:
            ctx = n + 1536
            if self.cache.num_blocks <= -(-ctx // bs) or self.max_blocks < -(-ctx // bs):
                continue
            known = cache.pick("varlen_tile", n, VARLEN_TILES) if cache is not None else None
            if known is not None:
                self.varlen_tile[n] = known             # timed by an earlier start
                continue
            q = torch.randn(n, cfg.heads, cfg.head_dim, dtype=kc.dtype, device=dev)
            tables = torch.zeros(1, self.max_blocks, dtype=torch.int32, device=dev)
            k = -(-ctx // bs)
            tables[0, :k] = torch.arange(1, k + 1, dtype=torch.int32, device=dev)
            timed = {}
            for block_q, warps in VARLEN_TILES:
                ts, tq = varlen_tiles([n], block_q)
                args = (q, kc, vc, tables, i32([ctx]), i32([0]), i32([n]), i32(ts), i32(tq), bs,
                        block_q, warps)
                try:
                    paged_varlen_attention(*args)
                    a = torch.cuda.Event(enable_timing=True)
                    b = torch.cuda.Event(enable_timing=True)
                    a.record()
                    for _ in range(5):
                        paged_varlen_attention(*args)
                    b.record()
                    b.synchronize()
                    timed[(block_q, warps)] = a.elapsed_time(b) / 5
                except Exception as e:  # noqa: BLE001 - a shape that does not build here
                    self.stats.notes.append(f"varlen tile {block_q}x{warps}: "
                                            f"{type(e).__name__}"[:200])
            if timed:
                self.varlen_tile[n] = min(timed, key=timed.get)
                if cache is not None:
                    cache.remember("varlen_tile", n, list(self.varlen_tile[n]))
                self.stats.varlen_ms[n] = {f"{k[0]}x{k[1]}": round(v, 4)
                                           for k, v in timed.items()}

    def _check_varlen(self, force: bool = False) -> bool:
        """The eager varlen step against the math step; a compile failure of the fused
        pieces falls back to the PyTorch ops, any other failure to the math step. Skipped
        (False returned, else True) when the warm compile cache recorded it passing, unless
        ``force``: the fused pieces then compile at the step graphs' warm-up runs."""
        if not force and compile_cache.may_skip("varlen_step"):
            return False
        for attempt in (0, 1):
            try:
                problem = self._check_step(graph=False)
            except Exception as e:  # noqa: BLE001 - a kernel or compile that fails to build
                problem = f"varlen step unavailable: {type(e).__name__}: {e}"
                if attempt == 0 and self._pre is not _pre_attention:
                    self.stats.notes.append(("compiled step pieces: " + problem)
                                            .splitlines()[0][:300] + "; using PyTorch ops")
                    self._pre, self._post = _pre_attention, _post_attention
                    continue
            # a pass after the fused pieces fell back is not one to skip on the next start
            compile_cache.record_check("varlen_step", problem or (
                "compiled step pieces fell back" if attempt else None))
            if problem:
                self.varlen = self.step_graphs = False
                self.stats.notes.append(problem.splitlines()[0][:300] + "; using the math "
                                        "attention for steps that prefill")
            return True
        return True

    def warmup(self) -> BatchedStats:
        """Check the varlen step, capture every decode bucket's graphs and every token
        bucket's step graph (load time, not the first request)."""
        t = time.perf_counter()
        phases = self.stats.phases_s
        mark = [t]

        def done(name: str) -> None:
            now = time.perf_counter()
            phases[name] = round(now - mark[0], 2)
            mark[0] = now

        with torch.inference_mode():
            if self.varlen and self.graphs:
                self._pick_varlen_tile()
                done("varlen_tiles")
            varlen_checked = True
            if self.varlen:
                varlen_checked = self._check_varlen()
                done("varlen_check_and_compile")
            if self.graphs:
                # the plain graphs serve the decode steps that do not chain (QWEN_TRT_CHAIN=0,
                # a speculative row about to draft): every width now, not at the first such
                # step of a long request (a capture beside live requests: an ITL spike)
                for b in self.buckets:
                    for w in self.widths:
                        self._graph(b, w)
                    for w in self.widths:
                        self._fgraph(b, w)
                done("decode_graphs")
                if self.varlen:
                    try:
                        for tb in self.t_buckets:
                            self._step_graph(tb)
                        problem = compile_cache.run_check(
                            "step_graphs", lambda: self._check_step(graph=True))
                    except Exception as e:  # noqa: BLE001 - the eager step still works
                        problem = f"step graphs unavailable: {type(e).__name__}: {e}"
                        compile_cache.record_check("step_graphs", problem)
                    if problem:
                        self.step_graphs = False
                        self._s_graphs.clear()
                        self.stats.notes.append(problem.splitlines()[0][:300]
                                                + "; steps that prefill run eagerly")
                        if not varlen_checked:    # skipped on the cache's word: check now
                            self._check_varlen(force=True)
                    self.stats.step_graphs = len(self._s_graphs)
                    done("step_graphs")
                torch.cuda.synchronize()
        self.stats.warmup_s = time.perf_counter() - t
        self._warmed = True
        return self.stats
