"""The one token sampler of both torch paths (the HF ``torch`` backend and the fast decoder).

It can live inside a CUDA graph: no host syncs and no RNG calls when a token is picked. Request
settings sit in small device buffers with one ROW per request (temperature, top-p, top-k,
min-p, penalties, the pre-drawn random numbers, the step, the tokens generated so far, the
grammar mask), so a batched decoder picks a token for every row in one call, and one seed gives
the same tokens on either path.

Per row, in order:

1. penalties over the tokens GENERATED so far in this request (not the prompt: a chat prompt is
   the whole conversation plus template tokens, which a reply may and must repeat):
   ``repetition_penalty`` with Hugging Face semantics (a seen token's logit is divided by it when
   positive, multiplied when negative), then ``presence_penalty`` subtracted once per distinct
   seen token and ``frequency_penalty`` once per time it was generated (OpenAI semantics),
   then ``logit_bias`` added (OpenAI's, -100..100 per token id). Neutral values (1.0, 0.0, no
   bias) leave logits untouched;
2. the grammar mask (kind ``+mask``): tokens the row's grammar does not allow next get -inf
   (``SamplerState.mask``, xgrammar's bitmask layout, written by the host before the step;
   unconstrained rows hold all ones);
3. logprobs (kind ``+logprobs``): the log-softmax of these logits, the chosen token's and the
   top 20 (``SamplerState.lp_*``), before temperature and the filters;
4. temperature 0 is greedy (argmax);
5. otherwise temperature, top-k, min-p (tokens below ``min_p`` x the top token's probability
   dropped), then the top-p nucleus (a token is dropped when the mass before it already
   reaches top_p; the top token always stays), and inverse-CDF sampling with the row's
   pre-drawn uniform for this step (drawn at request start from its seeded generator).
"""
from __future__ import annotations

import torch

from collections.abc import Sequence

from qwen_trt.params import MAX_TOP_LOGPROBS, SamplingParams, TokenLogprob

# "greedy" | "topk" | "full", then the flags in FLAGS order: "+penalties" (a row uses
# penalties), "+mask" (a row is constrained by a grammar), "+logprobs" (a row wants logprobs)
Kind = str
TOPK_CAP = 64   # top_k up to this uses a cheap topk; larger (or 0 = off) sorts the whole vocab
PENALTIES = "+penalties"
MASK = "+mask"
LOGPROBS = "+logprobs"
FLAGS = (PENALTIES, MASK, LOGPROBS)
BASES = ("greedy", "topk", "full")


def sampler_kind(params: SamplingParams) -> Kind:
    """The kind of pick (one CUDA graph each) that serves ``params``."""
    base = "greedy" if params.greedy else "topk" if 0 < params.top_k <= TOPK_CAP else "full"
    return base + "".join(f for f, on in zip(FLAGS, (
        params.penalized, params.grammar is not None, params.logprobs is not None)) if on)


def split_kind(kind: Kind) -> tuple[str, frozenset[str]]:
    """``"topk+mask"`` -> ``("topk", {"+mask"})``."""
    base, *flags = kind.split("+")
    return base, frozenset("+" + f for f in flags)


def join_kinds(kinds: Sequence[Kind]) -> Kind:
    """The one kind that serves rows of all ``kinds`` in one pick (greedy rows in a sampling
    kind have temperature 0 in their row)."""
    parts = [split_kind(k) for k in kinds]
    base = BASES[max(BASES.index(b) for b, _ in parts)]
    flags = frozenset().union(*(f for _, f in parts))
    return base + "".join(f for f in FLAGS if f in flags)


def make_generator(params: SamplingParams, device: torch.device | str) -> torch.Generator | None:
    """The request's random generator: seeded with ``params.seed``, else from OS entropy."""
    if params.greedy:
        return None
    g = torch.Generator(device=device)
    if params.seed is None:
        g.seed()
    else:
        g.manual_seed(params.seed)
    return g


