"""Compact Qwen3 decoder for batch-1 generation (the fast path's model code).

Same math as transformers' ``Qwen3ForCausalLM`` with the weights rearranged for speed: the q/k/v
projections are one matrix, gate/up are one matrix, and the KV cache is static. Two entry points:

* :meth:`Qwen3Fast.prefill` runs a prompt that starts at position 0 (causal SDPA over the prompt
  itself) and fills the cache; it returns the logits of one chosen position.
* :meth:`Qwen3Fast.decode` runs one token at position ``pos`` against the cache slots
  ``<= pos`` (:mod:`qwen_trt.fast.kernels.attention`: a Triton flash-decoding kernel on CUDA, masked
  matmuls over a KV-length bucket elsewhere).

Both take device tensors for positions, so they can be compiled and captured as CUDA graphs.
Numerics follow HF: RMSNorm in float32 then cast, rotary tables in float32 cast to the model
dtype, softmax in float32.
"""
from __future__ import annotations

import os
from collections.abc import Callable

import torch
import torch.nn.functional as F

from qwen_trt.fast.kernels.attention import decode_attention, math_attend, rope_decode_attention
from qwen_trt.fast.model.config import FastConfig
from qwen_trt.fast.kernels.gemv import gemv
from qwen_trt.fast.model.kv_cache import StaticKVCache
from qwen_trt.fast.model.qformats import PackedLinear, QuantSpec, Weight
from qwen_trt.fast.kernels.linear import linear, prefill_weight
from qwen_trt.fast.model.reference import rms_norm, rope_tables, split_norm_rope


def qkv_rope(cfg: FastConfig, x: torch.Tensor, pos: torch.Tensor, cos: torch.Tensor,
             sin: torch.Tensor, ln_in: torch.Tensor, wqkv: torch.Tensor, q_norm: torch.Tensor,
             k_norm: torch.Tensor):
    """Norm, fused projection, q/k norms and rotary for ``x [T, hidden]`` at ``pos [T]``."""
    qkv = linear(rms_norm(x, ln_in, cfg.rms_eps), wqkv)
    return split_norm_rope(qkv, pos, cos, sin, q_norm, k_norm, cfg.heads, cfg.kv_heads,
                           cfg.head_dim, cfg.rms_eps)


def mlp(cfg: FastConfig, x: torch.Tensor, ln_post: torch.Tensor, w_gate_up: Weight,
        w_down: Weight) -> torch.Tensor:
    h = rms_norm(x, ln_post, cfg.rms_eps)
    gate, up = linear(h, w_gate_up).chunk(2, dim=-1)
    return x + linear(F.silu(gate) * up, w_down)


def prefill_layer(cfg: FastConfig, x: torch.Tensor, pos: torch.Tensor, cos: torch.Tensor,
                  sin: torch.Tensor, weights: tuple[torch.Tensor, ...], k_cache: torch.Tensor,
                  v_cache: torch.Tensor, expand_kv: bool = False) -> torch.Tensor:
    """One decoder layer over a prompt at positions ``pos = 0..T-1`` (causal SDPA over the
    prompt itself); writes K/V into the layer's cache. ``weights`` = (ln_in, wqkv, q_norm,
    k_norm, wo, ln_post, w_gate_up, w_down).

    The attention reads K/V back from the cache slots it just wrote (``[kv_heads, T, d]``, the
    layout SDPA wants) with grouped-query heads (``enable_gqa``), so no copy of K/V is made.
    ``expand_kv``: SDPA over K/V copied to every query head instead (the form before; 5 % / 3 %
    slower at 512 / 2048 tokens on the H200), kept for same-run comparisons."""
    ln_in, wqkv, q_norm, k_norm, wo, ln_post, w_gate_up, w_down = weights
    t = x.shape[0]
    q, k, v = qkv_rope(cfg, x, pos, cos, sin, ln_in, wqkv, q_norm, k_norm)
    k_cache.index_copy_(1, pos, k.transpose(0, 1))   # no slicing: keeps T symbolic
    v_cache.index_copy_(1, pos, v.transpose(0, 1))
    q = q.transpose(0, 1).unsqueeze(0)
    if expand_kv:
        group = cfg.heads // cfg.kv_heads
        kx = k.transpose(0, 1).unsqueeze(1).expand(cfg.kv_heads, group, t, cfg.head_dim)
        vx = v.transpose(0, 1).unsqueeze(1).expand(cfg.kv_heads, group, t, cfg.head_dim)
        o = F.scaled_dot_product_attention(q, kx.reshape(1, cfg.heads, t, cfg.head_dim),
                                           vx.reshape(1, cfg.heads, t, cfg.head_dim),
                                           is_causal=True)
    else:
        o = F.scaled_dot_product_attention(q, k_cache.narrow(1, 0, t).unsqueeze(0),
                                           v_cache.narrow(1, 0, t).unsqueeze(0), is_causal=True,
                                           enable_gqa=True)
    o = o.squeeze(0).transpose(0, 1).reshape(t, cfg.q_size)
    x = x + linear(o, wo)
    return mlp(cfg, x, ln_post, w_gate_up, w_down)


