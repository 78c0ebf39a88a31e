"""The batched forward of the fast path: many sequences per step over a paged KV cache.

One step takes a flat batch of rows: decode rows (one token of a running sequence) first, then
prefill chunks (several prompt tokens of one sequence, starting anywhere: after a prefix-cache
hit or an earlier chunk). Every row is projected together (one matrix product per weight,
``M = rows``); attention runs per sequence over its own tokens through its block table:

* decode rows: :func:`~qwen_trt.fast.paged_kernels.paged_decode_attention` (Triton, CUDA) or
  the math reference (CPU);
* prefill chunks: SDPA over the chunk's queries and the sequence's keys so far (a causal mask
  offset by the chunk's start).

On CUDA a step of decode rows only replays a CUDA graph captured per batch-size bucket
(1, 2, 4, 8, 16, 32; the batch is padded up, padded rows write the scratch block). Bucket 1
keeps the batch-1 decoder's fused Triton GEMVs (``model.decode_impl == "triton"``); larger
buckets use cuBLAS through ``F.linear`` (one weight read for all rows). Token choice runs on the
device after the step, per row, with each row's own settings, by the one sampler of both torch
paths (:mod:`qwen_trt.backends.sampling`, driven by the runner); greedy decode steps pick their
argmax inside the graph and chain (:meth:`BatchedModel.decode_launch`).

The weights are the :class:`~qwen_trt.fast.model.Qwen3Fast` ones; its static batch-1 cache is
not used (``make_batched`` shrinks it).
"""
from __future__ import annotations

import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import numpy as np
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from qwen_trt.fast.kv_cache import LayerKVCache
from qwen_trt.fast.model import Qwen3Fast, mlp, rms_norm, split_norm_rope
from qwen_trt.fast.paged_kernels import (paged_attention_ref, paged_decode_attention,
                                         paged_rope_cache, triton)
from qwen_trt.serving.kv_blocks import DEFAULT_BLOCK_SIZE, SCRATCH_BLOCK

GRAPH_BUCKETS = (1, 2, 4, 8, 16, 32)
PREFILL_N_BUCKETS = (16, 32, 64, 128, 256, 512, 1024)      # rows of a one-sequence chunk
PREFILL_CTX_BUCKETS = (1024, 2048, 4096)                    # captured at warm-up; larger lazily
_SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def _pre_attention(x: torch.Tensor, ln: torch.Tensor, w: torch.Tensor, eps: float):
    """RMSNorm + fused q/k/v projection of every row."""
    return F.linear(rms_norm(x, ln, eps), w)


def _post_attention(x: torch.Tensor, o: torch.Tensor, wo: torch.Tensor, ln: torch.Tensor,
                    w_gate_up: torch.Tensor, w_down: torch.Tensor, eps: float):
    """o projection + residual, then the MLP block (the model's :func:`mlp`)."""
    x = x + F.linear(o, wo)
    gate, up = F.linear(rms_norm(x, ln, eps), w_gate_up).chunk(2, dim=-1)
    return x + F.linear(F.silu(gate) * up, w_down)


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


@dataclass
class BatchedStats:
    graphs: bool = False
    gemv_bucket1: bool = False
    attention: str = "math"
    buckets: tuple[int, ...] = ()
    warmup_s: float = 0.0
    prefill_graphs: int = 0
    bucket_impl: dict[int, str] = field(default_factory=dict)   # gemv | bgemm | torch
    bucket_ms: dict[int, dict[str, float]] = field(default_factory=dict)  # replay ms, warm-up
    notes: list[str] = field(default_factory=list)