class SamplerState(torch.nn.Module):
    """Sampling settings, random numbers and generated-token sets of ``rows`` requests, as fixed
    device buffers (safe to capture in a CUDA graph)."""

    def __init__(self, max_tokens: int, vocab: int, device, rows: int = 1,
                 speculative: bool = False) -> None:
        """``speculative``: a second stream of pre-drawn uniforms per row, for the verify
        rows' rejection sampling (:func:`verify_rows`)."""
        super().__init__()

        def buf(name: str, *shape: int, dtype=torch.float32, fill=0) -> None:
            self.register_buffer(name, torch.full(shape, fill, dtype=dtype, device=device))

        buf("temperature", rows)
        buf("top_p", rows, fill=1)
        buf("top_k", rows, dtype=torch.long, fill=vocab)
        buf("min_p", rows)
        buf("presence", rows)
        buf("repetition", rows, fill=1)
        buf("frequency", rows)
        buf("uniforms", rows, max_tokens)
        buf("uniforms2", rows, max_tokens if speculative else 1)
        buf("step", rows, dtype=torch.long)
        buf("seen", rows, vocab, dtype=torch.bool)
        buf("counts", rows, vocab)                              # times generated (frequency)
        buf("bias", rows, vocab)                              # logit_bias (with the penalties)
        buf("mask", rows, (vocab + 31) // 32, dtype=torch.int32, fill=-1)   # grammar bitmask
        buf("lp_token", rows)                                   # logprob of the chosen token
        buf("lp_top", rows, MAX_TOP_LOGPROBS)                   # the top logprobs...
        buf("lp_top_id", rows, MAX_TOP_LOGPROBS, dtype=torch.long)   # ...and their ids
        self.register_buffer("bit", torch.arange(32, dtype=torch.int32, device=device))
        # the value of ``seen[rows, tokens] = True`` as a device scalar: a Python True is copied
        # from pageable host memory on every step, which waits for the stream
        self.register_buffer("true", torch.ones((), dtype=torch.bool, device=device))

    def set(self, params: SamplingParams, row: int = 0) -> None:
        """Load ``params`` into ``row`` for a new request: step 0, nothing generated yet."""
        self.step[row] = 0
        self.seen[row] = False
        self.counts[row] = 0
        self.bias[row] = 0
        if params.logit_bias:
            ids, values = zip(*params.logit_bias)
            self.bias[row, torch.tensor(ids, dtype=torch.long, device=self.bias.device)] = \
                torch.tensor(values, dtype=torch.float32, device=self.bias.device)
        self.mask[row] = -1
        self.temperature[row] = 0.0 if params.greedy else params.temperature
        self.top_p[row] = params.top_p
        self.top_k[row] = params.top_k if params.top_k > 0 else self.seen.shape[1]
        self.min_p[row] = params.min_p
        self.presence[row] = params.presence_penalty
        self.repetition[row] = params.repetition_penalty
        self.frequency[row] = params.frequency_penalty
        gen = make_generator(params, self.uniforms.device)
        if gen is not None:
            n = min(params.max_new_tokens, self.uniforms.shape[1])
            self.uniforms[row, :n] = torch.rand(n, generator=gen, device=self.uniforms.device)
            if self.uniforms2.shape[1] > 1:
                self.uniforms2[row, :n] = torch.rand(n, generator=gen,
                                                     device=self.uniforms.device)

    def advance(self, tokens: torch.Tensor, kind: Kind = PENALTIES) -> None:
        """Record the picked ``tokens [rows]`` (for the penalties) and move every row a step;
        the per-token counts (frequency penalty) only for a ``kind`` with penalties."""
        col = tokens.view(-1, 1)
        self.seen.scatter_(1, col, True)
        if PENALTIES in split_kind(kind)[1]:
            self.counts.scatter_add_(1, col, torch.ones_like(col, dtype=self.counts.dtype))
        self.step.add_(1)

    def penalize(self, logits: torch.Tensor) -> torch.Tensor:
        """float32 ``logits [rows, vocab]`` with each row's penalties on its generated tokens,
        then its ``logit_bias``."""
        rep = self.repetition.unsqueeze(-1)
        repeated = torch.where(logits > 0, logits / rep, logits * rep)
        out = torch.where(self.seen, repeated - self.presence.unsqueeze(-1), logits)
        return out - self.frequency.unsqueeze(-1) * self.counts + self.bias

    def apply_mask(self, logits: torch.Tensor) -> torch.Tensor:
        """float32 ``logits [rows, vocab]`` with the tokens each row's mask forbids at -inf."""
        allowed = ((self.mask.unsqueeze(-1) >> self.bit) & 1).flatten(1)[:, :logits.shape[-1]]
        return logits.masked_fill(allowed == 0, float("-inf"))

    def store_logprobs(self, logits: torch.Tensor, tokens: torch.Tensor) -> None:
        """The log-softmax of the processed ``logits``: the chosen ``tokens``' logprobs and the
        top ones, into ``lp_token`` / ``lp_top`` / ``lp_top_id``."""
        chosen, top, top_id = token_logprobs(logits, tokens, self.lp_top.shape[1])
        self.lp_token.copy_(chosen)
        self.lp_top[:, :top.shape[1]].copy_(top)
        self.lp_top_id[:, :top.shape[1]].copy_(top_id)

    def read_logprob(self, row: int, token_id: int, k: int) -> TokenLogprob:
        """Row ``row``'s stored logprobs as a :class:`TokenLogprob` with ``k`` alternatives
        (a host sync: call once the step's token is known)."""
        return logprob_of(token_id, self.lp_token[row], self.lp_top[row, :k],
                          self.lp_top_id[row, :k])


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, k: int):
    """``(chosen [rows], top [rows, k], top_ids [rows, k])`` from float32 ``logits``."""
    logp = torch.log_softmax(logits, dim=-1)
    chosen = logp.gather(1, tokens.view(-1, 1)).squeeze(1)
    top, top_id = torch.topk(logp, min(k, logp.shape[-1]), dim=-1)
    return chosen, top, top_id