PROJECTIONS = ("wqkv", "wo", "w_gate_up", "w_down")


def projection_shapes(cfg: FastConfig) -> dict[str, tuple[int, int]]:
    """``[N, K]`` of each fused projection of a layer."""
    return {"wqkv": (cfg.q_size + 2 * cfg.kv_size, cfg.hidden), "wo": (cfg.hidden, cfg.q_size),
            "w_gate_up": (2 * cfg.intermediate, cfg.hidden),
            "w_down": (cfg.hidden, cfg.intermediate)}


class Qwen3Layer(torch.nn.Module):
    """Weights of one decoder layer (fused projections). A projection is a dense buffer in the
    model dtype or a packed submodule (:mod:`qwen_trt.fast.model.qformats`); with a packed ``quant``
    the projections are left empty until :meth:`set_projection` fills them."""

    def __init__(self, cfg: FastConfig, dtype: torch.dtype, device,
                 quant: QuantSpec | None = None) -> None:
        super().__init__()

        def buf(name: str, *shape: int) -> None:
            self.register_buffer(name, torch.empty(shape, dtype=dtype, device=device))

        packed = quant is not None and quant.method != "none"
        for name, shape in projection_shapes(cfg).items():
            buf(name, *((0, shape[1]) if packed else shape))
        buf("ln_in", cfg.hidden)
        buf("ln_post", cfg.hidden)
        buf("q_norm", cfg.head_dim)
        buf("k_norm", cfg.head_dim)

    def set_projection(self, name: str, w: Weight) -> None:
        """Replace projection ``name`` with ``w`` (a dense tensor or a packed module)."""
        if name not in PROJECTIONS:
            raise KeyError(name)
        self._buffers.pop(name, None)
        self._modules.pop(name, None)
        if isinstance(w, PackedLinear):
            self.add_module(name, w)
        else:
            self.register_buffer(name, w)

    def projections(self) -> dict[str, Weight]:
        return {name: getattr(self, name) for name in PROJECTIONS}


