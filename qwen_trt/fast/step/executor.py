"""The model side of a step: a :class:`~qwen_trt.fast.step.plan.StepPlan` in, a
:class:`~qwen_trt.fast.step.plan.StepOutput` out.

:class:`StepExecutor` turns a plan's rows into the batched model's flat inputs
(:class:`~qwen_trt.fast.step.batched.BatchedModel`), runs the step (a decode graph per batch
bucket when every row is one token, else the varlen step: prefill chunks, verify rows and decode
rows together), and picks tokens with each row's settings (:mod:`qwen_trt.fast.step.sampling`):

* a row with one logit position: one token, the shared sampler over its sampler row (settings,
  penalties, grammar mask, logprobs);
* a verify row (``draft`` drafted tokens, ``draft + 1`` positions scored): the longest prefix of
  the drafts the target accepts, then one more token. Greedy rows accept while a draft equals the
  target's argmax; sampled rows accept by rejection sampling (:mod:`qwen_trt.fast.spec.rejection`)
  against the target's probabilities after every sampler feature, so the distribution of what is
  emitted is the target's.

Decode steps of the same rows chain (:meth:`StepExecutor.launch` / :meth:`chain` /
:meth:`collect` / :meth:`pick_chained`): each step's tokens stay on the device as the next step's
inputs, and the host reads step ``n`` while step ``n + 1`` runs. Which steps chain is the
scheduler's call; how is here.
"""
from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

import torch

from qwen_trt.fast.step.batched import BatchedModel, SeqChunk
from qwen_trt.fast.step.plan import RowOutput, StepOutput, StepPlan, StepRow
from qwen_trt.fast.step.sampling import (Picked, SamplerState, pick_rows, pick_rows_device,
                                         sampler_kind, verify_rows)


@dataclass(eq=False)
class Inflight:
    """A chained decode step launched but not yet read back: its rows, the handle of its tokens'
    copy to the host, and the sampler's picks (None: the graph's argmax)."""

    rows: tuple[StepRow, ...]
    handle: tuple[int, int]
    picked: Picked | None = None