def logprob_of(token_id: int, chosen, top, top_id) -> TokenLogprob:
    """A :class:`TokenLogprob` from one row's tensors (or lists); alternatives the grammar
    forbids (logprob -inf) are left out."""
    as_list = (lambda t: t.tolist() if isinstance(t, torch.Tensor) else t)
    alts = tuple((int(i), float(v)) for i, v in zip(as_list(top_id), as_list(top))
                 if v != float("-inf"))
    return TokenLogprob(int(token_id), float(as_list(chosen)), alts)


def prepare(logits: torch.Tensor, kind: Kind, st: SamplerState) -> torch.Tensor:
    """float32 ``logits`` after the penalties and the grammar mask that ``kind`` names."""
    _, flags = split_kind(kind)
    lf = logits.float()
    if PENALTIES in flags:
        lf = st.penalize(lf)
    if MASK in flags:
        lf = st.apply_mask(lf)
    return lf


def pick(logits: torch.Tensor, kind: Kind, st: SamplerState) -> torch.Tensor:
    """One token id per row (int64 ``[rows]``) from ``logits [rows, vocab]``; advances nothing.
    Kind ``+logprobs`` also stores every row's logprobs in ``st``."""
    base, flags = split_kind(kind)
    if not flags and base == "greedy":
        return torch.argmax(logits, dim=-1)
    lf = prepare(logits, kind, st)
    tokens = sample(lf, base, st)
    if LOGPROBS in flags:
        st.store_logprobs(lf, tokens)
    return tokens


def sample(lf: torch.Tensor, base: str, st: SamplerState) -> torch.Tensor:
    """Steps 4-5 of the module docstring on prepared float32 logits (``base`` of a kind)."""
    greedy = torch.argmax(lf, dim=-1)
    if base == "greedy":
        return greedy
    if base == "topk":
        vals, idx = torch.topk(lf, min(TOPK_CAP, lf.shape[-1]), dim=-1)
    else:
        vals, idx = torch.sort(lf, dim=-1, descending=True)
    temp = st.temperature.unsqueeze(-1)
    vals = vals / torch.where(temp > 0, temp, torch.ones_like(temp))
    ranks = torch.arange(vals.shape[-1], device=vals.device)
    vals = vals.masked_fill(ranks >= st.top_k.unsqueeze(-1), float("-inf"))
    probs = torch.softmax(vals, dim=-1)
    probs = probs.masked_fill(probs < st.min_p.unsqueeze(-1) * probs[..., :1], 0.0)
    min_p = st.min_p.unsqueeze(-1)
    probs = torch.where(min_p > 0, probs / probs.sum(-1, keepdim=True), probs)
    before = torch.cumsum(probs, dim=-1) - probs
    probs = probs.masked_fill(before >= st.top_p.unsqueeze(-1), 0.0)
    cum = torch.cumsum(probs, dim=-1)
    u = st.uniforms.gather(1, st.step.unsqueeze(-1)) * cum[..., -1:]
    choice = (cum < u).sum(-1).clamp(max=vals.shape[-1] - 1)
    sampled = idx.gather(-1, choice.unsqueeze(-1)).squeeze(-1)
    return torch.where(st.temperature > 0, sampled, greedy)


