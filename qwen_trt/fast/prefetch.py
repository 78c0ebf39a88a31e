"""L2 prefetch of upcoming weights inside the batch-1 decode kernels (Hopper and newer).

A decode step streams 8 GB of weights per token from HBM, and HBM is the bound. But between the weight streams sit phases that read almost nothing: the q/k norm + RoPE
kernel and the attention (latency-bound: ~8 µs per layer at 512 tokens of context), and each
GEMV's ramp-up and tail. In those phases HBM idles. Here a kernel that has little to read
itself asks the copy engine of its SM to pull the *next* projection's weights into L2
(``cp.async.bulk.prefetch.L2``: fire and forget, nothing waits on it), so the next GEMV reads
them from L2 instead of HBM:

* the qkv GEMV's programs, as each finishes, prefetch the whole o projection (21 MB on
  Qwen3-4B), which streams in while RoPE and the attention run;
* the o GEMV (now reading from L2) prefetches the first rows of gate/up;
* the gate/up and down GEMVs prefetch, as each program finishes, the first rows of the next
  matrix (down; the next layer's qkv or the LM head), filling their tails.

The weight loads of the GEMVs use the ``evict_first`` policy so the streamed-through weights
do not push the prefetched ones out of L2 (50 MB on the H100/H200).

A prefetch is a hint: it changes no result, only where the bytes come from. The amounts are a
:class:`PrefetchPlan` (``QWEN_TRT_L2_PREFETCH`` overrides it, e.g. ``0`` for none or
``o=1,gu=16,down=8,next=8,evict=1,bulk=0``, sizes in MB) and are applied only where the GPU has the
instruction (compute capability 9.0+) and PDL is on.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, replace

import torch

from qwen_trt.fast.pdl import pdl_enabled

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None

MB = 1 << 20


@dataclass(frozen=True)
class PrefetchPlan:
    """How much of each next weight matrix a decode kernel pulls into L2 (MB; 0 = nothing)."""

    o: int = 1              # the whole o projection: 0 none, 1 from the qkv GEMV's tail,
                            # 2 from the RoPE kernel
    gate_up_mb: float = 16  # o GEMV -> the first rows of gate/up (split over both halves)
    down_mb: float = 8      # gate/up GEMV tail -> the first rows of down
    next_mb: float = 8      # down GEMV tail -> the next layer's qkv (or the LM head)
    evict_first: bool = True  # GEMV weight loads marked evict-first
    bulk: bool = False      # one bulk copy-engine prefetch per thread instead of one
                            # ``prefetch.global.L2`` per 128-byte line

    @property
    def any(self) -> bool:
        return bool(self.o) or self.gate_up_mb > 0 or self.down_mb > 0 or self.next_mb > 0

    @classmethod
    def parse(cls, text: str) -> "PrefetchPlan":
        """``"0"``/``"off"``: nothing; ``"1"``/``"on"``: the defaults; else ``k=v`` pairs
        over o, gu, down, next, evict, bulk. Raises ValueError on anything else."""
        text = text.strip().lower()
        if text in ("0", "off", "none"):
            return cls(o=0, gate_up_mb=0, down_mb=0, next_mb=0, evict_first=False)
        if text in ("", "1", "on", "default"):
            return cls()
        keys = {"o": "o", "gu": "gate_up_mb", "down": "down_mb", "next": "next_mb",
                "evict": "evict_first", "bulk": "bulk"}
        plan = cls()
        for item in text.split(","):
            k, sep, v = item.partition("=")
            if not sep or k.strip() not in keys:
                raise ValueError(f"QWEN_TRT_L2_PREFETCH: {item!r} is not one of "
                                 f"{', '.join(keys)}=VALUE")
            name = keys[k.strip()]
            try:
                val = float(v)
            except ValueError:
                raise ValueError(f"QWEN_TRT_L2_PREFETCH: {item!r}: not a number") from None
            if val < 0 or (name == "o" and val not in (0, 1, 2)):
                raise ValueError(f"QWEN_TRT_L2_PREFETCH: {item!r}: out of range")
            conv = {"o": int, "evict_first": bool, "bulk": bool}.get(name, float)
            plan = replace(plan, **{name: conv(val)})
        return plan


def plan_for(device: torch.device) -> PrefetchPlan | None:
    """The plan for kernels on ``device``, or None where prefetching does not apply (no
    Hopper, no PDL, or turned off)."""
    if not pdl_enabled(device):
        return None
    plan = PrefetchPlan.parse(os.environ.get("QWEN_TRT_L2_PREFETCH", "1"))
    return plan if plan.any or plan.evict_first else None


@dataclass(frozen=True)
class Prefetch:
    """``parts`` regions of ``nbytes`` each, ``stride`` bytes apart, starting at ``t``."""

    t: torch.Tensor
    nbytes: int
    parts: int = 1
    stride: int = 0
    bulk: bool = False

    @classmethod
    def head(cls, t: torch.Tensor, mb: float, parts: int = 1,
             bulk: bool = False) -> "Prefetch | None":
        """The first ``mb`` MB of ``t`` (of each of its ``parts`` equal row ranges)."""
        total = t.numel() * t.element_size()
        part = total // parts
        n = (part if mb * MB >= part else int(mb * MB)) // 256 * 256
        return cls(t, n, parts, part, bulk) if n > 0 else None

    def kernel_args(self) -> dict:
        return {"PF_BYTES": self.nbytes, "PF_PARTS": self.parts, "PF_STRIDE": self.stride,
                "PF_BULK": self.bulk}


NO_PREFETCH = {"PF_BYTES": 0, "PF_PARTS": 1, "PF_STRIDE": 0, "PF_BULK": False}


@dataclass(frozen=True)
class LayerPrefetch:
    """What each kernel of one decode layer prefetches (see the module docstring)."""

    qkv: Prefetch | None = None       # -> o projection (at the end)
    rope: Prefetch | None = None      # -> o projection
    o: Prefetch | None = None         # -> first rows of gate/up
    gate_up: Prefetch | None = None   # -> first rows of down (at the end)
    down: Prefetch | None = None      # -> first rows of the next qkv / LM head (at the end)
    evict_first: bool = False


def decode_prefetches(plan: PrefetchPlan | None, layers, head: torch.Tensor
                      ) -> list[LayerPrefetch]:
    """Per layer of ``layers`` (with ``wqkv, wo, w_gate_up, w_down``), given the LM head."""
    if plan is None:
        return [LayerPrefetch() for _ in layers]
    out = []
    for i, layer in enumerate(layers):
        nxt = layers[i + 1].wqkv if i + 1 < len(layers) else head
        o = Prefetch.head(layer.wo, float("inf"), bulk=plan.bulk)
        out.append(LayerPrefetch(
            qkv=o if plan.o == 1 else None, rope=o if plan.o == 2 else None,
            o=Prefetch.head(layer.w_gate_up, plan.gate_up_mb / 2, parts=2, bulk=plan.bulk),
            gate_up=Prefetch.head(layer.w_down, plan.down_mb, bulk=plan.bulk),
            down=Prefetch.head(nxt, plan.next_mb, bulk=plan.bulk),
            evict_first=plan.evict_first))
    return out


if triton is not None:
    @triton.jit
    def l2_prefetch(ptr, pid, NPROG: tl.constexpr, NBYTES: tl.constexpr,
                    PARTS: tl.constexpr, STRIDE: tl.constexpr, LANES: tl.constexpr,
                    BULK: tl.constexpr):
        """Program ``pid`` of ``NPROG`` asks for its share of ``PARTS`` regions of ``NBYTES``
        (``STRIDE`` bytes apart) from ``ptr`` to be pulled into L2 (``LANES`` = the program's
        threads). ``BULK``: one ``cp.async.bulk.prefetch.L2`` per thread; else one
        ``prefetch.global.L2::evict_last`` per 128-byte line, lines spread over the threads.
        Nothing waits for the data."""
        span: tl.constexpr = ((NBYTES + NPROG - 1) // NPROG + 255) // 256 * 256
        p8 = ptr.to(tl.pointer_type(tl.uint8))
        lane = tl.arange(0, LANES)
        end = tl.minimum(pid * span + span, NBYTES)
        if BULK:
            chunk: tl.constexpr = ((span + LANES - 1) // LANES + 15) // 16 * 16
            start = pid * span + lane * chunk                     # within one region
            size = tl.maximum(tl.minimum(end - start, chunk), 0).to(tl.int32)
            for part in tl.static_range(PARTS):
                offs = start.to(tl.int64) + part * STRIDE
                tl.inline_asm_elementwise(
                    "{ .reg .pred p; setp.gt.s32 p, $2, 0; "
                    "@p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
                    "=r,l,r", [p8 + offs, size], dtype=tl.int32, is_pure=False, pack=1)
        else:
            iters: tl.constexpr = (span + 128 * LANES - 1) // (128 * LANES)
            for it in range(iters):
                start = pid * span + (it * LANES + lane) * 128
                ok = (start < end).to(tl.int32)
                for part in tl.static_range(PARTS):
                    offs = start.to(tl.int64) + part * STRIDE
                    tl.inline_asm_elementwise(
                        "{ .reg .pred p; setp.ne.s32 p, $2, 0; "
                        "@p prefetch.global.L2::evict_last [$1]; mov.u32 $0, 0; }",
                        "=r,l,r", [p8 + offs, ok], dtype=tl.int32, is_pure=False, pack=1)
else:  # pragma: no cover - CPU-only installs: no kernel is ever launched
    def l2_prefetch(*args):
        pass