class Qwen3Fast(torch.nn.Module):
    def __init__(self, cfg: FastConfig, max_seq_len: int, dtype: torch.dtype,
                 device: torch.device | str, quant: QuantSpec | None = None) -> None:
        super().__init__()
        self.cfg = cfg
        # how the projections are held (``none``: dense in ``dtype``); the LM head, the
        # embedding and the norms stay in ``dtype`` in every format
        self.quant = quant or QuantSpec()
        self.max_seq_len = max_seq_len
        self.dtype = dtype
        self.attn_impl = "math"   # or "triton" (CUDA): chosen by the decoder after a self-check
        # "torch": decode is PyTorch ops (compiled by the decoder on CUDA); "triton": decode runs
        # the hand-written kernels of gemv.py / attention.py, 6 per layer.
        self.decode_impl = "torch"
        self.register_buffer("embed", torch.empty(cfg.vocab_size, cfg.hidden, dtype=dtype,
                                                  device=device))
        if not cfg.tie_embeddings:
            self.register_buffer("lm_head", torch.empty(cfg.vocab_size, cfg.hidden, dtype=dtype,
                                                        device=device))
        self.register_buffer("ln_final", torch.empty(cfg.hidden, dtype=dtype, device=device))
        self.layers = torch.nn.ModuleList(Qwen3Layer(cfg, dtype, device, self.quant)
                                          for _ in range(cfg.layers))
        # One spare slot past max_seq_len: a scratch position for graph-capture warm-ups, and it
        # keeps every KV bucket a strict sub-view of the cache (one compiled decode serves all).
        cos, sin = rope_tables(cfg, max_seq_len + 1, device)
        # HF casts the float32 tables to the activation dtype before use; store them that way.
        self.register_buffer("cos", cos.to(dtype), persistent=False)
        self.register_buffer("sin", sin.to(dtype), persistent=False)
        self.cache = StaticKVCache(cfg.layers, cfg.kv_heads, cfg.head_dim, max_seq_len + 1,
                                   dtype, device)

    @property
    def device(self) -> torch.device:
        return self.embed.device

    @property
    def fp8_tensor_core_prefill(self) -> bool:
        """Whether any projection multiplies on FP8 tensor cores in prefill
        (:func:`qwen_trt.fast.loader.setup_fp8_prefill`)."""
        return any(isinstance(m, PackedLinear) and m.tensor_cores for m in self.modules())

    @property
    def weight_bytes(self) -> int:
        """Bytes of weights read per decode step (a tied LM head is read as the head)."""
        n = sum(b.numel() * b.element_size() for name, b in self.named_buffers()
                if not name.startswith(("cache.", "cos", "sin")))
        return n

    def _head(self) -> torch.Tensor:
        return self.embed if self.cfg.tie_embeddings else self.lm_head

    def _qkv(self, layer: Qwen3Layer, x: torch.Tensor, pos: torch.Tensor):
        return qkv_rope(self.cfg, x, pos, self.cos, self.sin, layer.ln_in, layer.wqkv,
                        layer.q_norm, layer.k_norm)

    def _mlp(self, layer: Qwen3Layer, x: torch.Tensor) -> torch.Tensor:
        return mlp(self.cfg, x, layer.ln_post, layer.w_gate_up, layer.w_down)

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(rms_norm(x, self.ln_final, self.cfg.rms_eps), self._head())

    def prefill(self, ids: torch.Tensor, last: torch.Tensor,
                layer_fn: Callable[..., torch.Tensor] | None = None) -> torch.Tensor:
        """Prompt ``ids [T]`` at positions ``0..T-1``; returns logits ``[1, vocab]`` of row
        ``last [1]``. Rows after ``last`` may be padding: causality keeps them out of it.

        Each layer is ``layer_fn(cfg, x, pos, cos, sin, weights, k_cache, v_cache)``
        (default :func:`prefill_layer`): every layer has the same shapes, so the decoder compiles
        that function once and it serves all layers."""
        fn = layer_fn or prefill_layer
        pos = torch.arange(ids.shape[0], device=ids.device)
        x = F.embedding(ids, self.embed)
        for i, layer in enumerate(self.layers):
            k_cache, v_cache = self.cache.kv(i)
            # packed projections: dequantized here, then the layer's bf16 GEMMs (FP8 ones
            # marked for the tensor-core prefill go as they are: kernels.linear.prefill_weight)
            dt = self.dtype
            weights = (layer.ln_in, prefill_weight(layer.wqkv, dt), layer.q_norm,
                       layer.k_norm, prefill_weight(layer.wo, dt), layer.ln_post,
                       prefill_weight(layer.w_gate_up, dt), prefill_weight(layer.w_down, dt))
            x = fn(self.cfg, x, pos, self.cos, self.sin, weights, k_cache, v_cache)
        return self._logits(x.index_select(0, last))

    def decode(self, tok: torch.Tensor, pos: torch.Tensor, kv_pos: torch.Tensor) -> torch.Tensor:
        """One token ``tok [1]`` at ``pos [1]``; attends to the cache slots listed in
        ``kv_pos = arange(kv_len)`` that are ``<= pos`` (its length is the KV bucket; passing it
        as a tensor lets one compiled graph serve every bucket). Returns logits ``[1, vocab]``.
        The Triton path ignores ``kv_pos``: its attention reads slots ``0..pos`` itself."""
        if self.decode_impl == "triton":
            return self._decode_kernels(tok, pos)
        cfg = self.cfg
        x = F.embedding(tok, self.embed)
        for i, layer in enumerate(self.layers):
            q, k, v = self._qkv(layer, x, pos)
            k_cache, v_cache = self.cache.kv(i)
            k_cache.index_copy_(1, pos, k.transpose(0, 1))
            v_cache.index_copy_(1, pos, v.transpose(0, 1))
            q = q.reshape(cfg.heads, cfg.head_dim)
            if self.attn_impl == "triton":
                o = decode_attention(q, k_cache, v_cache, pos)
            else:
                o = math_attend(q, k_cache, v_cache, pos, kv_pos)
            x = x + linear(o.reshape(1, cfg.q_size), layer.wo)
            x = self._mlp(layer, x)
        return self._logits(x)

    def _decode_kernels(self, tok: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """:meth:`decode` with the fused Triton kernels (CUDA): per layer norm+qkv GEMV,
        attention in 2 kernels (the first also does the q/k norms, RoPE and the cache write),
        o GEMV+residual, norm+gate/up
        GEMV with SiLU*up, down GEMV+residual; then norm+LM head."""
        cfg = self.cfg
        eps = cfg.rms_eps
        x = F.embedding(tok, self.embed).view(cfg.hidden)
        for i, layer in enumerate(self.layers):
            k_cache, v_cache = self.cache.kv(i)
            qkv = gemv(layer.wqkv, x, ln=layer.ln_in, eps=eps)
            o = rope_decode_attention(qkv, layer.q_norm, layer.k_norm, self.cos, self.sin,
                                      pos, k_cache, v_cache, eps, cfg.heads)
            x = gemv(layer.wo, o, residual=x)
            act = gemv(layer.w_gate_up, x, ln=layer.ln_post, eps=eps, gate_up=True)
            x = gemv(layer.w_down, act, residual=x)
        return gemv(self._head(), x, ln=self.ln_final, eps=eps).view(1, cfg.vocab_size)
