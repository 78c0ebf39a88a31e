"""Weight formats of the fast path's projections: bf16 (a plain tensor), FP8 and INT4.

A projection of the model (``wqkv``, ``wo``, ``w_gate_up``, ``w_down``) is either a dense tensor
``[N, K]`` in the model dtype or a :class:`PackedLinear`, which holds packed weights and knows
how to give them back in the model dtype (:meth:`PackedLinear.dequantize`). Code that multiplies
by a projection calls :func:`dense` (PyTorch ops: prefill, CPU, the reference) or passes it to
``gemv``/``bgemm``, which dispatch packed weights to the kernels of :mod:`qwen_trt.fast.kernels.qkernels`
(decode). So a layer does not care which format it holds.

* :class:`Fp8Linear` -- ``float8_e4m3fn`` weights ``[N, K]`` with one float32 scale per
  ``block_n x block_k`` tile (``scale [ceil(N / block_n), ceil(K / block_k)]``): the
  fine-grained FP8 of ``Qwen/Qwen3-*-FP8`` checkpoints (``weight`` + ``weight_scale_inv``, 128x128
  blocks; W8A16 here: the activations stay in the model dtype). ``w = weight * scale``.
* :class:`Int4Linear` -- 4-bit weights with one scale and zero point per ``group`` columns of a
  row: ``qweight [N, K / 8]`` int32 (column ``8j + i`` of a row in bits ``4i .. 4i + 3`` of word
  ``j``), ``scales [N, K / group]`` (float16, as AWQ/GPTQ store them), ``zeros [N, K / group]``
  uint8. ``w = (q - zero) * scale``. AWQ (GEMM packing) and GPTQ (no act-order) checkpoints are
  repacked into this layout at load (:func:`from_awq`, :func:`from_gptq`).

Dequantization rounds once: ``(q * scale)`` in float32, then to the model dtype.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0                     # largest finite float8_e4m3fn
FP8_BLOCK = (128, 128)              # Qwen's weight_block_size
INT4_GROUP = 128
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)          # AWQ GEMM: nibble i of a word holds column ORDER[i]
METHODS = ("none", "fp8", "int4")


@dataclass(frozen=True)
class QuantSpec:
    """How the projections are held: ``method`` none | fp8 | int4; ``block`` FP8 tile;
    ``group`` INT4 columns per scale."""

    method: str = "none"
    block: tuple[int, int] = FP8_BLOCK
    group: int = INT4_GROUP

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"quantization must be one of {', '.join(METHODS)}, "
                             f"got {self.method!r}")
        if self.method == "fp8" and tuple(self.block) != FP8_BLOCK:
            raise ValueError(f"fp8 weight_block_size {list(self.block)} is not supported: the "
                             f"fast path reads {FP8_BLOCK[0]}x{FP8_BLOCK[1]} blocks")
        if self.method == "int4" and not _pow2(self.group, 16, 1024):
            raise ValueError(f"int4 group_size {self.group}: expected a power of two in 16..1024")


def _pow2(v: int, lo: int, hi: int) -> bool:
    return isinstance(v, int) and lo <= v <= hi and v & (v - 1) == 0


class PackedLinear(torch.nn.Module):
    """A projection ``[N, K]`` in a packed format (subclasses register the buffers)."""

    fmt = "packed"
    tensor_cores = False     # FP8 marked for the tensor-core prefill (loader.setup_fp8_prefill)

    def __init__(self, n: int, k: int) -> None:
        super().__init__()
        self.n, self.k = n, k

    @property
    def shape(self) -> tuple[int, int]:
        return (self.n, self.k)

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers())

    @property
    def device(self) -> torch.device:
        return next(self.buffers()).device

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:  # pragma: no cover - abstract
        raise NotImplementedError

    def extra_repr(self) -> str:
        return f"{self.fmt}, {self.n}x{self.k}"


class Fp8Linear(PackedLinear):
    fmt = "fp8"

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor,
                 block: tuple[int, int]) -> None:
        n, k = weight.shape
        super().__init__(n, k)
        self.block = (int(block[0]), int(block[1]))
        want = (-(-n // self.block[0]), -(-k // self.block[1]))
        if tuple(scale.shape) != want:
            raise ValueError(f"fp8 scale has shape {tuple(scale.shape)}, expected {want} for "
                             f"{n}x{k} weights in {self.block[0]}x{self.block[1]} blocks")
        self.register_buffer("weight", weight.to(FP8_DTYPE).contiguous())
        self.register_buffer("scale", scale.to(torch.float32).contiguous())

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        bn, bk = self.block
        s = self.scale.repeat_interleave(bn, 0)[:self.n].repeat_interleave(bk, 1)[:, :self.k]
        return (self.weight.to(torch.float32) * s).to(dtype)


class Int4Linear(PackedLinear):
    fmt = "int4"

    def __init__(self, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                 group: int) -> None:
        n, k8 = qweight.shape
        super().__init__(n, k8 * 8)
        self.group = int(group)
        if self.k % self.group or tuple(scales.shape) != (n, self.k // self.group) or \
                tuple(zeros.shape) != tuple(scales.shape):
            raise ValueError(f"int4 scales {tuple(scales.shape)} / zeros {tuple(zeros.shape)} "
                             f"do not fit {n}x{self.k} weights in groups of {self.group}")
        self.register_buffer("qweight", qweight.to(torch.int32).contiguous())
        self.register_buffer("scales", scales.to(torch.float16).contiguous())
        self.register_buffer("zeros", zeros.to(torch.uint8).contiguous())

    def unpacked(self) -> torch.Tensor:
        """The 4-bit values ``[N, K]`` (int32, 0..15)."""
        shifts = torch.arange(0, 32, 4, device=self.qweight.device, dtype=torch.int32)
        return ((self.qweight.unsqueeze(-1) >> shifts) & 0xF).reshape(self.n, self.k)

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        g = self.group
        q = self.unpacked().to(torch.float32)
        z = self.zeros.to(torch.float32).repeat_interleave(g, 1)
        s = self.scales.to(torch.float32).repeat_interleave(g, 1)
        return ((q - z) * s).to(dtype)


Weight = torch.Tensor | PackedLinear


def fp8_act_quant(x: torch.Tensor, group: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """The activations ``x [M, K]`` (K a multiple of ``group``) as float8_e4m3fn with one
    float32 scale per row and ``group`` columns, the checkpoint's "dynamic" scheme:
    ``x ~= q * scale`` with each group's largest magnitude at 448. Returns ``(q [M, K],
    scale [M, K / group])``."""
    m, k = x.shape
    g = x.float().view(m, k // group, group)
    scale = g.abs().amax(-1).clamp_min(1e-12) / FP8_MAX
    q = (g / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.view(m, k), scale


def fp8_tensor_core_ok(w: "Fp8Linear") -> bool:
    """Whether ``w`` fits cuBLAS's block-scaled FP8 GEMM: 128x128 weight blocks, N a multiple
    of 128, K of 512 (rows of four float32 block scales: the 16-byte aligned stride the recipe
    asks for; Qwen3-4B's K are 2560, 4096 and 9728)."""
    return w.block == (128, 128) and w.n % 128 == 0 and w.k % 512 == 0


def weight_format(w: Weight) -> str:
    return "dense" if isinstance(w, torch.Tensor) else w.fmt


def packed_bytes(w: Weight) -> int:
    return w.numel() * w.element_size() if isinstance(w, torch.Tensor) else w.nbytes


# ---- quantizing dense weights ------------------------------------------------------------

def fp8_quantize(w: torch.Tensor, block: tuple[int, int] = FP8_BLOCK,
                 scale_dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """Block-wise FP8 of ``w [N, K]``: ``(weight float8_e4m3fn [N, K], scale_inv
    [ceil(N/bn), ceil(K/bk)])`` with ``w ~= weight * scale_inv``; each block's largest magnitude
    maps to 448. The values are rounded against the scale as stored (``scale_dtype``)."""
    n, k = w.shape
    bn, bk = block
    nb, kb = -(-n // bn), -(-k // bk)
    wf = w.to(torch.float32)
    pad = F.pad(wf, (0, kb * bk - k, 0, nb * bn - n))
    amax = pad.abs().view(nb, bn, kb, bk).amax(dim=(1, 3))
    scale = (amax / FP8_MAX).clamp_min(1e-12).to(scale_dtype)
    s = scale.to(torch.float32).repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
    q = (wf / s).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale


def int4_quantize(w: torch.Tensor, group: int = INT4_GROUP
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Round-to-nearest asymmetric INT4 of ``w [N, K]`` per ``group`` columns: ``(q [N, K]
    int32 0..15, scales [N, K/group] float16, zeros [N, K/group] uint8)``. No calibration:
    lower quality than AWQ/GPTQ, for tests and speed measurements."""
    n, k = w.shape
    if k % group:
        raise ValueError(f"int4: {k} columns are not a multiple of the group size {group}")
    wf = w.to(torch.float32).view(n, k // group, group)
    lo = wf.amin(-1).clamp(max=0.0)
    hi = wf.amax(-1).clamp(min=0.0)
    scale = ((hi - lo) / 15.0).clamp_min(1e-8).to(torch.float16)
    sf = scale.to(torch.float32)
    zero = (-lo / sf).round().clamp(0, 15)
    q = ((wf / sf.unsqueeze(-1)).round() + zero.unsqueeze(-1)).clamp(0, 15)
    return q.view(n, k).to(torch.int32), scale, zero.to(torch.uint8)


def pack_rows(q: torch.Tensor) -> torch.Tensor:
    """4-bit values ``[N, K]`` -> int32 ``[N, K/8]`` (column ``8j + i`` in bits ``4i``)."""
    n, k = q.shape
    q = q.to(torch.int32).view(n, k // 8, 8)
    shifts = torch.arange(0, 32, 4, device=q.device, dtype=torch.int32)
    return _sum_bits(q << shifts)


def _sum_bits(parts: torch.Tensor) -> torch.Tensor:
    """OR of the last axis (the nibbles occupy disjoint bits), as int32."""
    out = parts[..., 0]
    for i in range(1, parts.shape[-1]):
        out = out | parts[..., i]
    return out.contiguous()


def quantize(w: torch.Tensor, spec: QuantSpec) -> Weight:
    """A dense weight in ``spec``'s format (``none``: unchanged)."""
    if spec.method == "fp8":   # bfloat16 scales, as Qwen's checkpoints store them
        q, s = fp8_quantize(w, spec.block, scale_dtype=torch.bfloat16)
        return Fp8Linear(q, s, spec.block)
    if spec.method == "int4":
        q, s, z = int4_quantize(w, spec.group)
        return Int4Linear(pack_rows(q), s, z, spec.group)
    return w


def group_for(widths: list[int], group: int = INT4_GROUP) -> int:
    """The INT4 group size for projections of these input widths: ``group`` if it divides
    them all, else the largest power of two that does (tiny test models)."""
    g = group
    for w in widths:
        g = math.gcd(g, w)
    if g < 16:
        raise ValueError(f"int4: the projection widths {widths} allow no group size >= 16")
    return g


# ---- fusing q/k/v and gate/up ------------------------------------------------------------

def fuse(parts: list[Weight], dtype: torch.dtype) -> Weight:
    """Concatenate projections along N (q/k/v, gate/up). Parts of one packed format fuse in
    that format: FP8 scale rows are repeated to the largest block height that tiles every part
    (128 for Qwen3-4B, whose part heights are multiples of 128); INT4 scales are per row. Mixed
    formats (a part the checkpoint kept in bf16) fuse dense."""
    if len(parts) == 1:
        return parts[0]
    fmts = {weight_format(p) for p in parts}
    if fmts == {"dense"}:
        return torch.cat([p.to(parts[0].device) for p in parts], dim=0)
    if fmts == {"fp8"} and len({p.block[1] for p in parts}) == 1:
        sn = math.gcd(*([p.block[0] for p in parts] + [p.n for p in parts[:-1]]))
        scales = [p.scale.repeat_interleave(p.block[0] // sn, 0)[:-(-p.n // sn)] for p in parts]
        return Fp8Linear(torch.cat([p.weight for p in parts]), torch.cat(scales),
                         (sn, parts[0].block[1]))
    if fmts == {"int4"} and len({p.group for p in parts}) == 1:
        return Int4Linear(torch.cat([p.qweight for p in parts]),
                          torch.cat([p.scales for p in parts]),
                          torch.cat([p.zeros for p in parts]), parts[0].group)
    return torch.cat([p if isinstance(p, torch.Tensor) else p.dequantize(dtype)
                      for p in parts], dim=0)   # mixed formats: dense


# ---- AWQ / GPTQ checkpoint layouts (``[in, out]`` storage) -------------------------------

def _unpack_cols(packed: torch.Tensor, order: tuple[int, ...] = tuple(range(8))) -> torch.Tensor:
    """int32 ``[R, C/8]`` packed along columns (nibble ``i`` holds column ``8j + order[i]``)
    -> ``[R, C]`` values 0..15."""
    r, c8 = packed.shape
    shifts = torch.arange(0, 32, 4, device=packed.device, dtype=torch.int32)
    nib = (packed.to(torch.int32).unsqueeze(-1) >> shifts) & 0xF        # [R, C/8, 8] by nibble
    inv = [order.index(c) for c in range(8)]
    return nib[..., inv].reshape(r, c8 * 8)


def _pack_cols(vals: torch.Tensor, order: tuple[int, ...] = tuple(range(8))) -> torch.Tensor:
    r, c = vals.shape
    v = vals.to(torch.int32).view(r, c // 8, 8)[..., list(order)]
    shifts = torch.arange(0, 32, 4, device=vals.device, dtype=torch.int32)
    return _sum_bits(v << shifts)


def from_awq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
             group: int) -> Int4Linear:
    """AWQ GEMM layout: ``qweight [K, N/8]``, ``qzeros [K/g, N/8]`` (both packed along N in
    AWQ's nibble order), ``scales [K/g, N]``; ``w[k, n] = (q - z) * s``."""
    q = _unpack_cols(qweight, AWQ_ORDER)                # [K, N]
    z = _unpack_cols(qzeros, AWQ_ORDER)                 # [K/g, N]
    return Int4Linear(pack_rows(q.t().contiguous()), scales.t().contiguous(),
                      z.t().contiguous(), group)


def to_awq(w: Int4Linear) -> dict[str, torch.Tensor]:
    q = w.unpacked().t().contiguous()
    return {"qweight": _pack_cols(q, AWQ_ORDER),
            "qzeros": _pack_cols(w.zeros.t().contiguous(), AWQ_ORDER),
            "scales": w.scales.t().contiguous()}


def from_gptq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
              group: int, zero_offset: int = 1) -> Int4Linear:
    """GPTQ layout without act-order: ``qweight [K/8, N]`` packed along K (nibble ``i`` of
    row ``j`` = input row ``8j + i``), ``qzeros [K/g, N/8]`` packed along N, ``scales
    [K/g, N]``; the stored zero is the real one minus ``zero_offset`` (1 in the original
    ``gptq`` checkpoint format, 0 in ``gptq_v2``)."""
    k8, n = qweight.shape
    q = _unpack_cols(qweight.t().contiguous())          # [N, K]: unpack along K
    z = (_unpack_cols(qzeros) + zero_offset).clamp(0, 15)   # [K/g, N]
    return Int4Linear(pack_rows(q), scales.t().contiguous(), z.t().contiguous(), group)


def to_gptq(w: Int4Linear) -> dict[str, torch.Tensor]:
    if int(w.zeros.min()) < 1:
        raise ValueError("gptq's checkpoint format stores zero - 1: zero points of 0 do not fit")
    k = w.k
    return {"qweight": _pack_cols(w.unpacked()).t().contiguous(),
            "qzeros": _pack_cols((w.zeros.to(torch.int32) - 1).t().contiguous()),
            "scales": w.scales.t().contiguous(),
            "g_idx": torch.arange(k, dtype=torch.int32) // w.group}
