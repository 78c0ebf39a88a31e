"""Static, preallocated KV cache: one K and one V buffer per layer, written in place.

Layout per layer: ``[kv_heads, max_seq_len, head_dim]`` (batch 1). Positions past the current
one may hold stale values from an earlier request or from padded prefill; attention masks them,
so the cache is never cleared between requests.
"""
from __future__ import annotations

import torch

# The paged layout (qwen_trt.fast.step.batched): tokens per KV block, and the block every padded row
# writes to (never handed to a sequence).
DEFAULT_BLOCK_SIZE = 32
SCRATCH_BLOCK = 0


class LayerKVCache(torch.nn.Module):
    """One K and one V buffer of ``shape`` per layer (buffers ``k{i}``/``v{i}``, not saved);
    the static cache here and the paged one (:class:`qwen_trt.fast.step.batched.PagedKVCache`)."""

    def __init__(self, layers: int, shape: tuple[int, ...], dtype: torch.dtype,
                 device: torch.device | str) -> None:
        super().__init__()
        self.layers = layers
        for i in range(layers):
            self.register_buffer(f"k{i}", torch.zeros(shape, dtype=dtype, device=device),
                                 persistent=False)
            self.register_buffer(f"v{i}", torch.zeros(shape, dtype=dtype, device=device),
                                 persistent=False)

    def kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return getattr(self, f"k{layer}"), getattr(self, f"v{layer}")

    @property
    def nbytes(self) -> int:
        k, v = self.kv(0)
        return self.layers * (k.numel() + v.numel()) * k.element_size()


class StaticKVCache(LayerKVCache):
    def __init__(self, layers: int, kv_heads: int, head_dim: int, max_seq_len: int,
                 dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__(layers, (kv_heads, max_seq_len, head_dim), dtype, device)
        self.max_seq_len = max_seq_len
