"""The sweep's tensor-core batch-1 GEMV for packed weights (``QConfig(dot=True)``, issue 26;
swept by :mod:`qwen_trt.bench.qkernel_sweep`, compiled by ``scripts/qkernel_sass.py``; measured
slower than the table's forms, so no table entry selects it and
:func:`qwen_trt.fast.kernels.qkernels.qgemv` does not run it).

:func:`dq_gemv` is the same batch-1 product as ``qgemv`` on the tensor cores, built for bytes in
flight rather than instructions: each program takes a ``BLOCK_N``-row block (and a
``1 / split`` share of K) and loops over steps of whole scale blocks / groups in a
``tl.range(num_stages=...)`` loop, which Triton software-pipelines: the weight tiles are copied
to shared memory with ``cp.async`` ``stages - 1`` steps ahead (24-48 KB a program, in no
registers), the upcast tile is the A operand of ``wgmma`` (64-row blocks) or ``mma.sync``
(16/32) and the activations column 0 of a ``[block, 16]`` B operand. Every fusion (RMSNorm
prologue, residual, ``silu(gate) * up``); split-K partials finish in the GEMM's
``_mm_finish_kernel``.
"""
from __future__ import annotations

import torch

from qwen_trt.fast.kernels.pdl import launch_kwargs, pdl_enabled
from qwen_trt.fast.kernels.qkernels import FMT_DENSE, FMT_FP8, QConfig, _fmt_args
from qwen_trt.fast.model.qformats import PackedLinear

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None


