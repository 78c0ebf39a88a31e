"""qwen_trt.bench.shaped_model: a random checkpoint with given shapes that the fast path loads;
the LM head rows past the tokenizer's ids are zero, so greedy decoding only picks ids the
tokenizer can turn into text."""
from __future__ import annotations

import json
from dataclasses import replace

import torch
from safetensors import safe_open

from qwen_trt.bench.shaped_model import write_shaped_model
from qwen_trt.fast import SHAPES
from qwen_trt.params import SamplingParams


def test_shaped_checkpoint_loads_and_greedy_stays_in_the_tokenizer(tmp_path):
    from qwen_trt.backends.fast_backend import FastBackend

    shape = replace(SHAPES["tiny"], vocab_size=700, layers=3, max_position_embeddings=2048)
    out = write_shaped_model(tmp_path / "m", shape, device="cpu")
    cfg = json.loads((out / "config.json").read_text())
    assert (cfg["vocab_size"], cfg["num_hidden_layers"], cfg["max_position_embeddings"]) == \
        (700, 3, 2048)
    assert len(cfg["layer_types"]) == 3
    backend = FastBackend.load(str(out), device="cpu", max_seq_len=256, warmup=False)
    known = len(backend.tokenizer)
    assert known < 700
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        emb = f.get_tensor("model.embed_tokens.weight")
        assert emb.dtype == torch.bfloat16 and emb.shape == (700, shape.hidden)
        assert not emb[known:].any() and emb[:known].abs().sum(dim=1).min() > 0
        assert len(list(f.keys())) == 2 + 11 * 3
    ids = backend.tokenizer.encode("hello there")
    toks = list(backend.stream(ids, SamplingParams(max_new_tokens=24, temperature=0,
                                                   ignore_eos=True)))
    assert len(toks) == 24 and max(toks) < known
    backend.close()
