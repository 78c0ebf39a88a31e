"""Exact speculative acceptance (qwen_trt.fast.spec.rejection): the emitted tokens follow the
target's distribution (chi-square over many draws on small vocabularies), the test fails when the
residual correction is removed, greedy rows give plain greedy tokens, and target_probs is the
distribution the sampler draws from."""
from __future__ import annotations

import pytest
import torch

from qwen_trt.fast.step import sampling
from qwen_trt.fast.spec import rejection
from qwen_trt.fast.spec.rejection import accept
from qwen_trt.params import SamplingParams

N = 200_000          # draws per chi-square test (all in one batched call)



pytestmark = pytest.mark.usefixtures("one_thread")

def chi2_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's chi-square goodness-of-fit p-value of ``counts`` against ``probs`` (cells with
    zero expected mass must be empty: a count there fails at once)."""
    counts = counts.double().flatten()
    expected = probs.double().flatten() * counts.sum()
    live = expected > 0
    if counts[~live].sum() > 0:
        return 0.0
    stat = ((counts[live] - expected[live]) ** 2 / expected[live]).sum()
    df = int(live.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2.0, dtype=torch.float64), stat / 2))


def _dist(g: torch.Generator, *shape: int, sharp: float = 1.5) -> torch.Tensor:
    return torch.softmax(torch.randn(*shape, generator=g) * sharp, dim=-1)


def _draws(probs: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """One index per row of ``probs [R, V]``."""
    return torch.multinomial(probs, 1, generator=g).squeeze(1)


def _first_token_case(seed: int, v: int, k: int, one_hot: bool):
    """R rows sharing target rows p [k+1, V] and draft rows q [k, V]; drafts drawn from q (or
    arbitrary when the draft is deterministic); varied draft counts 0..k."""
    g = torch.Generator().manual_seed(seed)
    p = _dist(g, k + 1, v)
    q = _dist(g, k, v)
    if one_hot:
        d = torch.randint(0, v, (N, k), generator=g)
    else:
        d = torch.stack([_draws(q[i].expand(N, v), g) for i in range(k)], dim=1)
    kr = torch.randint(0, k + 1, (N,), generator=g)
    u = torch.rand(N, k + 1, generator=g)
    u2 = torch.rand(N, k + 1, generator=g)
    qq = None if one_hot else q.expand(N, k, v)
    return p, d, kr, u, u2, qq


@pytest.mark.parametrize("one_hot", [False, True], ids=["random-q", "one-hot-q"])
@pytest.mark.parametrize("v,k,seed", [(5, 3, 0), (8, 2, 1)])
def test_first_emitted_token_follows_the_target(v, k, seed, one_hot):
    p, d, kr, u, u2, q = _first_token_case(seed + 20 * one_hot, v, k, one_hot)
    out = accept(p.expand(N, k + 1, v), d, kr, q, u, u2)
    assert bool(((out.accepted >= 0) & (out.accepted <= kr)).all())
    first = out.tokens[:, 0]
    assert chi2_pvalue(torch.bincount(first, minlength=v), p[0]) > 1e-3
    # the drafts before the stop are kept as they were; nothing is emitted after it
    pos = torch.arange(k + 1).view(1, -1)
    kept = pos < out.accepted.view(-1, 1)
    padded = torch.cat([d, torch.zeros(N, 1, dtype=torch.long)], 1)
    assert bool((out.tokens[kept] == padded[kept]).all())
    assert bool((out.tokens[pos > out.accepted.view(-1, 1)] == -1).all())
    # acceptance really happens (and not always): the test exercises both branches
    assert 0.05 < float((out.accepted > 0).double().mean()) < 0.95


def _markov_case(seed: int, v: int):
    """A target and a draft whose next-token distribution depends on the previous token:
    P0 [V], P1 [V, V] (row = previous token), Q0, Q1 likewise; k = 2 drafts per row."""
    g = torch.Generator().manual_seed(seed)
    p0, p1 = _dist(g, v), _dist(g, v, v)
    q0, q1 = _dist(g, v), _dist(g, v, v)
    d0 = _draws(q0.expand(N, v), g)
    d1 = _draws(q1[d0], g)
    d = torch.stack([d0, d1], 1)
    p = torch.stack([p0.expand(N, v), p1[d0], p1[d1]], 1)
    q = torch.stack([q0.expand(N, v), q1[d0]], 1)
    kr = torch.full((N,), 2)
    u, u2 = torch.rand(N, 3, generator=g), torch.rand(N, 3, generator=g)
    return p0, p1, p, d, kr, u, u2, q, g


def _first_two(p1: torch.Tensor, out, g: torch.Generator) -> torch.Tensor:
    """(t0, t1) per row; where only one token was emitted, the next step's token is drawn from
    the target given t0 (plain sampling, as the following step would)."""
    t0 = out.tokens[:, 0]
    nxt = _draws(p1[t0], g)
    t1 = torch.where(out.accepted >= 1, out.tokens[:, 1], nxt)
    return t0, t1


@pytest.mark.parametrize("v,seed", [(5, 3), (6, 4)])
def test_joint_of_the_first_two_tokens_follows_the_target(v, seed):
    p0, p1, p, d, kr, u, u2, q, g = _markov_case(seed, v)
    out = accept(p, d, kr, q, u, u2)
    t0, t1 = _first_two(p1, out, g)
    joint = torch.bincount(t0 * v + t1, minlength=v * v)
    assert chi2_pvalue(joint, p0.view(-1, 1) * p1) > 1e-3


def test_the_chi_square_test_fails_without_the_residual_correction(monkeypatch):
    """Drawing from p instead of norm(max(p - q, 0)) after a rejection is off: both tests see it."""
    v, k = 6, 3
    p, d, kr, u, u2, q = _first_token_case(5, v, k, one_hot=False)
    good = accept(p.expand(N, k + 1, v), d, kr, q, u, u2)
    assert chi2_pvalue(torch.bincount(good.tokens[:, 0], minlength=v), p[0]) > 1e-3
    p0, p1, pm, dm, krm, um, u2m, qm, g = _markov_case(6, v)

    monkeypatch.setattr(rejection, "residual_distribution", lambda p_j, q_j, d_j: p_j)
    bad = accept(p.expand(N, k + 1, v), d, kr, q, u, u2)
    assert chi2_pvalue(torch.bincount(bad.tokens[:, 0], minlength=v), p[0]) < 1e-9
    out = accept(pm, dm, krm, qm, um, u2m)
    t0, t1 = _first_two(p1, out, g)
    assert chi2_pvalue(torch.bincount(t0 * v + t1, minlength=v * v), p0.view(-1, 1) * p1) < 1e-9


def test_greedy_rows_keep_drafts_while_they_are_the_argmax():
    g = torch.Generator().manual_seed(7)
    rows, k, v = 64, 4, 9
    p = _dist(g, rows, k + 1, v)
    top = p.argmax(-1)
    # drafts agree with the argmax for a random prefix, then differ
    agree = torch.randint(0, k + 1, (rows,), generator=g)
    d = torch.where(torch.arange(k).view(1, -1) < agree.view(-1, 1), top[:, :k],
                    (top[:, :k] + 1) % v)
    kr = torch.randint(0, k + 1, (rows,), generator=g)
    u = torch.ones(rows, k + 1)               # a sampled row would reject everything with u=1
    out = accept(p, d, kr, None, u, torch.rand(rows, k + 1, generator=g),
                 greedy=torch.ones(rows, dtype=torch.bool))
    for r in range(rows):
        n = min(int(agree[r]), int(kr[r]))
        assert int(out.accepted[r]) == n
        want = top[r, :n].tolist() + [int(top[r, n])] + [-1] * (k - n)
        assert out.tokens[r].tolist() == want


def test_mixed_rows_no_drafts_and_one_hot_target():
    """Greedy and sampled rows in one call; a row with no drafts emits one token from p; a
    one-hot p (a greedy row fed as probabilities) accepts exactly the argmax drafts."""
    v = 5
    p = torch.zeros(3, 3, v)
    p[0, :, 2] = 1.0                      # one-hot target, sampled row
    p[1] = torch.tensor([0.1, 0.2, 0.3, 0.4, 0.0])
    p[2] = torch.tensor([0.0, 0.0, 0.0, 0.0, 1.0])
    d = torch.tensor([[2, 3], [1, 1], [4, 4]])
    kr = torch.tensor([2, 0, 2])
    u = torch.full((3, 3), 0.5)
    u2 = torch.tensor([[0.0, 0.0, 0.0], [0.35, 0.0, 0.0], [0.0, 0.0, 0.9]])
    out = accept(p, d, kr, None, u, u2, greedy=torch.tensor([False, False, True]))
    acc, toks = out                                   # unpacks as (accepted, tokens)
    assert acc is out.accepted and toks is out.tokens
    assert out.accepted.tolist() == [1, 0, 2]
    # row 0: 3 rejected at position 1 -> the residual of a one-hot p at 2 is 2 itself
    # row 1: no drafts: inverse CDF of p at 0.35 -> cumulative 0.1, 0.3, 0.6 -> token 2
    assert out.tokens.tolist() == [[2, 2, -1], [2, -1, -1], [4, 4, 4]]
    assert out.emitted.tolist() == [2, 1, 3]
    z = accept(p[:, :1], d[:, :0], torch.zeros(3, dtype=torch.long), None, u[:, :0], u2[:, :1])
    assert z.accepted.tolist() == [0, 0, 0] and z.tokens.shape == (3, 1)


def _sampler_rows(params: list[SamplingParams], v: int) -> sampling.SamplerState:
    st = sampling.SamplerState(max_tokens=4, vocab=v, device="cpu", rows=len(params))
    for i, sp in enumerate(params):
        st.set(sp, i)
    return st


def test_filtered_probs_is_what_the_sampler_draws_from():
    """The sampler's token for its uniform is the inverse-CDF draw, in the sampler's ranking
    order, from filtered_probs (the p that verify rows give accept); every filter changes it."""
    v = 300
    g = torch.Generator().manual_seed(11)
    settings = [dict(temperature=0.7, top_p=0.8, top_k=20), dict(temperature=1.3, top_p=1.0,
                top_k=0), dict(temperature=0.5, top_p=0.95, top_k=5, min_p=0.05),
                dict(temperature=1.0, top_p=0.3, top_k=40, min_p=0.2)]
    params = [SamplingParams(seed=100 + i, **settings[i % len(settings)]) for i in range(400)]
    st = _sampler_rows(params, v)
    lf = torch.randn(len(params), v, generator=g) * 3
    got = sampling.sample(lf, "full", st)
    probs = sampling.filtered_probs(lf, st)
    assert torch.allclose(probs.sum(-1), torch.ones(len(params)), atol=1e-5)
    _, idx = torch.sort(lf, dim=-1, descending=True)
    cum = torch.cumsum(probs.gather(1, idx), dim=-1)
    u = st.uniforms[:, 0:1] * cum[:, -1:]
    mine = idx.gather(1, (cum < u).sum(-1, keepdim=True).clamp(max=idx.shape[1] - 1)).squeeze(1)
    assert torch.equal(mine, got)
    kept = (probs > 0).sum(-1)
    assert bool((kept <= st.top_k).all()) and int(kept.min()) >= 1 and int(kept.max()) > 5