_ROW_BUFFERS = ("temperature", "top_p", "top_k", "min_p", "presence", "repetition", "frequency",
                "uniforms", "step", "seen", "counts", "bias", "mask", "bit")
_PENALTY_BUFFERS = ("seen", "counts", "bias")        # [rows, vocab] each


class RowsView:
    """Some rows of a :class:`SamplerState`, in the order of a step's logits rows (copies:
    :func:`pick_rows` writes the picks back)."""

    def __init__(self, st: SamplerState, idx: torch.Tensor, penalties: bool = True) -> None:
        """``penalties``: copy the vocabulary-wide penalty buffers (seen, counts, bias) too;
        a pick without penalties never reads them."""
        for name in _ROW_BUFFERS:
            if not penalties and name in _PENALTY_BUFFERS:
                continue
            t = getattr(st, name)
            setattr(self, name, t if name == "bit" else t.index_select(0, idx))

    penalize = SamplerState.penalize
    apply_mask = SamplerState.apply_mask


class Picked:
    """A step's picks still on the device (:func:`pick_rows_device`): the token ids and, for the
    rows that asked, their logprobs. :meth:`stage` queues the copies to pinned host memory so
    a later :meth:`result` (after the step's event) reads them without syncing the stream."""

    def __init__(self, tokens: torch.Tensor, params: Sequence[SamplingParams],
                 want: list[int], lp: tuple | None) -> None:
        self.tokens, self.params, self.want, self.lp = tokens, params, want, lp
        self._host: tuple | None = None

    def stage(self) -> None:
        """Queue the logprobs' copies to the host (the tokens travel with the step's own)."""
        if self.lp is not None and self.tokens.is_cuda:
            host = tuple(torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in self.lp)
            for h, t in zip(host, self.lp):
                h.copy_(t, non_blocking=True)
            self._host = host

    def result(self, tokens: Sequence[int]) -> list[TokenLogprob | None]:
        """Each row's :class:`TokenLogprob` (None where not asked) for its chosen ``tokens``;
        after :meth:`stage`, call once the step's event has completed."""
        out: list[TokenLogprob | None] = [None] * len(self.params)
        if not self.want:
            return out
        chosen, top, top_id = (t.tolist() for t in (self._host or self.lp))
        for j, i in enumerate(self.want):
            n = self.params[i].logprobs
            out[i] = logprob_of(tokens[i], chosen[j], top[j][:n], top_id[j][:n])
        return out


def device_index(values: Sequence[int], dev: torch.device) -> torch.Tensor:
    """int64 ``values`` on ``dev`` without waiting for the stream: from pinned memory with an
    asynchronous copy (``torch.tensor(values, device=cuda)`` copies from pageable memory and
    waits for every queued kernel first, which would stall a chained step behind the one in
    flight)."""
    if dev.type != "cuda":
        return torch.tensor(list(values), dtype=torch.long, device=dev)
    return torch.tensor(list(values), dtype=torch.long, pin_memory=True).to(dev, non_blocking=True)


