"""Triton kernels for packed projections (:mod:`qwen_trt.fast.qformats`): FP8 (128x128 block
scales) and INT4 (group scales and zero points), dequantized in registers (W8A16 / W4A16: the
activations stay in the model dtype, no FP8 tensor cores needed).

* :func:`qgemv` -- batch 1, with the fusions of :func:`qwen_trt.fast.gemv.gemv` (RMSNorm
  prologue, residual, ``silu(gate) * up``). Each program owns ``BLOCK_N`` rows and walks K
  ``BK`` columns at a time (several scale blocks / groups: each column's scale is gathered;
  the loop is unrolled so the loads are in flight together), accumulating products
  elementwise and reducing once at the end.
* :func:`qbgemm` -- 2..64 rows, the fusions of :func:`qwen_trt.fast.bgemm.bgemm`: each program
  dequantizes a ``BLOCK_N x BK`` strip of the weight to the model dtype once and multiplies all
  M rows with it (``tl.dot``).
* :func:`dequantize` -- the whole matrix back to the model dtype (prefill: dequantize, then
  the bf16 GEMM).

``gemv``/``bgemm`` call these when handed a :class:`~qwen_trt.fast.qformats.PackedLinear`. INT4
values of a row are 8 to an int32 word (column ``8j + i`` in bits ``4i``); the kernels unpack a
group's 16 words as a ``[rows, 16, 8]`` tile. GEMV products are float32 on the float32
dequantized weight; the GEMM rounds the dequantized strip to the model dtype before ``tl.dot``,
as the reference (dequantize, then ``F.linear``) does.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from qwen_trt.fast.kernel_parts import silu_mul
from qwen_trt.fast.pdl import gdc_launch_dependents, gdc_wait, launch_kwargs, pdl_enabled
from qwen_trt.fast.qformats import Fp8Linear, Int4Linear, PackedLinear

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None


@dataclass(frozen=True)
class QConfig:
    block_n: int = 4
    warps: int = 4
    stages: int = 3
    bk: int = 0           # columns per step (0: one scale block / group)
    unroll: bool = False  # GEMV: the K loop unrolled instead of pipelined
    blocked: bool = False  # GEMV: steps of whole scale blocks (bk a multiple of the block)


def _fmt_args(w: PackedLinear):
    """(q, scale, zero, SN, SK, FMT, scale columns) of a packed weight for the kernels."""
    if isinstance(w, Fp8Linear):
        q = w.weight.view(torch.uint8)     # bit patterns; the kernels bitcast to float8e4nv
        return q, w.scale, w.scale, w.block[0], w.block[1], 0, w.scale.shape[1]
    if isinstance(w, Int4Linear):
        return w.qweight, w.scales, w.zeros, 1, w.group, 1, w.scales.shape[1]
    raise TypeError(f"no kernels for weight format {type(w).__name__}")


def _bk(w: PackedLinear) -> int:
    """Columns per step: one scale block / group (FP8 weights narrower than a block: K
    rounded up to a power of two)."""
    _, _, _, _, sk, fmt, _ = _fmt_args(w)
    return sk if fmt == 1 else min(sk, triton.next_power_of_2(w.k))


if triton is not None:
    @triton.jit
    def _int4_tile3(q_ptr, s_ptr, z_ptr, rows, row_ok, k0, K: tl.constexpr, KS: tl.constexpr,
                    SK: tl.constexpr, BLOCK_N: tl.constexpr, BK: tl.constexpr):
        """float32 INT4 weights ``[BLOCK_N, BK / 8, 8]`` (word, nibble) of ``rows`` at columns
        ``k0 .. k0 + BK``: one scale / zero per row when the step lies in one group
        (``BK <= SK``), else gathered per word."""
        j = k0 // 8 + tl.arange(0, BK // 8)          # words of the row
        m = row_ok[:, None] & (j < K // 8)[None, :]
        wq = tl.load(q_ptr + rows[:, None] * (K // 8) + j[None, :], mask=m, other=0)
        qv = ((wq[:, :, None] >> (tl.arange(0, 8) * 4)[None, None, :]) & 15).to(tl.float32)
        if BK <= SK:
            s = tl.load(s_ptr + rows * KS + k0 // SK, mask=row_ok, other=0.0).to(tl.float32)
            z = tl.load(z_ptr + rows * KS + k0 // SK, mask=row_ok, other=0).to(tl.float32)
            return qv * s[:, None, None] - (z * s)[:, None, None]    # exact: (q - z) * s
        else:
            g = rows[:, None] * KS + (j * 8 // SK)[None, :]
            s = tl.load(s_ptr + g, mask=m, other=0.0).to(tl.float32)
            z = tl.load(z_ptr + g, mask=m, other=0).to(tl.float32)
            return qv * s[:, :, None] - (z * s)[:, :, None]

    @triton.jit
    def _dequant_tile(q_ptr, s_ptr, z_ptr, rows, row_ok, k0, K: tl.constexpr,
                      KS: tl.constexpr, SN: tl.constexpr, SK: tl.constexpr,
                      BLOCK_N: tl.constexpr, BK: tl.constexpr, FMT: tl.constexpr):
        """float32 weights ``[BLOCK_N, BK]`` of ``rows`` at columns ``k0 .. k0 + BK``. A step
        inside one scale block / group (``BK <= SK``) loads one scale per row; a wider one
        gathers each column's scale (from L1). Rows outside ``row_ok`` and columns past K
        are 0."""
        if FMT == 0:
            kk = k0 + tl.arange(0, BK)
            m = row_ok[:, None] & (kk < K)[None, :]
            raw = tl.load(q_ptr + rows[:, None] * K + kk[None, :], mask=m, other=0)
            w = raw.to(tl.float8e4nv, bitcast=True).to(tl.float32)
            if BK <= SK:
                s = tl.load(s_ptr + (rows // SN) * KS + k0 // SK, mask=row_ok, other=0.0)
                return w * s[:, None]
            else:
                s = tl.load(s_ptr + (rows // SN)[:, None] * KS + (kk // SK)[None, :], mask=m,
                            other=0.0)
                return w * s
        else:
            w = _int4_tile3(q_ptr, s_ptr, z_ptr, rows, row_ok, k0, K, KS, SK, BLOCK_N, BK)
            return tl.reshape(w, (BLOCK_N, BK))

    @triton.jit
    def _norm_x(x_ptr, ln_ptr, offs, ok, rstd, dt: tl.constexpr, NORM: tl.constexpr):
        """Activations at ``offs`` (any shape), RMSNorm-ed like the unfused op when NORM."""
        xv = tl.load(x_ptr + offs, mask=ok, other=0.0)
        if NORM:
            g = tl.load(ln_ptr + offs, mask=ok, other=0.0)
            xv = (g.to(tl.float32) * (xv.to(tl.float32) * rstd).to(dt).to(tl.float32)).to(dt)
        return xv.to(tl.float32)

    @triton.jit
    def _blocked_step(q_ptr, s_ptr, z_ptr, x_ptr, ln_ptr, rows, row_ok, k0, rstd, acc,
                      K: tl.constexpr, KS: tl.constexpr, SN: tl.constexpr, SK: tl.constexpr,
                      BK: tl.constexpr, FMT: tl.constexpr, NORM: tl.constexpr,
                      dt: tl.constexpr):
        """A ``BK``-column GEMV step over ``BK / SK`` whole scale blocks / groups as a tile
        ``[rows, blocks, SK]`` (INT4: ``[rows, groups, SK / 8, 8]``): one scale (and zero)
        per row and block, loaded as a ``[rows, blocks]`` tile and broadcast."""
        NB: tl.constexpr = BK // SK
        b = tl.arange(0, NB)
        kb = k0 // SK + b
        sm = row_ok[:, None] & (kb < KS)[None, :]
        if FMT == 0:
            kk = k0 + b[:, None] * SK + tl.arange(0, SK)[None, :]            # [NB, SK]
            m = row_ok[:, None, None] & (kk < K)[None, :, :]
            raw = tl.load(q_ptr + rows[:, None, None] * K + kk[None, :, :], mask=m, other=0)
            w = raw.to(tl.float8e4nv, bitcast=True).to(tl.float32)
            sc = tl.load(s_ptr + (rows // SN)[:, None] * KS + kb[None, :], mask=sm, other=0.0)
            xf = _norm_x(x_ptr, ln_ptr, kk, kk < K, rstd, dt, NORM)[None, :, :]
            acc += w * sc[:, :, None] * xf
        else:
            W: tl.constexpr = SK // 8
            c = tl.arange(0, W)
            i = tl.arange(0, 8)
            jw = k0 // 8 + b[:, None] * W + c[None, :]                        # [NB, W]
            m = row_ok[:, None, None] & (jw < K // 8)[None, :, :]
            wq = tl.load(q_ptr + rows[:, None, None] * (K // 8) + jw[None, :, :], mask=m,
                         other=0)
            qv = ((wq[:, :, :, None] >> (i * 4)[None, None, None, :]) & 15).to(tl.float32)
            goff = rows[:, None] * KS + kb[None, :]
            sc = tl.load(s_ptr + goff, mask=sm, other=0.0).to(tl.float32)
            zp = tl.load(z_ptr + goff, mask=sm, other=0).to(tl.float32)
            xoff = k0 + b[:, None, None] * SK + c[None, :, None] * 8 + i[None, None, :]
            xf = _norm_x(x_ptr, ln_ptr, xoff, xoff < K, rstd, dt, NORM)[None, :, :, :]
            acc += (qv * sc[:, :, None, None] - (zp * sc)[:, :, None, None]) * xf
        return acc

    @triton.jit
    def _qgemv_step(q_ptr, s_ptr, z_ptr, x_ptr, ln_ptr, rows, row_ok, k0, rstd, acc, acc2,
                    N: tl.constexpr, K: tl.constexpr, KS: tl.constexpr, SN: tl.constexpr,
                    SK: tl.constexpr, BLOCK_N: tl.constexpr, BK: tl.constexpr,
                    FMT: tl.constexpr, NORM: tl.constexpr, GATE_UP: tl.constexpr,
                    dt: tl.constexpr, BLOCKED: tl.constexpr):
        """One ``BK``-column step of the GEMV: products accumulate elementwise (FP8
        ``[BLOCK_N, BK]``, INT4 ``[BLOCK_N, BK / 8, 8]``; ``BLOCKED``: by scale block, see
        :func:`_blocked_step`)."""
        if BLOCKED:
            acc = _blocked_step(q_ptr, s_ptr, z_ptr, x_ptr, ln_ptr, rows, row_ok, k0, rstd, acc,
                                K, KS, SN, SK, BK, FMT, NORM, dt)
            if GATE_UP:
                acc2 = _blocked_step(q_ptr, s_ptr, z_ptr, x_ptr, ln_ptr, rows + N, row_ok, k0,
                                     rstd, acc2, K, KS, SN, SK, BK, FMT, NORM, dt)
        elif FMT == 0:
            kk = k0 + tl.arange(0, BK)
            xf = _norm_x(x_ptr, ln_ptr, kk, kk < K, rstd, dt, NORM)[None, :]
            acc += _dequant_tile(q_ptr, s_ptr, z_ptr, rows, row_ok, k0, K, KS, SN, SK,
                                 BLOCK_N, BK, FMT) * xf
            if GATE_UP:
                acc2 += _dequant_tile(q_ptr, s_ptr, z_ptr, rows + N, row_ok, k0, K, KS, SN, SK,
                                      BLOCK_N, BK, FMT) * xf
        else:
            xoff = k0 + tl.arange(0, BK // 8)[:, None] * 8 + tl.arange(0, 8)[None, :]
            xf = _norm_x(x_ptr, ln_ptr, xoff, xoff < K, rstd, dt, NORM)[None, :, :]
            acc += _int4_tile3(q_ptr, s_ptr, z_ptr, rows, row_ok, k0, K, KS, SK, BLOCK_N,
                               BK) * xf
            if GATE_UP:
                acc2 += _int4_tile3(q_ptr, s_ptr, z_ptr, rows + N, row_ok, k0, K, KS, SK,
                                    BLOCK_N, BK) * xf
        return acc, acc2

    @triton.jit
    def _qgemv_kernel(q_ptr, s_ptr, z_ptr, x_ptr, out_ptr, ln_ptr, res_ptr, eps,
                      N: tl.constexpr, K: tl.constexpr, KS: tl.constexpr, SN: tl.constexpr,
                      SK: tl.constexpr, BLOCK_N: tl.constexpr, BK: tl.constexpr,
                      FMT: tl.constexpr, NORM: tl.constexpr, RESIDUAL: tl.constexpr,
                      GATE_UP: tl.constexpr, PDL: tl.constexpr, UNROLL: tl.constexpr = False,
                      BLOCKED: tl.constexpr = False):
        """``UNROLL``: the K loop unrolled (every step's loads issued together; for wide
        steps), else a pipelined loop (``num_stages``; for one-block steps). ``BLOCKED``:
        steps of whole scale blocks with their scales as a small tile (``BK`` a multiple of
        the block / group), else per-row scales (``BK <= SK``) or gathered ones."""
        pid = tl.program_id(0)
        rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        row_ok = rows < N
        dt = x_ptr.dtype.element_ty
        if PDL:
            gdc_launch_dependents()
            gdc_wait()
        rstd = 0.0
        if NORM:
            ss = tl.zeros([BK], tl.float32)
            for k0 in range(0, K, BK):
                kk = k0 + tl.arange(0, BK)
                xv = tl.load(x_ptr + kk, mask=kk < K, other=0.0).to(tl.float32)
                ss += xv * xv
            rstd = tl.rsqrt(tl.sum(ss, 0) / K + eps)
        if BLOCKED and FMT == 0:
            acc = tl.zeros([BLOCK_N, BK // SK, SK], tl.float32)
            acc2 = tl.zeros([BLOCK_N, BK // SK, SK], tl.float32)
        elif BLOCKED:
            acc = tl.zeros([BLOCK_N, BK // SK, SK // 8, 8], tl.float32)
            acc2 = tl.zeros([BLOCK_N, BK // SK, SK // 8, 8], tl.float32)
        elif FMT == 0:
            acc = tl.zeros([BLOCK_N, BK], tl.float32)
            acc2 = tl.zeros([BLOCK_N, BK], tl.float32)
        else:
            acc = tl.zeros([BLOCK_N, BK // 8, 8], tl.float32)
            acc2 = tl.zeros([BLOCK_N, BK // 8, 8], tl.float32)
        if UNROLL:
            for k0 in tl.static_range(0, K, BK):
                acc, acc2 = _qgemv_step(q_ptr, s_ptr, z_ptr, x_ptr, ln_ptr, rows, row_ok, k0,
                                        rstd, acc, acc2, N, K, KS, SN, SK, BLOCK_N, BK, FMT,
                                        NORM, GATE_UP, dt, BLOCKED)
        else:
            for k0 in range(0, K, BK):
                acc, acc2 = _qgemv_step(q_ptr, s_ptr, z_ptr, x_ptr, ln_ptr, rows, row_ok, k0,
                                        rstd, acc, acc2, N, K, KS, SN, SK, BLOCK_N, BK, FMT,
                                        NORM, GATE_UP, dt, BLOCKED)
        y_acc = tl.sum(tl.reshape(acc, (BLOCK_N, BK)), 1)
        u_acc = tl.sum(tl.reshape(acc2, (BLOCK_N, BK)), 1)
        y = y_acc.to(dt)
        if GATE_UP:
            y = silu_mul(y, u_acc.to(dt), dt)
        if RESIDUAL:
            r = tl.load(res_ptr + rows, mask=row_ok, other=0.0)
            y = (r.to(tl.float32) + y.to(tl.float32)).to(dt)
        tl.store(out_ptr + rows, y, mask=row_ok)

    @triton.jit
    def _qbgemm_kernel(q_ptr, s_ptr, z_ptr, x_ptr, out_ptr, res_ptr, M,
                       N: tl.constexpr, K: tl.constexpr, KS: tl.constexpr, SN: tl.constexpr,
                       SK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       BK: tl.constexpr, FMT: tl.constexpr, RESIDUAL: tl.constexpr,
                       GATE_UP: tl.constexpr, IEEE: tl.constexpr, PDL: tl.constexpr):
        pid = tl.program_id(0)
        rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = rn < N
        rm = tl.arange(0, BLOCK_M)
        m_ok = rm < M
        dt = x_ptr.dtype.element_ty
        if PDL:
            gdc_launch_dependents()
            gdc_wait()
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        acc2 = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, K, BK):
            kk = k0 + tl.arange(0, BK)
            x = tl.load(x_ptr + rm[:, None] * K + kk[None, :],
                        mask=m_ok[:, None] & (kk < K)[None, :], other=0.0)
            w = _dequant_tile(q_ptr, s_ptr, z_ptr, rn, n_ok, k0, K, KS, SN, SK, BLOCK_N, BK,
                              FMT).to(dt)
            if IEEE:
                acc += tl.dot(x, tl.trans(w), input_precision="ieee")
            else:
                acc += tl.dot(x, tl.trans(w))
            if GATE_UP:
                w2 = _dequant_tile(q_ptr, s_ptr, z_ptr, rn + N, n_ok, k0, K, KS, SN, SK,
                                   BLOCK_N, BK, FMT).to(dt)
                if IEEE:
                    acc2 += tl.dot(x, tl.trans(w2), input_precision="ieee")
                else:
                    acc2 += tl.dot(x, tl.trans(w2))
        y = acc.to(dt)
        if GATE_UP:
            y = silu_mul(y, acc2.to(dt), dt)
        om = m_ok[:, None] & n_ok[None, :]
        offs = rm[:, None] * N + rn[None, :]
        if RESIDUAL:
            r = tl.load(res_ptr + offs, mask=om, other=0.0)
            y = (r.to(tl.float32) + y.to(tl.float32)).to(dt)
        tl.store(out_ptr + offs, y, mask=om)

    @triton.jit
    def _dequant_kernel(q_ptr, s_ptr, z_ptr, out_ptr, N: tl.constexpr, K: tl.constexpr,
                        KS: tl.constexpr, SN: tl.constexpr, SK: tl.constexpr,
                        BLOCK_N: tl.constexpr, BK: tl.constexpr, FMT: tl.constexpr):
        rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        row_ok = rows < N
        k0 = tl.program_id(1) * BK
        w = _dequant_tile(q_ptr, s_ptr, z_ptr, rows, row_ok, k0, K, KS, SN, SK, BLOCK_N, BK, FMT)
        kk = k0 + tl.arange(0, BK)
        tl.store(out_ptr + rows[:, None] * K + kk[None, :], w.to(out_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & (kk < K)[None, :])

    # GEMV forms: one scale block / group per step in a pipelined loop (per-row scales; the
    # fastest measured for qkv and gate_up on an H200), wide unrolled steps with gathered
    # scales (fastest measured for o and down), and wide steps by whole blocks with a small
    # scale tile (not yet measured). (meta, warps, stages)
    GEMV_CONFIGS = (
        [({"BLOCK_N": bn, "BK": 128}, w, st)
         for bn, w, st in ((2, 4, 3), (4, 4, 3), (4, 8, 3), (8, 8, 2))]
        + [({"BLOCK_N": bn, "BK": bk, "UNROLL": True}, w, 1)
           for bn, bk, w in ((2, 1024, 4), (4, 1024, 8))]
        + [({"BLOCK_N": bn, "BK": bk, "UNROLL": True, "BLOCKED": True}, w, 1)
           for bn, bk, w in ((2, 1024, 4), (4, 512, 4), (4, 1024, 8), (8, 512, 8))])
    # GEMM: one block per step (faster than wider gathered steps on an H200)
    BGEMM_CONFIGS = [({"BLOCK_N": bn, "BK": 128}, w, st)
                     for bn, w, st in ((16, 4, 4), (32, 4, 4), (64, 4, 3), (32, 8, 3),
                                       (128, 4, 3))]


class _Tuner:
    """Picks a kernel's fastest configuration per key at its first call (the decoder's
    self-check and warm-up, before any graph capture) and launches it from then on. A
    configuration that fails to build or launch here is skipped, so a form that a GPU or
    Triton version cannot compile costs only its own candidacy."""

    def __init__(self, kernel, configs) -> None:
        self.kernel, self.configs = kernel, configs
        self.best: dict = {}
        self.timed: dict = {}

    def _launch(self, cfg, grid, args, kw) -> None:
        meta, warps, stages = cfg
        self.kernel[grid(meta)](*args, **meta, num_warps=warps, num_stages=stages, **kw)

    def __call__(self, key, grid, args, kw) -> None:
        cfg = self.best.get(key)
        if cfg is None:
            timed = {}
            for i, c in enumerate(self.configs):
                try:
                    self._launch(c, grid, args, kw)
                    timed[i] = triton.testing.do_bench(
                        lambda c=c: self._launch(c, grid, args, kw), warmup=5, rep=25)
                except Exception:  # noqa: BLE001 - not buildable here: not a candidate
                    continue
            if not timed:
                raise RuntimeError(f"no configuration of {self.kernel.fn.__name__} builds "
                                   f"for {key}")
            cfg = self.best[key] = self.configs[min(timed, key=timed.get)]
            self.timed[key] = {str(self.configs[i][0]): round(t * 1e3, 2)
                               for i, t in timed.items()}
        self._launch(cfg, grid, args, kw)


if triton is not None:
    _qgemv_tuned = _Tuner(_qgemv_kernel, GEMV_CONFIGS)
    _qbgemm_tuned = _Tuner(_qbgemm_kernel, BGEMM_CONFIGS)


def qgemv(w: PackedLinear, x: torch.Tensor, *, ln: torch.Tensor | None = None,
          eps: float = 0.0, residual: torch.Tensor | None = None, gate_up: bool = False,
          config: QConfig | None = None) -> torch.Tensor:
    """:func:`qwen_trt.fast.gemv.gemv` for a packed weight: ``[N]`` (``N`` = rows / 2 with
    ``gate_up``)."""
    q, s, z, sn, sk, fmt, ks = _fmt_args(w)
    n = w.n // 2 if gate_up else w.n
    k = w.k
    x = x.reshape(k)
    out = torch.empty(n, dtype=x.dtype, device=x.device)
    res = residual.reshape(n) if residual is not None else out
    pdl = pdl_enabled(x.device)
    args = (q, s, z, x, out, ln if ln is not None else x, res, eps)
    kw = dict(N=n, K=k, KS=ks, SN=sn, SK=sk, FMT=fmt, NORM=ln is not None,
              RESIDUAL=residual is not None, GATE_UP=gate_up, PDL=pdl, **launch_kwargs(pdl))
    if config is None and x.device.type == "cuda":
        key = (n, k, fmt, sn, sk, ln is not None, residual is not None, gate_up, x.dtype, pdl)
        _qgemv_tuned(key, lambda meta: (triton.cdiv(n, meta["BLOCK_N"]),), args, kw)
        return out
    cfg = config or QConfig()
    _qgemv_kernel[(triton.cdiv(n, cfg.block_n),)](*args, BLOCK_N=cfg.block_n,
                                                  BK=cfg.bk or _bk(w), UNROLL=cfg.unroll,
                                                  BLOCKED=cfg.blocked, num_warps=cfg.warps,
                                                  num_stages=cfg.stages, **kw)
    return out


def qbgemm(w: PackedLinear, x: torch.Tensor, *, residual: torch.Tensor | None = None,
           gate_up: bool = False, config: QConfig | None = None) -> torch.Tensor:
    """:func:`qwen_trt.fast.bgemm.bgemm` for a packed weight: ``x [M, K]`` -> ``[M, N]``."""
    q, s, z, sn, sk, fmt, ks = _fmt_args(w)
    n = w.n // 2 if gate_up else w.n
    k = w.k
    m = x.shape[0]
    if not x.is_contiguous() or x.shape[1] != k:
        raise ValueError("qbgemm needs a contiguous x [M, K]")
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    res = residual if residual is not None else out
    pdl = pdl_enabled(x.device)
    args = (q, s, z, x, out, res, m)
    kw = dict(N=n, K=k, KS=ks, SN=sn, SK=sk, BLOCK_M=max(16, triton.next_power_of_2(m)),
              FMT=fmt, RESIDUAL=residual is not None, GATE_UP=gate_up,
              IEEE=x.dtype == torch.float32, PDL=pdl, **launch_kwargs(pdl))
    if config is None and x.device.type == "cuda":
        key = (n, k, fmt, sn, sk, kw["BLOCK_M"], residual is not None, gate_up, x.dtype, pdl)
        _qbgemm_tuned(key, lambda meta: (triton.cdiv(n, meta["BLOCK_N"]),), args, kw)
        return out
    cfg = config or QConfig(block_n=16)
    _qbgemm_kernel[(triton.cdiv(n, cfg.block_n),)](*args, BLOCK_N=cfg.block_n,
                                                   BK=cfg.bk or _bk(w), num_warps=cfg.warps,
                                                   num_stages=cfg.stages, **kw)
    return out


def dequantize(w: PackedLinear, dtype: torch.dtype, block_n: int = 32) -> torch.Tensor:
    """The dense ``[N, K]`` weights in ``dtype`` (one Triton kernel; the same values as
    :meth:`PackedLinear.dequantize`)."""
    q, s, z, sn, sk, fmt, ks = _fmt_args(w)
    out = torch.empty(w.n, w.k, dtype=dtype, device=q.device)
    bk = _bk(w)
    _dequant_kernel[(triton.cdiv(w.n, block_n), triton.cdiv(w.k, bk))](
        q, s, z, out, N=w.n, K=w.k, KS=ks, SN=sn, SK=sk, BLOCK_N=block_n, BK=bk, FMT=fmt,
        num_warps=4)
    return out
