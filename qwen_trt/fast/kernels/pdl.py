"""Programmatic dependent launch (PDL) for the decode kernels, where the GPU and Triton have it.

With PDL a kernel may start while the kernel before it on the stream is still finishing. Each of
our decode kernels first loads what no earlier kernel writes (weights, norm weights), then calls
``gdc_wait()``, which returns once the previous kernel has completed and its writes are visible;
every read of activations, positions or the KV cache, and every write, comes after it. Kernels
call ``gdc_launch_dependents()`` at that point so the next kernel can be scheduled early.

Needs compute capability 9.0+ (Hopper) and a Triton with ``triton.language.extra.cuda.gdc_*``;
elsewhere the calls compile to nothing and kernels launch normally. ``QWEN_TRT_PDL=0`` (:class:`~qwen_trt.fast.options.KernelOptions` ``pdl``) turns it
off (to bisect a suspected race). CUDA graphs keep the programmatic edges.
"""
from __future__ import annotations

import functools

import torch

from qwen_trt.fast.options import options

try:
    import triton
except ImportError:  # pragma: no cover - depends on the install
    triton = None

_HAS_GDC = False
if triton is not None:
    try:
        from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
        _HAS_GDC = True
    except (ImportError, AttributeError):  # pragma: no cover - older Triton
        @triton.jit
        def gdc_wait():
            pass

        @triton.jit
        def gdc_launch_dependents():
            pass
else:  # pragma: no cover - CPU-only installs: nothing here is ever launched
    def gdc_wait():
        pass

    def gdc_launch_dependents():
        pass


@functools.lru_cache(maxsize=None)
def _device_has_pdl(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def pdl_enabled(device: torch.device) -> bool:
    if not _HAS_GDC or device.type != "cuda" or not options().pdl:
        return False
    return _device_has_pdl(device.index if device.index is not None
                           else torch.cuda.current_device())


def launch_kwargs(pdl: bool) -> dict:
    """Extra launch options for a kernel launched with PDL."""
    return {"launch_pdl": True} if pdl else {}