class StepExecutor:
    """Runs plans on a :class:`BatchedModel` with a :class:`SamplerState` (module docstring).
    Thread-confined, like the runner that owns it."""

    def __init__(self, model: BatchedModel, sampler: SamplerState) -> None:
        self.model = model
        self.sampler = sampler
        self._mask_host: torch.Tensor | None = None
        # benchmarks only (qwen_trt.bench.speculative): how many drafts a greedy verify row
        # accepts, decided by the bench instead of the target (the step's cost is the same)
        self.forced_accept = None
        # a draft model run after every step (EAGLE-3: fast.spec.drafter.EagleDrafter); its
        # steps need the target's hidden states, so every step then takes the varlen path
        self.drafter = None

    # ---- one step, read back at once --------------------------------------------------------
    @torch.inference_mode()
    def run(self, plan: StepPlan, live: Collection[int] | None = None) -> StepOutput:
        """Compute ``plan`` and pick every row's tokens; ``live``: the request ids whose grammar
        state may be read (None: all)."""
        toks, pos, logit_rows = plan.flat()
        m = self.model
        if plan.decode_only and self.drafter is None:
            logits = m.decode(toks, pos, [r.table for r in plan.rows])
        else:
            chunks, at = [], 0
            for r in plan.rows:
                chunks.append(SeqChunk(at, r.n, r.ctx, r.table))
                at += r.n
            logits = m.forward(toks, pos, chunks, logit_rows)
        plain: list[tuple[int, StepRow]] = []      # (its logit row, row)
        verify: list[tuple[int, StepRow]] = []     # (its first logit row, row)
        at = 0
        for r in plan.rows:
            if r.draft:
                verify.append((at, r))
            elif r.logits:
                plain.append((at + r.logits - 1, r))
            at += r.logits
        out: dict[int, RowOutput] = {}
        if plain:
            rows = [r for _, r in plain]
            sel = logits
            if len(plain) != logits.shape[0]:      # verify rows beside: this row's last position
                from qwen_trt.fast.step.sampling import device_index

                sel = logits.index_select(0, device_index([i for i, _ in plain], logits.device))
            picks, lps = pick_rows(self.sampler, sel, [r.sampler_row for r in rows],
                                   [r.params for r in rows], self._masks(rows, live))
            for r, tok, lp in zip(rows, picks, lps):
                out[r.rid] = RowOutput(r.rid, (tok,), 0, (lp,) if lp is not None else ())
        if verify:
            rows = [r for _, r in verify]
            for r, (toks_r, acc, lps) in zip(rows, verify_rows(
                    self.sampler, logits, [i for i, _ in verify], rows, self.forced_accept)):
                out[r.rid] = RowOutput(r.rid, tuple(toks_r), acc, tuple(lps))
        if self.drafter is not None:
            for rid, drafts in self.drafter.after_step(plan, out).items():
                o = out[rid]
                out[rid] = RowOutput(o.rid, o.tokens, o.accepted, o.logprobs, drafts)
        return StepOutput(tuple(out[r.rid] if r.rid in out else RowOutput(r.rid)
                                for r in plan.rows))

    # ---- chained decode ---------------------------------------------------------------------
    def can_chain(self, plan: StepPlan) -> bool:
        """Whether ``plan`` (a decode step) may run chained (CUDA graphs of its width)."""
        return (plan.decode_only and bool(plan.rows) and self.drafter is None
                and self.model.can_chain(len(plan.rows)))

    @torch.inference_mode()
    def launch(self, plan: StepPlan, live: Collection[int] | None = None) -> Inflight:
        """Launch a decode step whose tokens stay on the device (nothing waits here)."""
        rows = plan.rows
        self.model.decode_launch([r.tokens[0] for r in rows], [r.start for r in rows],
                                 [r.table for r in rows])
        return self._emit(rows, live)

    @torch.inference_mode()
    def chain(self, inf: Inflight, grown: dict[int, Sequence[int]]) -> None:
        """Launch the next step of ``inf``'s rows behind it, its inputs the tokens in flight;
        ``grown``: row index -> block table, for rows whose table grew."""
        self.model.decode_chain(len(inf.rows), grown)

    def collect(self, inf: Inflight) -> StepOutput:
        """Wait for ``inf``'s tokens and read them (and their logprobs) back."""
        toks = self.model.decode_result(inf.handle)
        lps = inf.picked.result(toks) if inf.picked is not None else None
        return StepOutput(tuple(
            RowOutput(r.rid, (t,), 0, (lps[i],) if lps is not None and lps[i] is not None
                      else ()) for i, (r, t) in enumerate(zip(inf.rows, toks))))

    @torch.inference_mode()
    def pick_chained(self, inf: Inflight, live: Collection[int]) -> Inflight:
        """The picks of the step chained behind ``inf`` (called once ``inf``'s tokens were
        applied, so each grammar's mask is as of its last accepted token)."""
        return self._emit(inf.rows, live)

    def _emit(self, rows: tuple[StepRow, ...], live: Collection[int] | None) -> Inflight:
        """The tokens of the decode step just launched or chained: the graph's argmax when every
        row is plain greedy, else the rows' sampler queued behind the step on the device; their
        copy to the host queued too. A row that left while in flight is picked for and ignored."""
        b = len(rows)
        m = self.model
        if all(sampler_kind(r.params) == "greedy" for r in rows):
            return Inflight(rows, m.decode_emit(b))
        picked = pick_rows_device(self.sampler, m.decode_logits(b), [r.sampler_row for r in rows],
                                  [r.params for r in rows], self._masks(rows, live))
        picked.stage()
        return Inflight(rows, m.decode_emit(b, picked.tokens), picked)

    def forget(self, slot: int) -> None:
        """The request on sampler row ``slot`` left (the drafter's state for it goes)."""
        if self.drafter is not None:
            self.drafter.forget(slot)

    # ---- grammar masks: filled on the host while the step runs on the GPU ---------------------
    def _masks(self, rows: Sequence[StepRow], live: Collection[int] | None) -> torch.Tensor | None:
        """int32 ``[len(rows), words]`` grammar masks (all ones for unconstrained rows and rows
        that left), or None when no row is constrained."""
        if all(r.constraint is None for r in rows):
            return None
        st = self.sampler
        if self._mask_host is None:
            self._mask_host = torch.empty(st.mask.shape, dtype=torch.int32,
                                          pin_memory=st.mask.is_cuda)
        host = self._mask_host[:len(rows)]
        host.fill_(-1)
        for i, r in enumerate(rows):
            if r.constraint is not None and (live is None or r.rid in live):
                r.constraint.fill(host[i])
        return host
