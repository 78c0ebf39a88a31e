"""Building the batched model: its KV cache sized from free memory, the paged attention's
self-check, and :func:`make_batched` (the kernel checks, the cache, the warm-up)."""
from __future__ import annotations

import sys
import time

import torch

from qwen_trt.errors import first_line
from qwen_trt.fast import compile_cache
from qwen_trt.fast.kernels.paged_kernels import paged_attention_ref, paged_decode_attention
from qwen_trt.fast.model.kv_cache import DEFAULT_BLOCK_SIZE
from qwen_trt.fast.model.model import Qwen3Fast
from qwen_trt.fast.step.batched import BatchedModel, graph_buckets
from qwen_trt.params import DEFAULT_MAX_BATCH


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
        from qwen_trt.fast.kernels.paged_kernels import table_slots
        for i, n in enumerate(lens):
            ref = paged_attention_ref(q[i:i + 1], kc, vc, table_slots(tables[i], n, block_size),
                                      torch.tensor([n - 1], device=device))[0]
            err = ((got[i] - ref).norm() / ref.norm()).item()
            if not err < tol:
                return f"paged attention differs from the reference at length {n} ({err:.2e})"
    except Exception as e:  # any compile/launch failure means: the math path
        return first_line(f"paged attention kernels unavailable: {type(e).__name__}: {e}")
    return None


def make_batched(model: Qwen3Fast, *, num_blocks: int | None = None,
                 block_size: int = DEFAULT_BLOCK_SIZE, kv_tokens: int | None = None,
                 graphs: bool | None = None, warmup: bool = True,
                 checked: bool = False, max_batch: int = DEFAULT_MAX_BATCH,
                 verify_tokens: int = 0) -> BatchedModel:
    """A :class:`BatchedModel` over ``model``'s weights. ``num_blocks`` (else ``kv_tokens``
    worth, else what fits in free GPU memory). Frees the model's batch-1 static cache.
    ``max_batch``: the most sequences a step holds (the decode graphs' buckets follow it);
    ``verify_tokens``: the most draft tokens a sequence verifies in a step.

    On CUDA the Triton kernels are self-checked first (the batch-1 checks of
    :mod:`qwen_trt.fast.step.decoder` unless a :class:`FastDecoder` already ran them: ``checked``,
    then the paged attention); a failing check falls back to PyTorch ops with a note."""
    from qwen_trt.fast.model.kv_cache import StaticKVCache

    cfg = model.cfg
    notes: list[str] = []
    t0 = time.perf_counter()
    run_check = compile_cache.run_check     # skipped when the warm cache recorded a pass
    if model.device.type == "cuda" and not checked:
        from qwen_trt.fast.step.checks import choose_kernels

        notes += choose_kernels(model).notes
    if model.device.type == "cuda" and model.attn_impl == "triton":
        problem = run_check("paged_attention", lambda: check_paged(
            model.device, model.dtype, cfg.heads, cfg.kv_heads, cfg.head_dim, block_size))
        if problem:
            notes.append(problem + "; using the math attention")
            model.attn_impl, model.decode_impl = "math", "torch"
    model.cache = StaticKVCache(cfg.layers, cfg.kv_heads, cfg.head_dim, 1, model.dtype,
                                model.device)
    if model.device.type == "cuda":
        torch.cuda.empty_cache()
    if num_blocks is None:
        num_blocks = kv_blocks_for_memory(model, block_size, cap_tokens=kv_tokens) + 1
    bm = BatchedModel(model, num_blocks=num_blocks, block_size=block_size, graphs=graphs,
                      buckets=graph_buckets(max_batch), verify_tokens=verify_tokens)
    bm.stats.phases_s["checks_and_cache"] = round(time.perf_counter() - t0, 2)
    bm.stats.notes += notes
    for note in notes:
        print(f"qwen-trt batched: {note}", file=sys.stderr)
    if warmup:
        bm.warmup()
    return bm
