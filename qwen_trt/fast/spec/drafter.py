"""EAGLE-3 in the step: after each step the draft catches up on the positions the target just
computed, then drafts the next step's tokens (a greedy chain).

The target step keeps the hidden states entering the draft's aux layers for every row
(:meth:`~qwen_trt.fast.step.batched.BatchedModel.capture_aux`). A draft row at position ``t``
reads ``(x_{t+1}, aux_t)`` and predicts ``x_{t+2}`` (:mod:`qwen_trt.fast.spec.eagle3`), so after
a step each row of a sequence runs the draft over the positions whose KV the step made valid:

* a prefill chunk: its positions (the last one's next token is the next chunk's first, or the
  token sampled when the chunk ends the prompt; until then it waits);
* a verify row: the last accepted token's position and the accepted drafts' (the next token of
  the last is the one the step sampled);
* a decode row: its one position.

Then, from the last of them, ``k`` greedy draft steps give the next step's drafts. Draft
proposals are deterministic (acceptance treats them as such: exact for any draft). The draft's
KV cache has one slot per sampler row of the runner (a request's row); a rejected draft's
entries are overwritten when their positions come again. Prompt positions served by the prefix
cache were never computed, so the draft has no KV for them: acceptance is lower on reused
prefixes, the tokens exact either way.
"""
from __future__ import annotations

from collections.abc import Mapping

import torch

from qwen_trt.fast.spec.eagle3 import Eagle3Draft
from qwen_trt.fast.step.plan import RowOutput, StepPlan

WIDTH_STEP = 256          # the draft attention reads the first multiple of this covering a row


class EagleDrafter:
    """An :class:`Eagle3Draft` driven by a batched model's steps (module docstring)."""

    def __init__(self, draft: Eagle3Draft, model, slots: int, k: int) -> None:
        self.draft = draft
        self.model = model
        self.k = k
        self.cache = draft.new_cache(slots, model.max_seq_len + k + 2)
        # sampler row -> (its aux row, position): a mid-prompt chunk's last position, waiting
        # for the token that follows it (the next chunk's first)
        self.pending: dict[int, tuple[torch.Tensor, int]] = {}
        model.capture_aux(draft.aux_ids)

    def forget(self, slot: int) -> None:
        self.pending.pop(slot, None)

    @torch.inference_mode()
    def after_step(self, plan: StepPlan, out: Mapping[int, RowOutput]) -> dict[int, tuple[int, ...]]:
        """The next step's drafts per request id (module docstring) after ``plan`` ran with
        outputs ``out``."""
        aux = self.model.aux(plan.tokens)
        dev = aux.device
        ids: list[int] = []
        rows: list[int] = []              # aux row of each draft row (-1 - i: pending[i])
        pos: list[int] = []
        seqs: list[int] = []
        pend: list[torch.Tensor] = []
        last: list[int] = []
        chain_rids: list[int] = []
        at = 0
        for r in plan.rows:
            res = out.get(r.rid)
            emitted = res.tokens if res is not None else ()
            slot = r.sampler_row
            p = self.pending.pop(slot, None)
            if p is not None:             # the previous chunk's last position: its next token
                pend.append(p[0])
                rows.append(-len(pend))
                ids.append(r.tokens[0])
                pos.append(p[1])
                seqs.append(slot)
            valid = r.valid + (res.accepted if res is not None else 0)
            nxt = list(r.tokens[1:valid]) + list(emitted[-1:])
            for j, tok in enumerate(nxt):
                rows.append(at + j)
                ids.append(tok)
                pos.append(r.start + j)
                seqs.append(slot)
            if not emitted and r.logits == 0:          # mid-prompt: the last waits
                self.pending[slot] = (aux[at + r.n - 1].clone(), r.start + r.n - 1)
            elif emitted and nxt:
                last.append(len(ids) - 1)
                chain_rids.append(r.rid)
            at += r.n
        if not ids:
            return {}
        idx = torch.tensor([max(x, 0) for x in rows], dtype=torch.long, device=dev)
        hidden = aux.index_select(0, idx)
        if pend:
            stacked = torch.stack(pend)
            for i, x in enumerate(rows):
                if x < 0:
                    hidden[i] = stacked[-x - 1]
        t = lambda v: torch.tensor(v, dtype=torch.long, device=dev)  # noqa: E731
        width = -(-(max(pos) + self.k + 2) // WIDTH_STEP) * WIDTH_STEP
        width = min(width, self.cache.max_len)
        embed = self.model.model.embed
        if not last:
            self.draft.forward(t(ids), hidden, t(pos), t(seqs), self.cache, embed, width)
            return {}
        # one more draft than the rows now verify (the scheduler's adaptive count moves by
        # steps): a row that stopped drafting is probed with one, a rising one can grow
        k = min(self.k, max([0] + [r.draft for r in plan.rows]) + 1)
        drafts = self.draft.propose_chain(t(ids), hidden, t(pos), t(seqs), self.cache, embed,
                                          k, last=t(last), width=width).tolist()
        return {rid: tuple(d) for rid, d in zip(chain_rids, drafts)}
