"""The n-gram / prompt-lookup proposer (qwen_trt.fast.spec.ngram) against a brute-force search,
its longest-first / most-recent rules, the prediction source, and the lookup benchmark."""
from __future__ import annotations

import json
import random

import pytest

from qwen_trt.fast.spec.ngram import NgramIndex, NgramSettings


def brute_force(tokens: list[int], k: int, n_min: int, n_max: int) -> list[int]:
    """Longest n first; for it, the latest earlier occurrence; its continuation copied (past
    the end the copy reads what it has copied)."""
    end = len(tokens)
    for n in range(min(n_max, end - 1), n_min - 1, -1):
        suffix = tokens[end - n:]
        for cont in range(end - 1, n - 1, -1):
            if tokens[cont - n:cont] == suffix:
                virtual = list(tokens)
                for i in range(k):
                    virtual.append(virtual[cont + i])
                return virtual[end:]
    return []


@pytest.mark.parametrize("n_min,n_max,vocab", [(1, 5, 4), (2, 5, 6), (2, 3, 3), (3, 6, 2)])
def test_incremental_index_matches_a_brute_force_search(n_min, n_max, vocab):
    rng = random.Random(n_min * 100 + n_max * 10 + vocab)
    prompt = [rng.randrange(vocab) for _ in range(rng.randrange(0, 20))]
    idx = NgramIndex(n_max, n_min, prompt=prompt)
    tokens = list(prompt)
    hits = 0
    for _ in range(150):
        k = rng.randrange(0, 7)
        got = idx.propose(k)
        want = brute_force(tokens, k, n_min, n_max) if k else []
        assert got == want, (tokens, k)
        hits += bool(got)
        new = [rng.randrange(vocab) for _ in range(rng.randrange(1, 4))]
        idx.extend(new)
        tokens += new
    assert idx.tokens == tokens and idx.reply_len == len(tokens) - len(prompt)
    assert hits > 20                   # the comparison exercised real matches


def test_longest_match_wins_then_the_most_recent():
    # "7 8 9" occurred once (-> 1); "8 9" more recently (-> 2): the longer one wins
    idx = NgramIndex(n_min=2, prompt=[7, 8, 9, 1, 5, 8, 9, 2, 6, 7, 8, 9])
    assert idx.propose(3) == [1, 5, 8]
    # equal lengths: the latest occurrence
    assert NgramIndex(prompt=[1, 2, 3, 1, 2, 4, 1, 2]).propose(1) == [4]
    # nothing repeats: no proposal; a single repeated token is below n_min=2
    assert NgramIndex(prompt=[1, 2, 3, 4, 3]).propose(4) == []
    assert NgramIndex(n_min=1, prompt=[1, 2, 3, 4, 3]).propose(2) == [4, 3]
    # a loop keeps looping past the end of what was seen
    assert NgramIndex(prompt=[5, 6, 5, 6, 5, 6]).propose(5) == [5, 6, 5, 6, 5]
    assert NgramIndex(prompt=[5, 6]).propose(0) == []


def test_prediction_is_proposed_while_the_reply_follows_it():
    prompt = [1, 2, 3]
    pred = [10, 11, 12, 13, 14, 15, 16]
    idx = NgramIndex(n_min=2, prompt=prompt, prediction=pred)
    assert idx.propose(3) == [10, 11, 12]          # an empty reply starts at the prediction
    idx.extend([10, 11])
    assert idx.propose(3) == [12, 13, 14]
    idx.extend([12, 50])                           # the reply diverges
    assert idx.propose(3) == []                    # "12 50" is nowhere
    idx.extend([13, 14])                           # ...and comes back: looked up again
    assert idx.propose(2) == [15, 16]
    idx.extend([15, 16])
    assert idx.propose(2) == []                    # the prediction is used up, history has nothing
    # a history match longer than the prediction's wins
    idx2 = NgramIndex(n_min=2, prompt=[4, 5, 6, 7, 9], prediction=[0, 6, 7, 3])
    idx2.extend([8])                               # diverges from the prediction at once
    idx2.extend([5, 6, 7])
    assert idx2.propose(2) == [9, 8]


def test_bad_settings_and_tokens_are_refused():
    with pytest.raises(ValueError, match="n_min"):
        NgramSettings(n_min=0)
    with pytest.raises(ValueError, match="n_min"):
        NgramSettings(n_min=4, n_max=3)
    with pytest.raises(ValueError, match="token id"):
        NgramIndex(prompt=[1, -1])
    with pytest.raises(TypeError):
        NgramIndex(prompt=[1.0])
    import numpy as np

    idx = NgramIndex(n_min=1, prompt=np.array([900_000, 7, 900_000], dtype=np.int64))
    assert idx.propose(1) == [7] and all(type(t) is int for t in idx.tokens)
    with pytest.raises(ValueError, match="n_min"):
        NgramIndex(3, 4)
    from qwen_trt.fast.spec.ngram import RecentReplies

    with pytest.raises(ValueError, match="shared replies index"):
        NgramIndex(4, 2, shared=RecentReplies(NgramSettings(n_max=5)))


def test_lookup_benchmark_reports_json(capsys):
    from qwen_trt.bench.spec_lookup import main

    assert main(["--streams", "4", "--steps", "20", "--prompt-len", "200", "--k", "4"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["streams"] == 4 and report["steps"] == 20
    for key in ("propose_us", "extend_us", "step_us", "step_cpu_us"):
        assert report[key]["median"] > 0 and report[key]["p99"] >= report[key]["median"]
    assert 0 < report["proposal_rate"] <= 1


def test_recent_replies_are_shared_across_requests_and_bounded():
    from qwen_trt.fast.spec.ngram import RecentReplies

    shared = RecentReplies(NgramSettings(n_min=2), max_tokens=40)
    shared.add([30, 31, 32, 33, 34])
    idx = NgramIndex(n_min=2, prompt=[1, 2, 3], shared=shared)
    assert idx.propose(3) == []
    idx.extend([31, 32])
    assert idx.propose(5) == [33, 34]              # stops at the end of that reply
    idx.extend([33, 1, 2])                         # own history "1 2" -> 3 (n=2) ...
    shared.add([7, 1, 2, 9, 9])                    # ... and a reply with "1 2" -> 9 (n=2)
    assert idx.propose(2) == [3, 31]               # a tie: the request's own history wins
    shared.add([4, 33, 1, 2, 8])                   # "33 1 2" (n=3) is longer: shared wins
    assert idx.propose(2) == [8]
    # two generations of at most max_tokens / 2: the oldest replies drop out
    for i in range(30):
        shared.add([100 + i, 200 + i, 300 + i])
    assert shared.tokens <= 40 + 4
    late = NgramIndex(n_min=2, prompt=[30, 31], shared=shared)
    assert late.propose(2) == []                   # the first reply is gone
    recent = NgramIndex(n_min=2, prompt=[129, 229], shared=shared)
    assert recent.propose(2) == [329]
    with pytest.raises(ValueError, match="reserved"):
        shared.add([1, (1 << 20) - 1])
