"""Offline tiny Qwen3 checkpoint + byte-level BPE tokenizer, for tests and the demo.

``qwen-trt tiny-model DIR`` writes a folder that ``AutoTokenizer`` / ``AutoModelForCausalLM``
load like the real Qwen3-4B-Instruct-2507: ``config.json`` (model_type qwen3, head_dim not equal
to hidden/heads, tied embeddings), ``model.safetensors`` with random weights from a seed,
``generation_config.json``, ``tokenizer.json`` and ``tokenizer_config.json`` with Qwen3's
added tokens (the tool tags included) and chat template (tools included). No network, a few seconds on two CPU cores.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from qwen_trt.model.template import (ENDOFTEXT, IM_END, IM_START, QWEN3_EXTRA_TOKENS,
                                    QWEN3_INSTRUCT_CHAT_TEMPLATE)
from qwen_trt.errors import FileProblemError

# Qwen2/Qwen3 pre-tokenizer split pattern (same regex as the real tokenizer.json).
QWEN_SPLIT_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# Small built-in multilingual corpus: English, Chinese, code, emoji.
CORPUS = """\
The quick brown fox jumps over the lazy dog. Hello, how are you today? I am fine, thank you.
A low-latency chat service streams every token as soon as it is generated.
Large language models predict the next token from the previous ones.
Please explain how a GPU reads weights from memory during decoding.
The answer is 42. Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000 3.14159.
你好，世界！今天天气很好。我们一起去公园散步吧。
人工智能正在改变世界。大型语言模型可以回答问题、写代码和翻译文本。
请用中文回答：什么是张量？张量是一个多维数组。
北京是中国的首都。上海是一个国际化大都市。
def fibonacci(n):
    if n < 2:
        return n
    return fibonacci(n - 1) + fibonacci(n - 2)

for i in range(10):
    print(f"{i}: {fibonacci(i)}")

class Model:
    def __init__(self, layers=36, hidden=2560):
        self.layers = layers
        self.hidden = hidden
```python
import torch
x = torch.randn(4, 4)
```
Emoji: 😀 🚀 🎉 👍 ❤️ 🤖 — café naïve résumé. Привет, мир! こんにちは世界。안녕하세요.
<b>bold</b> <script>alert(1)</script> **markdown** `code` [link](http://example.com)
"""


# The first line of the README the tiny checkpoint gets (how the app knows it runs the demo).
TINY_README_FIRST_LINE = "Tiny random-weight Qwen3 checkpoint written offline by `qwen-trt tiny-model`."


@dataclass(frozen=True)
class TinyShape:
    """Model shape of the tiny checkpoint (options so benchmarks can scale it)."""

    layers: int = 2
    hidden: int = 64
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 32          # != hidden/heads on purpose, like Qwen3-4B (128 != 2560/32)
    intermediate: int = 128
    vocab_size: int = 512       # BPE vocab before the special tokens
    max_position_embeddings: int = 4096


def build_tokenizer(vocab_size: int):
    """Train a byte-level BPE tokenizer on the built-in corpus; returns a HF fast tokenizer."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN_SPLIT_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
        min_frequency=2,
    )
    tok.train_from_iterator([CORPUS] * 4, trainer=trainer)
    # Special tokens go after the BPE vocabulary, as in the real Qwen tokenizer.
    from tokenizers import AddedToken

    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t in (ENDOFTEXT, IM_START, IM_END)])
    # Then Qwen3's other added tokens in its order: the tool tags <tool_call>, </tool_call>,
    # <tool_response>, </tool_response> (and fim / think) are not special, as in Qwen3.
    for text, special in QWEN3_EXTRA_TOKENS:
        added = AddedToken(text, special=special, normalized=False)
        (tok.add_special_tokens if special else tok.add_tokens)([added])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=IM_END,
        pad_token=ENDOFTEXT,
        model_max_length=131072,
        clean_up_tokenization_spaces=False,
    )


def _prepare_folder(out: Path, force: bool) -> None:
    """Create ``out``; refuse a folder that already holds something unless ``force`` (writing
    the tiny model replaces config and tokenizer files and deletes other weight shards)."""
    try:
        if out.exists() and not out.is_dir():
            raise FileProblemError(f"{out} is a file, not a folder: give a new or empty folder "
                                   f"for the tiny model.")
        if out.is_dir() and not force:
            entries = sorted(p.name for p in out.iterdir())
            if entries:
                shown = ", ".join(entries[:3]) + (", ..." if len(entries) > 3 else "")
                raise FileProblemError(
                    f"{out} is not empty ({len(entries)} entries: {shown}); writing the tiny "
                    f"model there would overwrite or delete them. Give a new or empty folder, "
                    f"or pass --force to overwrite.")
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise FileProblemError(f"Cannot write the tiny model to {out}: "
                               f"{e.strerror or e}.") from e


