"""Qwen's real 151,643-token byte-level BPE, built offline, for the shaped checkpoint.

    python -m qwen_trt.bench.qwen_vocab GGUF OUT_DIR      # writes tokenizer files into OUT_DIR

The source is llama.cpp's ``models/ggml-vocab-qwen2.gguf`` (a vocabulary-only GGUF, vendored in
the llama-cpp-python sdist on PyPI: ``pip download --no-deps --no-binary :all:
llama-cpp-python``), read by transformers' GGUF tokenizer conversion (needs the ``gguf``
package). The conversion gives the Qwen2 BPE (ids 0..151642: merges, the pre-tokenizer's split
regex, the byte-level decoder) plus ``<|endoftext|>``, ``<|im_start|>``, ``<|im_end|>`` and
``[PAD…]`` fillers up to the 151,936-row embedding. Here the fillers are dropped and Qwen3's
added tokens (ids 151643..151668, :data:`QWEN3_ADDED`) put in their place, with the offline
tiny model's Qwen3-Instruct chat template.

What still differs from the hub's Qwen3-4B-Instruct-2507 tokenizer (docs/benchmarks.md):
the chat template is the project's tiny-model template (the hub's adds tool and reasoning
branches), ``tokenizer_config.json`` carries only the fields our loader reads, and the
vocabulary is Qwen2's as llama.cpp stored it (Qwen3 kept Qwen2's BPE; the GGUF's own test
vectors, ``ggml-vocab-qwen2.gguf.inp/.out``, check the encoding: :func:`check_vectors`).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

BPE_TOKENS = 151643
# Qwen3's added tokens, in id order from 151643 (special: control tokens; the tool and think
# markers are plain added tokens in Qwen3, so they are text to the template's encoder).
QWEN3_ADDED: tuple[tuple[str, bool], ...] = (
    ("<|endoftext|>", True), ("<|im_start|>", True), ("<|im_end|>", True),
    ("<|object_ref_start|>", True), ("<|object_ref_end|>", True), ("<|box_start|>", True),
    ("<|box_end|>", True), ("<|quad_start|>", True), ("<|quad_end|>", True),
    ("<|vision_start|>", True), ("<|vision_end|>", True), ("<|vision_pad|>", True),
    ("<|image_pad|>", True), ("<|video_pad|>", True), ("<tool_call>", False),
    ("</tool_call>", False), ("<|fim_prefix|>", False), ("<|fim_middle|>", False),
    ("<|fim_suffix|>", False), ("<|fim_pad|>", False), ("<|repo_name|>", False),
    ("<|file_sep|>", False), ("<tool_response>", False), ("</tool_response>", False),
    ("<think>", False), ("</think>", False))


def build_tokenizer(gguf: str | Path):
    """The Qwen3 tokenizer (a ``PreTrainedTokenizerFast``) from llama.cpp's vocabulary GGUF."""
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    from qwen_trt.model.tiny import QWEN3_INSTRUCT_CHAT_TEMPLATE

    gguf = Path(gguf)
    if not gguf.is_file():
        raise FileNotFoundError(f"no vocabulary GGUF at {gguf}")
    converted = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    spec = json.loads(converted.backend_tokenizer.to_str())
    vocab = spec["model"]["vocab"]
    bpe = {t: i for t, i in vocab.items() if i < BPE_TOKENS}
    if len(bpe) != BPE_TOKENS:
        raise ValueError(f"{gguf.name}: expected {BPE_TOKENS} BPE tokens, found {len(bpe)}")
    spec["model"]["vocab"] = bpe
    spec["added_tokens"] = [
        {"id": BPE_TOKENS + i, "content": text, "single_word": False, "lstrip": False,
         "rstrip": False, "normalized": False, "special": special}
        for i, (text, special) in enumerate(QWEN3_ADDED)]
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(json.dumps(spec)),
                                  eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                  model_max_length=131072, clean_up_tokenization_spaces=False)
    tok.chat_template = QWEN3_INSTRUCT_CHAT_TEMPLATE
    return tok


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "vocab.json", "merges.txt", "chat_template.jinja")


def write_tokenizer(gguf: str | Path, out_dir: str | Path) -> int:
    """Write the tokenizer files into ``out_dir`` (replacing any there); returns its size."""
    from qwen_trt.model.tiny import _patch_tokenizer_config

    out = Path(out_dir)
    for name in TOKENIZER_FILES:
        (out / name).unlink(missing_ok=True)
    tok = build_tokenizer(gguf)
    tok.save_pretrained(out)
    _patch_tokenizer_config(out)
    return len(tok)


def copy_tokenizer(src_dir: str | Path, out_dir: str | Path) -> None:
    """The tokenizer files :func:`write_tokenizer` wrote into ``src_dir``, copied into
    ``out_dir`` (replacing any there); one line when ``src_dir`` lacks ``tokenizer.json``."""
    import shutil

    src, out = Path(src_dir), Path(out_dir)
    if not (src / "tokenizer.json").is_file():
        raise FileNotFoundError(f"{src}: no tokenizer.json (write it with "
                                f"`python -m qwen_trt.bench.qwen_vocab GGUF {src}`)")
    for name in TOKENIZER_FILES:
        (out / name).unlink(missing_ok=True)
        if (src / name).is_file():
            shutil.copyfile(src / name, out / name)


def check_vectors(tok, gguf: str | Path) -> tuple[int, int]:
    """(matching, total) of llama.cpp's test vectors beside the GGUF (``.inp`` / ``.out``)."""
    gguf = Path(gguf)
    inp = Path(str(gguf) + ".inp").read_text(encoding="utf-8").split("\n__ggml_vocab_test__\n")
    out = Path(str(gguf) + ".out").read_text(encoding="utf-8").split("\n")
    pairs = list(zip(inp, out))
    ok = sum(tok.encode(a, add_special_tokens=False) == [int(x) for x in b.split()]
             for a, b in pairs)
    return ok, len(pairs)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m qwen_trt.bench.qwen_vocab")
    p.add_argument("gguf", help="llama.cpp's models/ggml-vocab-qwen2.gguf")
    p.add_argument("out_dir")
    a = p.parse_args(argv)
    try:
        n = write_tokenizer(a.gguf, a.out_dir)
    except (OSError, ValueError, ImportError) as e:
        print(f"qwen_vocab: error: {str(e).splitlines()[0]}", file=sys.stderr)
        return 1
    print(f"wrote a {n}-token Qwen3 tokenizer into {a.out_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
