"""The speculative pieces composed as docs/fast-path.md ("Speculative decoding: the pieces")
describes, around the tiny HF target recomputed in full each step (a reference, not the
batched runner): greedy speculation with the n-gram proposer and with the EAGLE-3 draft of
either layout gives exactly the tokens of plain greedy decoding."""
from __future__ import annotations

import json

import pytest
import torch

from qwen_trt.fast.model.config import FastConfig
from qwen_trt.fast.spec.eagle3 import load_eagle3
from qwen_trt.fast.spec.ngram import NgramIndex
from qwen_trt.fast.spec.rejection import accept
from qwen_trt.model.tiny_draft import write_tiny_draft

NEW = 40
K = 4



pytestmark = pytest.mark.usefixtures("one_thread")

@pytest.fixture(scope="module")
def hf(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


def _forward(hf, ids: list[int], aux_ids=()):
    """Logits of every position and the hidden states ENTERING the layers ``aux_ids`` (id L:
    the final norm's input), concatenated: ``[T, V]``, ``[T, n * H]``."""
    layers = hf.model.layers
    seen: dict[int, torch.Tensor] = {}
    hooks = []
    for j in set(aux_ids):
        mod = layers[j] if j < len(layers) else hf.model.norm
        hooks.append(mod.register_forward_pre_hook(
            lambda m, args, kw, j=j: seen.__setitem__(j, (args[0] if args else
                                                          kw["hidden_states"])[0]),
            with_kwargs=True))
    try:
        with torch.no_grad():
            logits = hf(torch.tensor([ids])).logits[0]
    finally:
        for h in hooks:
            h.remove()
    aux = torch.cat([seen[j] for j in aux_ids], -1) if aux_ids else None
    return logits, aux


def _greedy(hf, prompt: list[int]) -> list[int]:
    seq = list(prompt)
    for _ in range(NEW):
        seq.append(int(_forward(hf, seq)[0][-1].argmax()))
    return seq[len(prompt):]


def _verify(hf, seq, drafts, aux_ids=()):
    """One verify step over the last token and the drafts: (accepted, emitted, aux rows)."""
    rows = [seq[-1], *drafts]
    logits, aux = _forward(hf, seq + drafts, aux_ids)
    p = torch.zeros(1, K + 1, logits.shape[-1])
    p[0, :len(rows)] = torch.softmax(logits[-len(rows):], -1)
    d = torch.tensor([drafts + [0] * (K - len(drafts))])
    out = accept(p, d, torch.tensor([len(drafts)]), None, torch.zeros(1, K + 1),
                 torch.zeros(1, K + 1), greedy=torch.tensor([True]))
    a = int(out.accepted[0])
    return a, out.tokens[0, :a + 1].tolist(), aux


def test_ngram_speculation_gives_the_greedy_tokens(hf):
    prompt = [5, 9, 17, 5, 9, 17, 5, 9, 40, 41, 42, 5, 9]
    want = _greedy(hf, prompt)
    idx = NgramIndex(prompt=prompt)
    seq, kept = list(prompt), 0
    while len(seq) < len(prompt) + NEW:
        a, emitted, _ = _verify(hf, seq, idx.propose(K))
        kept += a
        seq += emitted
        idx.extend(emitted)
    assert seq[len(prompt):len(prompt) + NEW] == want
    assert kept > 0                     # drafts were accepted, not only proposed


@pytest.mark.parametrize("layout", ["sglang", "speculators"])
def test_eagle3_speculation_gives_the_greedy_tokens(hf, tiny_model_dir, tmp_path, layout):
    target = FastConfig.from_hf(json.loads((tiny_model_dir / "config.json").read_text()))
    draft = load_eagle3(write_tiny_draft(tmp_path / layout, tiny_model_dir, layout), target)
    embed = hf.model.embed_tokens.weight.detach()
    prompt = [3, 14, 15, 92, 65, 35, 89, 79]
    want = _greedy(hf, prompt)
    cache = draft.new_cache(1, 128)
    # the prompt's step: the target's token, then the draft over every prompt position
    logits, aux = _forward(hf, prompt, draft.aux_ids)
    seq = prompt + [int(logits[-1].argmax())]
    start, rows_aux, proposed = 0, aux, 0
    while len(seq) < len(prompt) + 1 + NEW:
        n = rows_aux.shape[0]
        pos = torch.arange(start, start + n)
        ids = torch.tensor(seq[start + 1:start + 1 + n])        # row t reads x_{t+1}
        drafts = draft.propose_chain(ids, rows_aux, pos, torch.zeros(n, dtype=torch.long),
                                     cache, embed, K, last=torch.tensor([n - 1]))[0].tolist()
        proposed += len(drafts)
        a, emitted, aux = _verify(hf, seq, drafts, draft.aux_ids)
        # catch up: the verified rows up to the last kept draft, with the target's aux
        start = len(seq) - 1
        rows_aux = aux[start:start + a + 1]
        seq += emitted
    assert seq[len(prompt):len(prompt) + NEW] == want
    assert proposed >= NEW