def write_tiny_model(out_dir: str | Path, shape: TinyShape = TinyShape(), seed: int = 0,
                     *, force: bool = False) -> Path:
    """Write the tiny checkpoint + tokenizer into ``out_dir`` (new or empty, unless ``force``)
    and return it."""
    out = Path(out_dir)
    _prepare_folder(out, force)
    try:
        return _write(out, shape, seed)
    except OSError as e:       # disk full, permissions changed meanwhile, ...
        raise FileProblemError(f"Cannot write the tiny model to {out}: "
                               f"{e.strerror or e}.") from e


def _write(out: Path, shape: TinyShape, seed: int) -> Path:
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    tokenizer = build_tokenizer(shape.vocab_size)
    tokenizer.chat_template = QWEN3_INSTRUCT_CHAT_TEMPLATE
    tokenizer.save_pretrained(out)
    _patch_tokenizer_config(out)

    vocab = len(tokenizer)
    # The weights are drawn for the BPE vocabulary and the three ChatML tokens first, as they
    # were before Qwen3's other added tokens joined (so the same seed keeps the same model);
    # the rows of those tokens come after, from their own generator.
    base = vocab - len(QWEN3_EXTRA_TOKENS)
    endoftext, im_end = tokenizer.convert_tokens_to_ids([ENDOFTEXT, IM_END])
    config = Qwen3Config(
        vocab_size=base,
        hidden_size=shape.hidden,
        intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        head_dim=shape.head_dim,
        max_position_embeddings=shape.max_position_embeddings,
        rope_theta=5_000_000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        bos_token_id=endoftext,
        eos_token_id=im_end,
        pad_token_id=endoftext,
        torch_dtype="float32",
    )
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(config).eval()
    # Wider init than the default 0.02 so greedy decoding is not one repeated token.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.15 if "embed" in name else 0.08)
        # Shrink (tied) embedding rows of tokens that are only part of a UTF-8 character or a
        # control character, so the demo's word salad is mostly whole words rather than U+FFFD
        # and tofu boxes; tests still get such tokens from the tokenizer itself.
        unprintable = [i for i in range(base) if _unprintable(tokenizer.decode([i]))]
        model.get_input_embeddings().weight[unprintable] *= 0.2
    model.resize_token_embeddings(vocab, mean_resizing=False)
    with torch.no_grad():
        extra = torch.Generator().manual_seed(seed + 1)
        emb = model.get_input_embeddings().weight
        # Small rows, like the unprintable ones: random weights rarely pick these tags, so the
        # demo's replies stay words (tests script the replies that use them).
        emb[base:] = torch.randn(vocab - base, emb.shape[1], generator=extra) * 0.15 * 0.2
    model.generation_config.eos_token_id = [im_end, endoftext]
    model.generation_config.pad_token_id = endoftext
    model.generation_config.bos_token_id = endoftext
    model.save_pretrained(out, safe_serialization=True)
    (out / "README.md").write_text(
        TINY_README_FIRST_LINE + "\n"
        "Its replies are gibberish by design: it exists to test the pipeline, not to chat.\n"
    )
    return out


def is_tiny_model(model: str) -> bool:
    """Whether ``model`` is a folder written by :func:`write_tiny_model` (by its README)."""
    try:
        with open(Path(model) / "README.md", encoding="utf-8") as f:
            return f.readline().rstrip("\n") == TINY_README_FIRST_LINE
    except (OSError, ValueError):
        return False


def _unprintable(text: str) -> bool:
    import unicodedata

    return any(c == "\ufffd" or (unicodedata.category(c) == "Cc" and c not in "\n\t")
               for c in text)


def _patch_tokenizer_config(out: Path) -> None:
    """Make tokenizer_config.json name the tokenizer class the real model uses."""
    path = out / "tokenizer_config.json"
    cfg = json.loads(path.read_text())
    cfg["tokenizer_class"] = "Qwen2Tokenizer"
    cfg["chat_template"] = QWEN3_INSTRUCT_CHAT_TEMPLATE
    cfg["errors"] = "replace"
    cfg["add_prefix_space"] = False
    cfg["split_special_tokens"] = False
    path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False))
    # transformers >= 4.43 may also have written chat_template.jinja; keep the two identical.
    jinja = out / "chat_template.jinja"
    if jinja.exists():
        jinja.write_text(QWEN3_INSTRUCT_CHAT_TEMPLATE)