def pick_rows_device(st: SamplerState, logits: torch.Tensor, rows: Sequence[int],
                     params: Sequence[SamplingParams], masks: torch.Tensor | None = None
                     ) -> Picked:
    """One token per row of ``logits`` for the requests ``params`` holding sampler rows
    ``rows`` (the batched runner's step), and the logprobs of those that asked, left on the
    device (nothing here waits for the GPU); advances those rows. ``masks``: int32
    ``[len(rows), words]`` grammar masks (all ones for unconstrained rows; on the host is
    fine), given when any row is constrained.

    Logprobs are computed for the rows that want them only; a step of greedy, unpenalized,
    unconstrained rows without logprobs is one argmax (their rows are not advanced: nothing
    reads them)."""
    kinds = [sampler_kind(p) for p in params]
    if all(k == "greedy" for k in kinds):       # nothing of the rows' state is read
        return Picked(torch.argmax(logits, dim=-1), params, [], None)
    want = [i for i, p in enumerate(params) if p.logprobs is not None]
    dev = logits.device
    idx = device_index(rows, dev)
    kind = join_kinds(kinds).replace(LOGPROBS, "")
    if masks is None:
        kind = kind.replace(MASK, "")
    base, flags = split_kind(kind)
    view = RowsView(st, idx, PENALTIES in flags)
    if masks is not None:
        view.mask = masks.to(dev, non_blocking=True)
    lf = prepare(logits, kind, view)
    tokens = sample(lf, base, view)
    st.seen.index_put_((idx, tokens), st.true)  # SamplerState.advance for these rows
    if PENALTIES in flags:
        st.counts[idx, tokens] += 1
    st.step[idx] += 1
    lp = None
    if want:
        sel = device_index(want, dev)
        k = max(params[i].logprobs for i in want)
        lp = token_logprobs(lf.index_select(0, sel), tokens.index_select(0, sel), max(k, 1))
    return Picked(tokens, params, want, lp)


def pick_rows(st: SamplerState, logits: torch.Tensor, rows: Sequence[int],
              params: Sequence[SamplingParams], masks: torch.Tensor | None = None
              ) -> tuple[list[int], list[TokenLogprob | None]]:
    """:func:`pick_rows_device`, read back at once: the token ids and logprobs on the host."""
    picked = pick_rows_device(st, logits, rows, params, masks)
    host = picked.tokens.tolist()
    return host, picked.result(host)


# ---- verify rows (speculative decoding) ------------------------------------------------------
def filtered_probs(lf: torch.Tensor, view) -> torch.Tensor:
    """The sampling distribution ``[rows, vocab]`` (float32) of prepared logits ``lf``: steps
    4-5 of the module docstring as probabilities in vocabulary order (temperature, top-k, min-p,
    the top-p nucleus), the distribution :func:`sample` draws from. ``view``: per-row settings
    (a :class:`SamplerState` or :class:`RowsView`, one row per row of ``lf``)."""
    vals, idx = torch.sort(lf, dim=-1, descending=True)
    temp = view.temperature.unsqueeze(-1)
    vals = vals / torch.where(temp > 0, temp, torch.ones_like(temp))
    ranks = torch.arange(vals.shape[-1], device=vals.device)
    vals = vals.masked_fill(ranks >= view.top_k.unsqueeze(-1), float("-inf"))
    probs = torch.softmax(vals, dim=-1)
    probs = probs.masked_fill(probs < view.min_p.unsqueeze(-1) * probs[..., :1], 0.0)
    before = torch.cumsum(probs / probs.sum(-1, keepdim=True), dim=-1) - probs / probs.sum(
        -1, keepdim=True)
    probs = probs.masked_fill(before >= view.top_p.unsqueeze(-1), 0.0)
    probs = probs / probs.sum(-1, keepdim=True)
    return torch.zeros_like(probs).scatter_(-1, idx, probs)


