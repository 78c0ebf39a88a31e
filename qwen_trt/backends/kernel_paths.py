"""Which path each kernel family of the fast path runs, and which of them fell back to slower code.

The fast path's self-checks (:mod:`qwen_trt.fast.decoder`, :mod:`qwen_trt.fast.batched`) fall
back to slower code when a Triton kernel does not build or disagrees with the reference, and
record why in ``stats.notes``. This module is the one place that turns what a load left behind
(the model's ``attn_impl`` / ``decode_impl``, the batched model's prefill and step-graph
switches) into ``{family: path}`` and ``{family: why it fell back}``; ``/health``, ``/metrics``,
the app's sidebar and ``serve``'s refusal (:func:`slow_fallback_line`) all read that.

A family counts as a *slow fallback* only on CUDA, where its fast form is the one we ship: on
the CPU every family runs PyTorch by design. Families (fast path first):

* ``attention``: ``triton`` | ``math`` (the decode attention: a math fallback measured ~24 tok/s
  against ~400 on the H200);
* ``decode``: ``triton`` (the fused decode kernels) | ``torch`` (compiled PyTorch ops);
* ``prefill`` (batched runner): ``varlen`` (paged varlen attention) | ``math``;
* ``step_graphs`` (batched runner): ``graphs`` | ``eager`` (steps that prefill);
* ``step_pieces`` (batched runner, named only when they fell back): ``torch`` (the fused
  pieces around the prefill attention did not build).
"""
from __future__ import annotations

import dataclasses

from qwen_trt.errors import QwenTrtError

FAST = {"attention": "triton", "decode": "triton", "prefill": "varlen", "step_graphs": "graphs",
        "step_pieces": "fused"}
# words in a fallback's note that name its family (the notes are the self-checks' own lines)
_NOTE_WORDS = {"attention": ("attention unavailable", "attention differs", "paged",
                             "math attention"),
               "decode": ("decode kernels", "decode differs", "pytorch decode", "cublas"),
               "prefill": ("varlen", "steps that prefill"),
               "step_graphs": ("step graphs", "run eagerly"),
               "step_pieces": ("compiled step pieces",)}


class SlowFallbackError(QwenTrtError):
    """A kernel family fell back to a much slower path and the server was not told to allow it."""


@dataclasses.dataclass(frozen=True)
class KernelPaths:
    paths: dict[str, str]            # family -> the path it runs
    slow: dict[str, str]             # family -> why it fell back (only slow fallbacks)


def _why(family: str, notes: list[str], path: str) -> str:
    words = _NOTE_WORDS.get(family, ())
    for note in notes:
        low = note.lower()
        if any(w in low for w in words):
            return note
    return f"it runs '{path}' (no self-check note says why)"


def kernel_paths(backend, runner=None) -> KernelPaths | None:
    """The paths of a fast backend (and of the batched runner over its weights, when one was
    built); None for a backend without a fast path (TensorRT-LLM, plain PyTorch)."""
    bm = getattr(runner, "model", None)
    model = getattr(bm, "model", None)
    decoder = getattr(backend, "decoder", None)
    if model is None:
        model = getattr(decoder, "model", None)
    if model is None or not hasattr(model, "attn_impl"):
        return None
    paths = {"attention": str(model.attn_impl), "decode": str(getattr(model, "decode_impl",
                                                                        "torch"))}
    notes = list(getattr(getattr(decoder, "stats", None), "notes", []) or [])
    if bm is not None and hasattr(bm, "varlen"):
        notes += list(getattr(bm.stats, "notes", []) or [])
        paths["prefill"] = "varlen" if bm.varlen else "math"
        if getattr(bm, "graphs", False):
            paths["step_graphs"] = "graphs" if bm.step_graphs else "eager"
        if any(n.startswith("compiled step pieces") for n in notes):   # they failed to build
            paths["step_pieces"] = "torch"
    on_cuda = getattr(getattr(model, "device", None), "type", "cpu") == "cuda"
    slow = {f: _why(f, notes, p) for f, p in paths.items()
            if on_cuda and f in FAST and p != FAST[f]}
    return KernelPaths(paths, slow)


def with_kernel_paths(info, backend, runner=None):
    """``info`` (a :class:`~qwen_trt.backends.base.BackendInfo`) with the paths filled in, when
    the backend has a fast path (else as it is)."""
    kp = kernel_paths(backend, runner)
    if kp is None:
        return info
    return dataclasses.replace(info, kernels=kp.paths, slow_kernels=kp.slow)


def slow_fallback_line(info) -> str | None:
    """One line for ``serve``'s refusal when ``info`` names slow fallbacks, else None."""
    slow = dict(getattr(info, "slow_kernels", None) or {})
    if not slow:
        return None
    paths = getattr(info, "kernels", None) or {}
    parts = "; ".join(f"{f} runs '{paths.get(f, '?')}' instead of '{FAST.get(f, '?')}' ({why})"
                      for f, why in slow.items())
    return (f"The fast path fell back to much slower kernels: {parts}. Fix the cause "
            f"(docs/fast-path.md, 'Slow fallbacks') or pass --allow-slow-fallback "
            f"(QWEN_TRT_ALLOW_SLOW_FALLBACK=1) to serve anyway.").replace("\n", " ")
