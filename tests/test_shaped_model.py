"""qwen_trt.bench.shaped_model: a random checkpoint with given shapes that the fast path loads;
the LM head rows past the tokenizer's ids are zero, so greedy decoding only picks ids the
tokenizer can turn into text."""
from __future__ import annotations

import json
from dataclasses import replace

import torch
from safetensors import safe_open

from qwen_trt import settings as qwen_settings
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


def test_shaped_checkpoint_with_qwens_real_vocabulary(tmp_path):
    """Needs llama.cpp's models/ggml-vocab-qwen2.gguf (from the llama-cpp-python sdist) named by
    $QWEN_TRT_QWEN_VOCAB_GGUF; its .inp/.out test vectors beside it."""
    import os

    import pytest

    gguf = qwen_settings.get("QWEN_TRT_QWEN_VOCAB_GGUF")
    if not gguf or not os.path.isfile(gguf):
        pytest.skip("set QWEN_TRT_QWEN_VOCAB_GGUF to llama.cpp's ggml-vocab-qwen2.gguf")
    pytest.importorskip("gguf")
    from qwen_trt.backends.fast_backend import FastBackend
    from qwen_trt.bench.qwen_vocab import BPE_TOKENS, check_vectors

    shape = replace(SHAPES["tiny"], vocab_size=151936, layers=2, max_position_embeddings=2048)
    out = write_shaped_model(tmp_path / "m", shape, device="cpu", vocab_gguf=gguf)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["eos_token_id"] == 151645 and cfg["vocab_size"] == 151936
    backend = FastBackend.load(str(out), device="cpu", max_seq_len=256, warmup=False)
    tok = backend.tokenizer
    assert len(tok) == 151669 and tok.convert_ids_to_tokens(151645) == "<|im_end|>"
    assert tok.convert_ids_to_tokens(151667) == "<think>"
    ok, total = check_vectors(tok, gguf)
    assert total > 40 and ok == total
    assert 151645 in backend.info.stop_token_ids
    ids = tok.encode("hello there")
    toks = list(backend.stream(ids, SamplingParams(max_new_tokens=12, temperature=0,
                                                   ignore_eos=True)))
    assert len(toks) == 12 and max(toks) < BPE_TOKENS          # text only, never a control
    backend.close()


def test_tokenizer_from_a_written_folder_matches_the_gguf_conversion(tmp_path):
    """``--tokenizer-from``: the tokenizer files `qwen_vocab` wrote, copied (a machine without
    the gguf package), give the same checkpoint as converting the GGUF there."""
    import os

    import pytest

    gguf = qwen_settings.get("QWEN_TRT_QWEN_VOCAB_GGUF")
    if not gguf or not os.path.isfile(gguf):
        pytest.skip("set QWEN_TRT_QWEN_VOCAB_GGUF to llama.cpp's ggml-vocab-qwen2.gguf")
    pytest.importorskip("gguf")
    from transformers import AutoTokenizer

    from qwen_trt.bench.qwen_vocab import write_tokenizer

    tok_dir = tmp_path / "tok"
    tok_dir.mkdir()
    write_tokenizer(gguf, tok_dir)
    shape = replace(SHAPES["tiny"], vocab_size=151936, layers=1, max_position_embeddings=512)
    a = write_shaped_model(tmp_path / "a", shape, device="cpu", vocab_gguf=gguf)
    b = write_shaped_model(tmp_path / "b", shape, device="cpu", tokenizer_from=tok_dir)
    assert json.loads((a / "config.json").read_text()) == json.loads((b / "config.json").read_text())
    ta, tb = AutoTokenizer.from_pretrained(a), AutoTokenizer.from_pretrained(b)
    text = "Qwen3 says: héllo <|im_end|> 你好"
    assert len(tb) == len(ta) == 151669 and tb.encode(text) == ta.encode(text)


def test_tokenizer_from_a_folder_without_one_is_one_line(tmp_path):
    import pytest

    from qwen_trt.bench.qwen_vocab import copy_tokenizer

    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError) as e:
        copy_tokenizer(tmp_path / "empty", tmp_path)
    assert "no tokenizer.json" in str(e.value) and "\n" not in str(e.value)