class BatchedModel:
    """Steps of many sequences over a :class:`PagedKVCache` with the weights of ``model``."""

    def __init__(self, model: Qwen3Fast, *, num_blocks: int, block_size: int = DEFAULT_BLOCK_SIZE,
                 max_seq_len: int | None = None, graphs: bool | None = None,
                 buckets: Sequence[int] = GRAPH_BUCKETS) -> None:
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
        # The paged Triton kernels need what the batch-1 attention self-check established.
        self.triton = (on_cuda and triton is not None and model.attn_impl == "triton"
                       and block_size >= 16 and block_size & (block_size - 1) == 0)
        self.gemv1 = self.triton and model.decode_impl == "triton"
        self.graphs = bool(on_cuda and self.triton and (graphs is None or graphs))
        self.buckets = tuple(sorted(buckets))
        self.stats.graphs, self.stats.gemv_bucket1 = self.graphs, self.gemv1
        self.stats.attention = "triton" if self.triton else "math"
        self.stats.buckets = self.buckets if self.graphs else ()
        # Steps with prefill run eagerly; on CUDA the parts around attention are compiled once
        # (dynamic row count) so a 1k-token step is not bound by ~1000 kernel launches.
        # Opt-in (QWEN_TRT_BATCH_COMPILE=1): on the H200 it did not lower the 512-token TTFT
        # (35.5 vs 25.3 ms eager, 2026-11-30), so the default stays eager.
        self.compiled = (on_cuda and (graphs is None or graphs)
                         and os.environ.get("QWEN_TRT_BATCH_COMPILE", "0") == "1")
        if self.compiled:
            self._pre = torch.compile(_pre_attention, dynamic=True, fullgraph=True)
            self._post = torch.compile(_post_attention, dynamic=True, fullgraph=True)
        else:
            self._pre, self._post = _pre_attention, _post_attention
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
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
            self._fgraphs: dict[int, torch.cuda.CUDAGraph] = {}
            self.h_meta_np = self.h_meta.numpy()
            self.h_i32 = torch.zeros(n * (1 + self.max_blocks), dtype=torch.int32,
                                     pin_memory=True)
            self.h_lens_np = self.h_i32[:n].numpy()
            self.h_tables_np = self.h_i32[n:].view(n, self.max_blocks).numpy()
            # Prefill graphs: one sequence's chunk (n <= PREFILL_GRAPH_MAX rows, padded to a
            # power of two) over a context padded to a power of two >= 1024 (<= the cache).
            cap = self.max_blocks * block_size
            self.p_n_buckets = tuple(b for b in PREFILL_N_BUCKETS)
            self.p_ctx_buckets = tuple(sorted({min(cap, c) for c in PREFILL_CTX_BUCKETS
                                               if c <= cap} | {cap}))
            self.p_meta = torch.zeros(3, PREFILL_N_BUCKETS[-1], dtype=torch.long, device=dev)
            self.p_ctx_slots = torch.zeros(cap, dtype=torch.long, device=dev)
            self.p_last = torch.zeros(1, dtype=torch.long, device=dev)
            self.p_keys = torch.arange(cap, device=dev)
            self.p_logits = torch.zeros(1, self.cfg.vocab_size, dtype=model.dtype, device=dev)
            self.h_p_meta = torch.zeros(3, PREFILL_N_BUCKETS[-1], dtype=torch.long,
                                        pin_memory=True)
            self.h_p_ctx = torch.zeros(cap + 1, dtype=torch.long, pin_memory=True)
            self._p_graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
            self.prefill_graphs = True

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

    # ---- the general (eager) step: decode rows and prefill chunks together ----------------
    @torch.inference_mode()
    def forward(self, tokens: Sequence[int], positions: Sequence[int],
                chunks: Sequence[SeqChunk], logit_rows: Sequence[int]) -> torch.Tensor:
        """Rows ``tokens``/``positions`` grouped by ``chunks`` (decode chunks, ``n == 1``,
        first); writes every row's K/V and returns the logits ``[len(logit_rows), vocab]``."""
        cfg, m, dev = self.cfg, self.model, self.device
        tok = torch.tensor(list(tokens), dtype=torch.long, device=dev)
        pos = torch.tensor(list(positions), dtype=torch.long, device=dev)
        slots = torch.tensor([self.slot_of(c.table, p) for c in chunks
                              for p in positions[c.start:c.start + c.n]], dtype=torch.long,
                             device=dev)
        n_dec = 0
        while n_dec < len(chunks) and chunks[n_dec].n == 1 and chunks[n_dec].start == n_dec:
            n_dec += 1
        use_kernel = self.triton and n_dec > 0
        dec_tables = dec_lens = None
        if use_kernel:
            dec_tables = self._tables_tensor([c.table for c in chunks[:n_dec]])
            dec_lens = torch.tensor([c.ctx for c in chunks[:n_dec]], dtype=torch.int32,
                                    device=dev)
        rest = chunks[n_dec:] if use_kernel else chunks
        ctx_slots = [self._slots_tensor(c.table, c.ctx) for c in rest]
        x = F.embedding(tok, m.embed)
        for i, layer in enumerate(m.layers):
            kc, vc = self.cache.kv(i)
            qkv = self._pre(x, layer.ln_in, layer.wqkv, cfg.rms_eps)
            if self.triton:
                q = paged_rope_cache(qkv, layer.q_norm, layer.k_norm, m.cos, m.sin, pos, slots,
                                     kc, vc, cfg.rms_eps, cfg.heads)
            else:
                q, k, v = split_norm_rope(qkv, pos, m.cos, m.sin, layer.q_norm, layer.k_norm,
                                          cfg.heads, cfg.kv_heads, cfg.head_dim, cfg.rms_eps)
                kc.index_copy_(1, slots, k.transpose(0, 1))
                vc.index_copy_(1, slots, v.transpose(0, 1))
            o = torch.empty_like(q)
            if use_kernel:
                o[:n_dec] = paged_decode_attention(q[:n_dec], kc, vc, dec_tables, dec_lens,
                                                   self.block_size)
            for c, cs in zip(rest, ctx_slots):
                qs = q[c.start:c.start + c.n]
                o[c.start:c.start + c.n] = self._attend_chunk(qs, kc, vc, cs, c)
            x = self._post(x, o.reshape(-1, cfg.q_size), layer.wo, layer.ln_post,
                           layer.w_gate_up, layer.w_down, cfg.rms_eps)
        rows = torch.tensor(list(logit_rows), dtype=torch.long, device=dev)
        return self._head(x.index_select(0, rows))

    def _attend_chunk(self, q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor,
                      ctx_slots: torch.Tensor, c: SeqChunk) -> torch.Tensor:
        q_pos = torch.arange(c.ctx - c.n, c.ctx, device=q.device)
        if self.device.type != "cuda" or c.n == 1:
            return paged_attention_ref(q, kc, vc, ctx_slots, q_pos)
        # CUDA prefill: SDPA (flash / memory-efficient kernels) with the offset causal mask.
        cfg = self.cfg
        k = kc.index_select(1, ctx_slots).unsqueeze(0)              # [1, kvh, ctx, d]
        v = vc.index_select(1, ctx_slots).unsqueeze(0)
        group = cfg.heads // cfg.kv_heads
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
        # Not cuDNN's SDPA: it builds a plan per new shape (hundreds of ms the first time a
        # chunk length appears, seen on the H200), and chunk shapes vary every step.
        with sdpa_kernel(_SDPA_BACKENDS):
            if c.n == c.ctx:
                o = F.scaled_dot_product_attention(q.transpose(0, 1).unsqueeze(0), k, v,
                                                   is_causal=True)
            else:
                mask = torch.arange(c.ctx, device=q.device)[None, :] <= q_pos[:, None]
                o = F.scaled_dot_product_attention(q.transpose(0, 1).unsqueeze(0), k, v,
                                                   attn_mask=mask)
        return o.squeeze(0).transpose(0, 1)

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
        self._graph(bucket).replay()
        return self.g_logits[:b]

    # ---- chained greedy decode: the step picks its tokens and advances on the device -------
    def can_chain(self, b: int) -> bool:
        """Whether a greedy decode step of ``b`` rows may use :meth:`decode_launch` (CUDA
        graphs; ``QWEN_TRT_CHAIN=0`` turns it off)."""
        return (self.graphs and b <= self.buckets[-1]
                and os.environ.get("QWEN_TRT_CHAIN", "1") != "0")

    @torch.inference_mode()
    def decode_launch(self, tokens: Sequence[int], positions: Sequence[int],
                      tables: Sequence[Sequence[int]]) -> tuple[int, int]:
        """Like :meth:`decode` for greedy rows, but the graph also takes each row's argmax as
        its next input token and advances its position, length and slot on the device, so
        :meth:`decode_chain` can launch the next step before the host has seen these tokens.
        Returns a handle for :meth:`decode_result`; nothing waits here."""
        b = len(tokens)
        bucket = next(x for x in self.buckets if x >= b)
        if self._graphs.get(bucket) is None:
            self._graph(bucket)
        self.decode_meta(tokens, positions, tables, bucket)
        return self._chain_replay(b, bucket)

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
    def decode_chain(self, b: int, table_rows: dict[int, Sequence[int]]) -> tuple[int, int]:
        """The next step of the batch of the last launch (same rows), its inputs already on
        the device; ``table_rows`` are rows whose block table grew (uploaded first)."""
        bucket = next(x for x in self.buckets if x >= b)
        for row, table in table_rows.items():   # pinned + async: no wait on the step in flight
            src = torch.tensor(table, dtype=torch.int32).pin_memory()
            self.g_tables[row, :len(table)].copy_(src, non_blocking=True)
        return self._chain_replay(b, bucket)

    def _chain_replay(self, b: int, bucket: int) -> tuple[int, int]:
        graph = self._fgraphs.get(bucket)
        if graph is None:
            graph = self._fgraphs[bucket] = self._capture(
                bucket, self.stats.bucket_impl[bucket], feedback=True)
        graph.replay()
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

    def _decode_body(self, b: int, impl: str) -> None:
        """One decode step of the first ``b`` rows of the static buffers. ``impl``: ``gemv``
        (b == 1: the batch-1 decoder's fused GEMVs), ``bgemm`` (the small-batch
        Triton projections of :mod:`qwen_trt.fast.bgemm`) or
        ``torch`` (cuBLAS + PyTorch ops)."""
        cfg, m = self.cfg, self.model
        eps = cfg.rms_eps
        pos, slots = self.g_pos[:b], self.g_slot[:b]
        tables, lens = self.g_tables[:b], self.g_lens[:b]
        x = F.embedding(self.g_tok[:b], m.embed)                    # [b, hidden]
        if impl == "gemv":
            from qwen_trt.fast.gemv import gemv
        elif impl == "bgemm":
            from qwen_trt.fast.bgemm import bgemm, rms_rows
        for i, layer in enumerate(m.layers):
            kc, vc = self.cache.kv(i)
            if impl == "gemv":
                qkv = gemv(layer.wqkv, x.view(cfg.hidden), ln=layer.ln_in, eps=eps).view(1, -1)
            elif impl == "bgemm":
                qkv = bgemm(layer.wqkv, rms_rows(x, layer.ln_in, eps))
            else:
                qkv = F.linear(rms_norm(x, layer.ln_in, eps), layer.wqkv)
            q = paged_rope_cache(qkv, layer.q_norm, layer.k_norm, m.cos, m.sin, pos, slots,
                                 kc, vc, eps, cfg.heads)
            o = paged_decode_attention(q, kc, vc, tables, lens, self.block_size)
            if impl == "gemv":
                xv = gemv(layer.wo, o.view(cfg.q_size), residual=x.view(cfg.hidden))
                act = gemv(layer.w_gate_up, xv, ln=layer.ln_post, eps=eps, gate_up=True)
                x = gemv(layer.w_down, act, residual=xv).view(1, cfg.hidden)
            elif impl == "bgemm":
                x = bgemm(layer.wo, o.view(b, cfg.q_size), residual=x)
                act = bgemm(layer.w_gate_up, rms_rows(x, layer.ln_post, eps), gate_up=True)
                x = bgemm(layer.w_down, act, residual=x)
            else:
                x = x + F.linear(o.view(b, cfg.q_size), layer.wo)
                x = mlp(cfg, x, layer.ln_post, layer.w_gate_up, layer.w_down)
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

    def _capture(self, bucket: int, impl: str, feedback: bool = False) -> torch.cuda.CUDAGraph:
        def reset() -> None:   # padded rows only: scratch block, length 1
            self.g_live[:bucket].zero_()
            self.g_tok[:bucket].zero_()
            self.g_pos[:bucket].zero_()
            self.g_slot[:bucket].fill_(SCRATCH_BLOCK * self.block_size)
            self.g_lens[:bucket].fill_(1)
            self.g_tables[:bucket].zero_()

        saved = [self.g_meta.clone(), self.g_i32.clone()]
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                reset()
                if feedback:
                    self._locate(bucket)
                self._decode_body(bucket, impl)
                if feedback:
                    self._advance(bucket)
        torch.cuda.current_stream().wait_stream(stream)
        reset()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            if feedback:
                self._locate(bucket)
            self._decode_body(bucket, impl)
            if feedback:
                self._advance(bucket)
        self.g_meta.copy_(saved[0])
        self.g_i32.copy_(saved[1])
        return graph

    def _graph(self, bucket: int) -> torch.cuda.CUDAGraph:
        graph = self._graphs.get(bucket)
        if graph is None:
            impls = self._impls(bucket)
            if len(impls) == 1:
                best, graph = impls[0], self._capture(bucket, impls[0])
            else:   # keep the faster of the Triton and cuBLAS projections for this bucket
                timed = {}
                for impl in impls:
                    try:
                        g = self._capture(bucket, impl)
                    except Exception as e:  # noqa: BLE001 - a kernel that fails to build
                        self.stats.notes.append(f"bucket {bucket} {impl}: {type(e).__name__}: "
                                                f"{e}".splitlines()[0][:200])
                        continue
                    timed[impl] = (self._time_replay(g), g)
                best = min(timed, key=lambda k: timed[k][0])
                graph = timed[best][1]
                self.stats.bucket_ms[bucket] = {k: round(v[0], 4) for k, v in timed.items()}
            self.stats.bucket_impl[bucket] = best
            self._graphs[bucket] = graph
        return graph

    @staticmethod
    def _time_replay(graph: torch.cuda.CUDAGraph, n: int = 10) -> float:
        graph.replay()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(n):
            graph.replay()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / n

    # ---- one-sequence prefill chunks: CUDA graphs per (rows, context) bucket -------------
    def prefill_one(self, tokens: Sequence[int], start: int, table: Sequence[int]
                    ) -> torch.Tensor | None:
        """A step that is one chunk of one sequence (tokens at positions ``start ..``): a
        graph replay; returns the last row's logits ``[1, vocab]``, or None when no graph
        fits (the caller runs :meth:`forward`)."""
        n = len(tokens)
        ctx = start + n
        if not (self.graphs and self.prefill_graphs) or n > self.p_n_buckets[-1]:
            return None
        nb = next(b for b in self.p_n_buckets if b >= n)
        cb = next((c for c in self.p_ctx_buckets if c >= max(ctx, nb)), None)
        if cb is None:
            return None
        bs = self.block_size
        meta = self.h_p_meta.numpy()
        meta[:, :nb] = 0
        meta[0, :n] = tokens
        pos = np.arange(start, ctx, dtype=np.int64)
        meta[1, :n] = pos
        tab = np.asarray(table, dtype=np.int64)
        meta[2, :n] = tab[pos // bs] * bs + pos % bs
        meta[2, n:nb] = SCRATCH_BLOCK * bs
        hc = self.h_p_ctx.numpy()
        allpos = np.arange(ctx, dtype=np.int64)
        hc[:ctx] = tab[allpos // bs] * bs + allpos % bs
        hc[ctx:cb] = SCRATCH_BLOCK * bs
        hc[cb] = n - 1                                   # the row whose logits are kept
        self.p_meta[:, :nb].copy_(self.h_p_meta[:, :nb], non_blocking=True)
        self.p_ctx_slots[:cb].copy_(self.h_p_ctx[:cb], non_blocking=True)
        self.p_last.copy_(self.h_p_ctx[cb:cb + 1], non_blocking=True)
        self._prefill_graph(nb, cb).replay()
        return self.p_logits

    def _prefill_body(self, nb: int, cb: int) -> None:
        cfg, m = self.cfg, self.model
        eps = cfg.rms_eps
        tok, pos, slots = self.p_meta[0, :nb], self.p_meta[1, :nb], self.p_meta[2, :nb]
        ctx_slots = self.p_ctx_slots[:cb]
        mask = self.p_keys[:cb][None, :] <= pos[:, None]            # causal, by position
        group = cfg.heads // cfg.kv_heads
        x = F.embedding(tok, m.embed)
        for i, layer in enumerate(m.layers):
            kc, vc = self.cache.kv(i)
            qkv = _pre_attention(x, layer.ln_in, layer.wqkv, eps)
            q = paged_rope_cache(qkv, layer.q_norm, layer.k_norm, m.cos, m.sin, pos, slots,
                                 kc, vc, eps, cfg.heads)
            k = kc.index_select(1, ctx_slots).unsqueeze(0).repeat_interleave(group, dim=1)
            v = vc.index_select(1, ctx_slots).unsqueeze(0).repeat_interleave(group, dim=1)
            with sdpa_kernel(_SDPA_BACKENDS):
                o = F.scaled_dot_product_attention(q.transpose(0, 1).unsqueeze(0), k, v,
                                                   attn_mask=mask)
            o = o.squeeze(0).transpose(0, 1).reshape(nb, cfg.q_size)
            x = _post_attention(x, o, layer.wo, layer.ln_post, layer.w_gate_up, layer.w_down,
                                eps)
        self.p_logits.copy_(self._head(x.index_select(0, self.p_last)))

    def _prefill_graph(self, nb: int, cb: int) -> torch.cuda.CUDAGraph:
        graph = self._p_graphs.get((nb, cb))
        if graph is None:
            def reset() -> None:   # every row: scratch slot, position 0
                self.p_meta.zero_()
                self.p_meta[2].fill_(SCRATCH_BLOCK * self.block_size)
                self.p_ctx_slots.fill_(SCRATCH_BLOCK * self.block_size)
                self.p_last.zero_()

            saved = [self.p_meta.clone(), self.p_ctx_slots.clone(), self.p_last.clone()]
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(2):
                    reset()
                    self._prefill_body(nb, cb)
            torch.cuda.current_stream().wait_stream(stream)
            reset()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool):
                self._prefill_body(nb, cb)
            for t, v in zip((self.p_meta, self.p_ctx_slots, self.p_last), saved):
                t.copy_(v)
            self._p_graphs[(nb, cb)] = graph
        return graph

    def _check_prefill_graphs(self) -> str | None:
        """A chunk with a prefix through the graph and through :meth:`forward`: the same
        logits (else the eager path is used, with a note)."""
        bs = self.block_size
        n_blocks = min(8, self.cache.num_blocks - 1)
        table = tuple(range(1, n_blocks + 1)) + (SCRATCH_BLOCK,) * (self.max_blocks - n_blocks)
        total = min(n_blocks * bs, 200)
        g = torch.Generator().manual_seed(0)
        toks = torch.randint(1, self.cfg.vocab_size, (total,), generator=g).tolist()
        first = total // 2
        self.forward(toks[:first], list(range(first)), [SeqChunk(0, first, first, table)],
                     [first - 1])
        ref = self.forward(toks[first:], list(range(first, total)),
                           [SeqChunk(0, total - first, total, table)],
                           [total - first - 1]).float()
        got = self.prefill_one(toks[first:], first, table).float()
        err = ((got - ref).norm() / ref.norm()).item()
        tol = 1e-3 if self.model.dtype == torch.float32 else 1e-1
        if not err < tol:
            return f"prefill graphs differ from the eager step ({err:.2e}); prefill runs eagerly"
        return None

    def warmup(self) -> BatchedStats:
        """Capture every bucket's decode graph (load time, not the first request)."""
        t = time.perf_counter()
        if self.compiled:   # compile the eager step's pieces for any row count (2+ rows)
            n = self.block_size + 3
            with torch.inference_mode():
                for rows in (1, n, 2 * n):
                    self.forward([1] * rows, list(range(rows)),
                                 [SeqChunk(0, rows, rows, tuple([SCRATCH_BLOCK] * self.max_blocks))],
                                 [rows - 1])
        if self.graphs:
            with torch.inference_mode():
                for b in self.buckets:
                    self._graph(b)
                    self._fgraphs[b] = self._capture(b, self.stats.bucket_impl[b], feedback=True)
                try:
                    for cb in self.p_ctx_buckets:
                        if cb <= PREFILL_CTX_BUCKETS[-1]:
                            for nb in self.p_n_buckets:
                                if nb <= cb:
                                    self._prefill_graph(nb, cb)
                    problem = self._check_prefill_graphs()
                except Exception as e:  # noqa: BLE001 - the eager path still works
                    problem = f"prefill graphs unavailable: {type(e).__name__}: {e}"
                if problem:
                    self.prefill_graphs = False
                    self._p_graphs.clear()
                    self.stats.notes.append(problem.splitlines()[0][:300])
                self.stats.prefill_graphs = len(self._p_graphs)
            torch.cuda.synchronize()
        self.stats.warmup_s = time.perf_counter() - t
        return self.stats


def kv_blocks_for_memory(model: Qwen3Fast, block_size: int, fraction: float = 0.85,
                         cap_tokens: int | None = None) -> int:
    """How many KV blocks fit in ``fraction`` of the free device memory (CUDA), capped at
    ``cap_tokens`` tokens when given (8192 tokens on CPU by default)."""
    per_block = model.cfg.kv_bytes_per_token(model.dtype.itemsize) * block_size
    if model.device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(model.device)
        n = int(free * fraction) // per_block
    else:
        n = (cap_tokens or 8192) // block_size
    if cap_tokens is not None:
        n = min(n, -(-cap_tokens // block_size))
    return max(n, 2)


def check_paged(device, dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int,
                block_size: int, tol: float = 2e-2) -> str | None:
    """The paged Triton attention against the math reference on random data (ragged lengths,
    shuffled blocks); None if they agree, else a one-line reason."""
    try:
        g = torch.Generator(device=device).manual_seed(0)
        nblk = 40
        kc = torch.randn(kv_heads, nblk * block_size, head_dim, generator=g, device=device)
        vc = torch.randn(kv_heads, nblk * block_size, head_dim, generator=g, device=device)
        q = torch.randn(3, heads, head_dim, generator=g, device=device)
        lens = [1, block_size + 3, 9 * block_size + 1]
        tables = torch.zeros(3, 12, dtype=torch.int32, device=device)
        perm = (torch.randperm(nblk - 1, generator=g, device=device) + 1).to(torch.int32)
        at = 0
        for i, n in enumerate(lens):
            k = -(-n // block_size)
            tables[i, :k] = perm[at:at + k]
            at += k
        got = paged_decode_attention(q.to(dtype), kc.to(dtype), vc.to(dtype), tables,
                                     torch.tensor(lens, dtype=torch.int32, device=device),
                                     block_size).float()
        from qwen_trt.fast.paged_kernels import table_slots
        for i, n in enumerate(lens):
            ref = paged_attention_ref(q[i:i + 1], kc, vc, table_slots(tables[i], n, block_size),
                                      torch.tensor([n - 1], device=device))[0]
            err = ((got[i] - ref).norm() / ref.norm()).item()
            if not err < tol:
                return f"paged attention differs from the reference at length {n} ({err:.2e})"
    except Exception as e:  # any compile/launch failure means: the math path
        return f"paged attention kernels unavailable: {type(e).__name__}: {e}".splitlines()[0]
    return None


def make_batched(model: Qwen3Fast, *, num_blocks: int | None = None,
                 block_size: int = DEFAULT_BLOCK_SIZE, kv_tokens: int | None = None,
                 graphs: bool | None = None, warmup: bool = True,
                 checked: bool = False) -> BatchedModel:
    """A :class:`BatchedModel` over ``model``'s weights. ``num_blocks`` (else ``kv_tokens``
    worth, else what fits in free GPU memory). Frees the model's batch-1 static cache.

    On CUDA the Triton kernels are self-checked first (the batch-1 checks of
    :mod:`qwen_trt.fast.decoder` unless a :class:`FastDecoder` already ran them: ``checked``,
    then the paged attention); a failing check falls back to PyTorch ops with a note."""
    from qwen_trt.fast.attention import check_triton, triton_usable
    from qwen_trt.fast.kv_cache import StaticKVCache

    cfg = model.cfg
    notes: list[str] = []
    if model.device.type == "cuda" and not checked:
        model.attn_impl, model.decode_impl = "math", "torch"
        if triton_usable(model.device):
            problem = check_triton(model.device, model.dtype, cfg.kv_heads, cfg.heads,
                                   cfg.head_dim, model.cache.kv(0)[0].shape[1])
            if problem:
                notes.append(problem)
            else:
                model.attn_impl = "triton"
                from qwen_trt.fast.decoder import check_decode_kernels

                problem = check_decode_kernels(model)
                if problem:
                    notes.append(problem + "; bucket 1 uses cuBLAS")
                else:
                    model.decode_impl = "triton"
    if model.device.type == "cuda" and model.attn_impl == "triton":
        problem = check_paged(model.device, model.dtype, cfg.heads, cfg.kv_heads, cfg.head_dim,
                              block_size)
        if problem:
            notes.append(problem + "; using the math attention")
            model.attn_impl, model.decode_impl = "math", "torch"
    model.cache = StaticKVCache(cfg.layers, cfg.kv_heads, cfg.head_dim, 1, model.dtype,
                                model.device)
    if model.device.type == "cuda":
        torch.cuda.empty_cache()
    if num_blocks is None:
        num_blocks = kv_blocks_for_memory(model, block_size, cap_tokens=kv_tokens) + 1
    bm = BatchedModel(model, num_blocks=num_blocks, block_size=block_size, graphs=graphs)
    bm.stats.notes += notes
    for note in notes:
        print(f"qwen-trt batched: {note}", file=sys.stderr)
    if warmup:
        bm.warmup()
    return bm