if triton is not None:
    from qwen_trt.fast.kernels.kernel_parts import store_rows
    from qwen_trt.fast.kernels.pdl import gdc_launch_dependents, gdc_wait
    from qwen_trt.fast.kernels.qkernel_parts import _norm_x, _x_rstd
    from qwen_trt.fast.kernels.qkernels_gemm import _mm_finish_kernel

    # one L2 prefetch of the 128-byte line at a pointer (no registers held, nothing waited on)
    _PREFETCH_L2 = tl.constexpr("prefetch.global.L2 [$1];\nmov.u32 $0, 0;")

    @triton.jit
    def _dq_dot(w, x, IEEE: tl.constexpr):
        """``w [BLOCK_N, k] @ x [k, 16]`` in float32."""
        if IEEE:
            return tl.dot(w, x, input_precision="ieee")
        else:
            return tl.dot(w, x)

    @triton.jit
    def _dq_block(q_ptr, s_ptr, z_ptr, x_ptr, ln_ptr, rows, row_ok, b, acc, rstd,
                  K: tl.constexpr, KS: tl.constexpr, SN: tl.constexpr, SK: tl.constexpr,
                  FMT: tl.constexpr, NORM: tl.constexpr, IEEE: tl.constexpr,
                  dt: tl.constexpr):
        """``acc [BLOCK_N, 16]`` plus scale block / group ``b``'s products of ``rows`` (clamped
        to the matrix: rows past it and blocks past K, ``b >= KS``, load real weights and
        get scale 0): the weights are the dot's A operand (``BLOCK_N`` rows by the block's
        ``SK`` columns), the activations column 0 of a ``[SK, 16]`` B operand (columns 1..15
        zero), so every column of ``acc`` but the first stays zero. FP8: the block's
        products scaled once per row (float32). INT4: one 16-column dot per nibble position
        ``i`` (the columns ``8c + i`` of the group) and ``s * (dot - z * sum(x))``. The
        weights load without a mask where K is whole blocks, so Triton may copy them to
        shared memory asynchronously (a mask along K would make every byte its own load)."""
        c = tl.arange(0, 16)
        c0 = (c == 0)[None, :]
        bc = tl.minimum(b, KS - 1)
        b_ok = (tl.zeros([1], tl.int32) + b) < KS     # a [1] mask (a scalar bool in a tensor
                                                       # mask is an integer to the interpreter)
        if FMT == 0:
            kk = bc * SK + tl.arange(0, SK)
            # loaded as float8e4nv: the load feeds the dot through one upcast
            q8 = q_ptr.to(tl.pointer_type(tl.float8e4nv))
            wp = q8 + rows[:, None] * K + kk[None, :]
            if K % SK == 0:
                raw = tl.load(wp)
                xm = c0
            else:
                raw = tl.load(wp, mask=(kk < K)[None, :], other=0.0)
                xm = (kk < K)[:, None] & c0
            w = raw.to(dt)      # exact in bf16 / fp32
            xv = _norm_x(x_ptr, ln_ptr, kk[:, None] + c[None, :] * 0, xm, rstd, dt,
                         NORM).to(dt)
            s = tl.load(s_ptr + (rows // SN) * KS + bc, mask=row_ok & b_ok, other=0.0)
            acc += _dq_dot(w, xv, IEEE) * s[:, None]
        else:
            W: tl.constexpr = SK // 8
            j = bc * W + tl.arange(0, W)
            raw = tl.load(q_ptr + rows[:, None] * (K // 8) + j[None, :])
            xo = (j * 8)[:, None] + c[None, :] * 0
            d = tl.zeros(acc.shape, tl.float32)
            xs = tl.zeros([16], tl.float32)
            for i in tl.static_range(8):
                xi = _norm_x(x_ptr, ln_ptr, xo + i, c0, rstd, dt, NORM)
                qi = ((((raw >> (4 * i)) & 15) | 0x4B000000).to(tl.float32, bitcast=True)
                      - 8388608.0)
                if W >= 16:
                    d += _dq_dot(qi.to(dt), xi.to(dt), IEEE)
                else:    # too narrow for tl.dot (groups < 128 columns: small test models)
                    d += tl.sum(qi[:, :, None] * xi[None, :, :], 1)
                xs += tl.sum(xi, 0)
            g = rows * KS + bc
            gm = row_ok & b_ok
            s = tl.load(s_ptr + g, mask=gm, other=0.0).to(tl.float32)
            z = tl.load(z_ptr + g, mask=gm, other=0).to(tl.float32)
            acc += (d - z[:, None] * xs[None, :]) * s[:, None]
        return acc

    @triton.jit
    def _dq_prefetch(q_ptr, rows, row_ok, t0, K: tl.constexpr, SK: tl.constexpr,
                     NSB: tl.constexpr, FMT: tl.constexpr, LINES: tl.constexpr):
        """L2 prefetches of ``LINES`` 128-byte weight lines of each of ``rows`` from step
        ``t0`` on."""
        ROWB: tl.constexpr = K if FMT == 0 else K // 2            # bytes of a row
        STEPB: tl.constexpr = NSB * SK if FMT == 0 else NSB * SK // 2
        off = t0 * STEPB + tl.arange(0, LINES) * 128
        q8 = q_ptr.to(tl.pointer_type(tl.uint8))
        p = q8 + rows[:, None].to(tl.int64) * ROWB + off[None, :]
        ok = row_ok[:, None] & (off < ROWB)[None, :]
        p = tl.where(ok, p, q8)       # masked-off lines: the tensor's first line (harmless)
        d = tl.inline_asm_elementwise(_PREFETCH_L2, "=r,l", [p], dtype=tl.int32,
                                      is_pure=False, pack=1)
        return d

    @triton.jit
    def _dq_gemv_kernel(q_ptr, s_ptr, z_ptr, x_ptr, out_ptr, ln_ptr, res_ptr, part_ptr, eps,
                        N: tl.constexpr, K: tl.constexpr, KP: tl.constexpr,
                        KS: tl.constexpr, SN: tl.constexpr, SK: tl.constexpr,
                        FMT: tl.constexpr, BLOCK_N: tl.constexpr, NSB: tl.constexpr,
                        SPLIT: tl.constexpr, STAGES: tl.constexpr, NORM: tl.constexpr,
                        RESIDUAL: tl.constexpr, GATE_UP: tl.constexpr, PDL: tl.constexpr,
                        IEEE: tl.constexpr, L2LINES: tl.constexpr = 0):
        """Batch 1 on the tensor cores, for bytes in flight: program ``pid`` takes row block
        ``pid // SPLIT`` (``BLOCK_N`` rows, and their up rows ``N`` further on with
        ``GATE_UP``) and K share ``pid % SPLIT``, a loop of steps of ``NSB`` scale blocks /
        groups (``NSB * SK`` columns) that Triton software-pipelines ``STAGES`` deep (the
        weight tiles go to shared memory by asynchronous copies, ``STAGES - 1`` steps ahead,
        holding no registers). ``SPLIT > 1``: float32 partials ``[SPLIT, N]`` (gate_up:
        ``[SPLIT, 2N]``) for :func:`_mm_finish_kernel`; else the finished rows.
        ``L2LINES``: that many 128-byte lines of each row's weights (from its share's start)
        prefetched into L2 before the PDL wait."""
        T: tl.constexpr = (KS + NSB - 1) // NSB             # steps along K
        TS: tl.constexpr = (T + SPLIT - 1) // SPLIT         # steps per program
        pid = tl.program_id(0)
        rb = pid // SPLIT
        sp = pid % SPLIT
        t0 = sp * TS
        rows = rb * BLOCK_N + tl.arange(0, BLOCK_N)
        row_ok = rows < N
        rows = tl.minimum(rows, N - 1)        # unmasked weight loads (see _dq_block)
        dt = x_ptr.dtype.element_ty
        if L2LINES > 0:
            _dq_prefetch(q_ptr, rows, row_ok, t0, K, SK, NSB, FMT, L2LINES)
            if GATE_UP:
                _dq_prefetch(q_ptr, rows + N, row_ok, t0, K, SK, NSB, FMT, L2LINES)
        if PDL:
            gdc_launch_dependents()
            gdc_wait()
        rstd = 0.0
        if NORM:
            rstd = _x_rstd(x_ptr, K, KP, eps)
        acc = tl.zeros([BLOCK_N, 16], tl.float32)
        acc2 = tl.zeros([BLOCK_N, 16], tl.float32)
        for i in tl.range(0, TS, num_stages=STAGES):
            for jb in tl.static_range(NSB):
                b = (t0 + i) * NSB + jb
                acc = _dq_block(q_ptr, s_ptr, z_ptr, x_ptr, ln_ptr, rows, row_ok, b, acc, rstd,
                                K, KS, SN, SK, FMT, NORM, IEEE, dt)
                if GATE_UP:
                    acc2 = _dq_block(q_ptr, s_ptr, z_ptr, x_ptr, ln_ptr, rows + N, row_ok, b,
                                     acc2, rstd, K, KS, SN, SK, FMT, NORM, IEEE, dt)
        y = tl.sum(acc, 1)
        u = tl.sum(acc2, 1)
        if SPLIT > 1:
            NOUT: tl.constexpr = 2 * N if GATE_UP else N
            tl.store(part_ptr + sp * NOUT + rows, y, mask=row_ok)
            if GATE_UP:
                tl.store(part_ptr + sp * NOUT + N + rows, u, mask=row_ok)
        else:
            store_rows(y, u, rows, row_ok, res_ptr, out_ptr, dt, GATE_UP, RESIDUAL)


def _dq_plan(fmt: int, n: int, k: int, ks: int, sk: int, sn: int, cfg: QConfig, *,
             norm: bool, residual: bool, gate_up: bool, pdl: bool, cuda: bool,
             ieee: bool = False) -> tuple[int, dict]:
    """(grid, constexpr arguments) of one :func:`_dq_gemv_kernel` launch: at least 16 rows a
    block (``tl.dot``), whole scale blocks / groups a step, at most one program per step
    along K."""
    nsb = max(1, cfg.bk // sk)
    bn = max(16, cfg.block_n)
    split = max(1, min(cfg.split, -(-ks // nsb)))
    step_bytes = nsb * sk if fmt == FMT_FP8 else nsb * sk // 2
    l2lines = (triton.next_power_of_2(max(1, cfg.l2pre * step_bytes // 128))
               if cfg.l2pre else 0)
    kw = dict(N=n, K=k, KP=triton.next_power_of_2(k), KS=ks, SN=sn, SK=sk, FMT=fmt,
              BLOCK_N=bn, NSB=nsb, SPLIT=split, STAGES=cfg.stages, NORM=norm,
              RESIDUAL=residual, GATE_UP=gate_up, PDL=pdl, IEEE=ieee,
              L2LINES=l2lines if cuda else 0)
    return triton.cdiv(n, bn) * split, kw


def gemv_plan(fmt: int, n: int, k: int, ks: int, sk: int, sn: int, cfg: QConfig, *,
              norm: bool, residual: bool, gate_up: bool, pdl: bool, cuda: bool, **_):
    """(kernel, constexpr arguments) of one launch, like ``qkernels._gemv_plan`` (what
    ``scripts/qkernel_sass.py`` compiles)."""
    return _dq_gemv_kernel, _dq_plan(fmt, n, k, ks, sk, sn, cfg, norm=norm,
                                     residual=residual, gate_up=gate_up, pdl=pdl,
                                     cuda=cuda)[1]


def dq_gemv(w: PackedLinear, x: torch.Tensor, *, ln: torch.Tensor | None = None,
            eps: float = 0.0, residual: torch.Tensor | None = None, gate_up: bool = False,
            config: QConfig) -> torch.Tensor:
    """:func:`qwen_trt.fast.kernels.qkernels.qgemv` in the tensor-core form (``config.dot``):
    ``[N]`` (``N`` = rows / 2 with ``gate_up``)."""
    q, s, z, sn, sk, fmt, ks = _fmt_args(w)
    if fmt == FMT_DENSE:
        raise TypeError("dq_gemv takes packed weights (dense ones: gemv)")
    if not config.dot:
        raise ValueError("dq_gemv runs QConfig(dot=True) only (the others: qgemv)")
    cfg = config
    n = w.n // 2 if gate_up else w.n
    k = w.k
    x = x.reshape(k)
    out = torch.empty(n, dtype=x.dtype, device=x.device)
    res = residual.reshape(n) if residual is not None else out
    pdl = pdl_enabled(x.device)
    lnp = ln if ln is not None else x
    grid, kw = _dq_plan(fmt, n, k, ks, sk, sn, cfg, norm=ln is not None,
                        residual=residual is not None, gate_up=gate_up, pdl=pdl,
                        cuda=x.device.type == "cuda", ieee=x.dtype == torch.float32)
    split = kw["SPLIT"]
    part = (torch.empty(split, 2 * n if gate_up else n, dtype=torch.float32,
                        device=x.device) if split > 1 else out)
    _dq_gemv_kernel[(grid,)](q, s, z, x, out, lnp, res, part, eps, num_warps=cfg.warps,
                             **kw, **launch_kwargs(pdl))
    if split > 1:
        block = 1024
        _mm_finish_kernel[(triton.cdiv(n, block),)](
            part, out, res, 1, N=n, SPLIT=split, BLOCK=block,
            RESIDUAL=residual is not None, GATE_UP=gate_up, PDL=pdl, num_warps=4,
            **launch_kwargs(pdl))
    return out