def verify_rows(st: SamplerState, logits: torch.Tensor, firsts: Sequence[int], rows,
                forced=None) -> list[tuple[list[int], int, list[TokenLogprob]]]:
    """Accept each verify row's drafts against the target (the executor's verify rows:
    ``rows[i]`` has ``draft`` drafts, its ``draft + 1`` scored positions are the logits rows
    ``firsts[i] ..``); returns per row ``(emitted tokens, accepted drafts, logprobs)`` and
    advances the rows' sampler state by the emitted tokens.

    Plain greedy rows accept while a draft is the argmax. Other rows get the target's
    distribution at every position with every sampler feature (the penalties count the drafts
    before that position as generated), then exact acceptance
    (:func:`qwen_trt.fast.spec.rejection.accept`): a greedy row accepts while the draft is the
    argmax of the processed logits; a sampled one by rejection sampling with the row's
    pre-drawn uniforms. Rows with a grammar do not draft (the scheduler's rule). ``forced``:
    benchmarks only, a callable giving the drafts a greedy row accepts (the target's choice
    replaced, at the same cost)."""
    from qwen_trt.fast.spec.rejection import accept

    dev = logits.device
    out: list[tuple[list[int], int, list[TokenLogprob]] | None] = [None] * len(rows)
    greedy = [i for i, r in enumerate(rows) if sampler_kind(r.params) == "greedy"]
    if greedy:      # one argmax over every logit row, one read back (no index upload)
        best = torch.argmax(logits, dim=-1).tolist()
        for i in greedy:
            r, k = rows[i], rows[i].draft
            top = best[firsts[i]:firsts[i] + k + 1]
            a = 0
            while a < k and r.drafts[a] == top[a]:
                a += 1
            if forced is not None:
                a = min(forced(r), k)
            out[i] = (list(r.drafts[:a]) + [top[a]], a, [])
    for i, r in enumerate(rows):
        if out[i] is not None:
            continue
        if r.constraint is not None:
            raise ValueError(f"request {r.rid}: a constrained row cannot verify drafts")
        k, row = r.draft, r.sampler_row
        lf = logits[firsts[i]:firsts[i] + k + 1].float()
        drafts = torch.tensor(r.drafts, dtype=torch.long, device=dev)
        # penalties at position j: the tokens generated so far plus drafts[:j]
        seen = st.seen[row].unsqueeze(0).repeat(k + 1, 1)
        counts = st.counts[row].unsqueeze(0).repeat(k + 1, 1)
        for j in range(1, k + 1):
            seen[j:, drafts[j - 1]] = True
            counts[j:, drafts[j - 1]] += 1
        view = _VerifyView(st, row, k + 1, seen, counts)
        if r.params.penalized:
            lf = SamplerState.penalize(view, lf)
        step = int(st.step[row])
        cols = torch.arange(step, step + k + 1, device=dev).clamp(max=st.uniforms.shape[1] - 1)
        if r.params.greedy:
            top = torch.argmax(lf, dim=-1).tolist()
            a = 0
            while a < k and r.drafts[a] == top[a]:
                a += 1
            emitted = list(r.drafts[:a]) + [top[a]]
        else:
            p = filtered_probs(lf, view)
            q = r.draft_probs
            acc, toks = accept(p.unsqueeze(0), drafts.unsqueeze(0),
                               torch.tensor([k], device=dev),
                               None if q is None else q.unsqueeze(0).float(),
                               st.uniforms[row, cols].unsqueeze(0),
                               st.uniforms2[row, cols].unsqueeze(0))
            a = int(acc[0])
            emitted = toks[0, :a + 1].tolist()
        lps: list[TokenLogprob] = []
        if r.params.logprobs is not None:
            n = r.params.logprobs
            chosen, top_v, top_i = token_logprobs(
                lf[:a + 1], torch.tensor(emitted, device=dev), max(n, 1))
            lps = [logprob_of(t, chosen[j], top_v[j, :n], top_i[j, :n])
                   for j, t in enumerate(emitted)]
        em = torch.tensor(emitted, dtype=torch.long, device=dev)
        st.seen[row, em] = True
        st.counts[row].index_add_(0, em, torch.ones(len(emitted), device=dev))
        st.step[row] += len(emitted)
        out[i] = (emitted, a, lps)
    return out  # type: ignore[return-value]


class _VerifyView:
    """One sampler row repeated over a verify row's positions, with per-position seen/counts."""

    def __init__(self, st: SamplerState, row: int, n: int, seen: torch.Tensor,
                 counts: torch.Tensor) -> None:
        for name in ("temperature", "top_p", "top_k", "min_p", "presence", "repetition",
                     "frequency"):
            setattr(self, name, getattr(st, name)[row].expand(n))
        self.seen, self.counts = seen, counts
        self.bias = st.bias[row].expand(n, -1)
