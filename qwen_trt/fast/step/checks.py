"""The fast path's kernel self-checks and their fallbacks, in one sequence for both executors
(the batch-1 :class:`~qwen_trt.fast.step.decoder.FastDecoder` and the batched model,
:func:`~qwen_trt.fast.step.build.make_batched`).

:func:`choose_kernels`: the Triton decode attention against the math attention (fallback: the
math attention), then the fused Triton decode kernels against the PyTorch decode (fallback: the
PyTorch decode); each check is skipped when the warm compile cache recorded it passing
(:func:`~qwen_trt.fast.compile_cache.run_check`). A fallback is one note naming the check, the
difference or error, and what runs instead (``backends.kernel_paths`` reads them).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from qwen_trt.errors import first_line
from qwen_trt.fast.compile_cache import run_check
from qwen_trt.fast.kernels.attention import check_triton, triton_usable
from qwen_trt.fast.model.model import Qwen3Fast


@dataclass
class KernelChoice:
    attention: str                  # triton | math
    decode: str                     # triton | torch
    notes: list[str] = field(default_factory=list)


def choose_kernels(model: Qwen3Fast, attention: str = "auto", kernels: str = "auto",
                   clock=None) -> KernelChoice:
    """Check and choose ``model``'s decode attention and decode kernels (module docstring);
    sets ``model.attn_impl`` / ``model.decode_impl``. ``clock``: a
    :class:`~qwen_trt.progress.StageClock` that marks each check's time."""
    notes: list[str] = []
    mark = clock.mark if clock is not None else (lambda name: None)
    if attention == "auto":
        attention = "triton" if triton_usable(model.device) else "math"
    if attention == "triton":
        cfg = model.cfg
        problem = run_check("attention", lambda: check_triton(
            model.device, model.dtype, cfg.kv_heads, cfg.heads, cfg.head_dim,
            model.cache.kv(0)[0].shape[1]))
        mark("attention_check_s")
        if problem:
            notes.append(problem + "; using the math attention")
            attention = "math"
    model.attn_impl = attention
    if kernels == "auto":
        kernels = "triton" if attention == "triton" else "torch"
    if kernels == "triton" and attention != "triton":   # the kernels include the attention
        notes.append("triton decode kernels need the triton attention; using the PyTorch "
                     "decode")
        kernels = "torch"
    if kernels == "triton":
        problem = run_check("decode_kernels", lambda: check_decode_kernels(model))
        mark("decode_check_s")
        if problem:
            notes.append(problem + "; using the PyTorch decode")
            kernels = "torch"
    model.decode_impl = kernels
    return KernelChoice(attention, kernels, notes)


def check_decode_kernels(model: Qwen3Fast, positions: Sequence[int] | None = None) -> str | None:
    """Run decode steps with the Triton kernels and with PyTorch ops on the loaded model;
    None if the logits agree, else a one-line reason (the caller keeps the PyTorch decode).

    Default positions: 3, where the new key and value carry a large share of the attention (so
    a wrong q/k norm, RoPE or cache write shows in the logits), and the spare slot past
    ``max_seq_len``, which attends over the whole cache. Writing those slots is harmless: a
    request's prefill rewrites every slot below its first decode position before any read, and
    no request uses the spare slot.
    """
    slots = model.cache.kv(0)[0].shape[1]
    ps = sorted({min(3, slots - 1), slots - 1}) if positions is None else list(positions)
    # bf16/fp16: both paths round every op to the model dtype but accumulate in a different
    # order, which adds up over the layers; the bound is loose on purpose (a false alarm costs
    # the fast decode). A broken kernel is far off: a negated query moved the tiny model's
    # logits by 2e-1 at position 3 (tests/test_fast_kernels_interpret.py).
    tol = 1e-3 if model.dtype == torch.float32 else 1e-1
    saved_impl, saved_attn = model.decode_impl, model.attn_impl
    try:
        with torch.inference_mode():
            kv_pos = torch.arange(slots, device=model.device)
            for p in ps:
                tok = torch.tensor([1 + p % 7], device=model.device)
                at = torch.tensor([p], device=model.device)
                model.decode_impl, model.attn_impl = "torch", "math"
                ref = model.decode(tok, at, kv_pos).float()
                model.decode_impl, model.attn_impl = "triton", "triton"
                got = model.decode(tok, at, kv_pos).float()
                err = ((got - ref).norm() / ref.norm()).item()
                if not err < tol:
                    return (f"triton decode kernels differ from the PyTorch decode at position "
                            f"{p} ({err:.2e})")
    except Exception as e:  # any compile/launch failure means: use the PyTorch decode
        return first_line(f"triton decode kernels unavailable: {type(e).__name__}: {e}")
    finally:
        model.decode_impl, model.attn_impl = saved_impl, saved_attn
    return None
