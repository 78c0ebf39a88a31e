"""The offline tiny checkpoint loads like the real Qwen3-4B-Instruct-2507."""
import hashlib
import json

from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from qwen_trt.model.template import QWEN3_INSTRUCT_CHAT_TEMPLATE
from qwen_trt.model.tiny import TinyShape, write_tiny_model


def test_loads_through_auto_classes(tiny_model_dir):
    cfg = AutoConfig.from_pretrained(tiny_model_dir)
    assert cfg.model_type == "qwen3"
    assert cfg.head_dim != cfg.hidden_size // cfg.num_attention_heads  # the Qwen3-4B trap
    assert cfg.tie_word_embeddings
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert type(model).__name__ == "Qwen3ForCausalLM"
    assert model.config.vocab_size == len(tok)
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    cfg_json = json.loads((tiny_model_dir / "tokenizer_config.json").read_text())
    assert cfg_json["tokenizer_class"] == "Qwen2Tokenizer"


def test_special_tokens_are_single_ids_after_the_bpe_vocab(tiny_tokenizer):
    from qwen_trt.model.template import QWEN3_EXTRA_TOKENS

    names = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"] + [t for t, _ in QWEN3_EXTRA_TOKENS]
    ids = [tiny_tokenizer.convert_tokens_to_ids(t) for t in names]
    first = len(tiny_tokenizer) - len(names)
    assert ids == list(range(first, len(tiny_tokenizer)))     # Qwen3's order, after the BPE
    assert tiny_tokenizer.encode("<|im_start|>user", add_special_tokens=False)[0] == ids[1]
    decoder = tiny_tokenizer.added_tokens_decoder
    for tag in ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"):
        tid = tiny_tokenizer.convert_tokens_to_ids(tag)
        assert not decoder[tid].special            # as in Qwen3: it decodes as text
        assert tiny_tokenizer.decode([tid], skip_special_tokens=True) == tag


def test_chat_template_lays_out_tools_calls_and_results_like_qwen3(tiny_tokenizer):
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}]
    msgs = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": "", "tool_calls": [{
                "id": "call_1", "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "20 C"}]
    text = tiny_tokenizer.apply_chat_template(msgs, tools=tools, tokenize=False,
                                              add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n\n")
    assert ("<tools>\n" + json.dumps(tools[0]) + "\n</tools>") in text
    assert text.endswith(
        "<|im_start|>user\nWeather in Paris?<|im_end|>\n"
        '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": '
        '{"city": "Paris"}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\n20 C\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n")


def test_chat_template_renders_like_qwen3_instruct(tiny_tokenizer):
    msgs = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello!"},
            {"role": "user", "content": "你好"}]
    text = tiny_tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert text == ("<|im_start|>system\nBe brief.<|im_end|>\n"
                    "<|im_start|>user\nHi<|im_end|>\n"
                    "<|im_start|>assistant\nHello!<|im_end|>\n"
                    "<|im_start|>user\n你好<|im_end|>\n"
                    "<|im_start|>assistant\n")
    no_sys = tiny_tokenizer.apply_chat_template(msgs[1:2], tokenize=False, add_generation_prompt=False)
    assert no_sys == "<|im_start|>user\nHi<|im_end|>\n"  # Qwen3-2507 adds no default system prompt
    assert tiny_tokenizer.chat_template == QWEN3_INSTRUCT_CHAT_TEMPLATE


def test_multibyte_characters_are_split_across_tokens(tiny_tokenizer):
    for text in ("龘", "🚀", "👍"):
        ids = tiny_tokenizer.encode(text, add_special_tokens=False)
        assert len(ids) > 1, text
        assert tiny_tokenizer.decode(ids) == text
    mixed = "Hello 世界 🎉 def f(x): return x"
    assert tiny_tokenizer.decode(tiny_tokenizer.encode(mixed, add_special_tokens=False)) == mixed


def test_same_seed_same_weights_other_seed_differs(tmp_path):
    shape = TinyShape(layers=1, hidden=32, heads=2, kv_heads=1, head_dim=16, intermediate=64)

    def digest(d):
        return hashlib.sha256((d / "model.safetensors").read_bytes()).hexdigest()

    a = digest(write_tiny_model(tmp_path / "a", shape, seed=1))
    b = digest(write_tiny_model(tmp_path / "b", shape, seed=1))
    c = digest(write_tiny_model(tmp_path / "c", shape, seed=2))
    assert a == b != c
    cfg = json.loads((tmp_path / "a" / "config.json").read_text())
    assert (cfg["num_hidden_layers"], cfg["hidden_size"], cfg["head_dim"]) == (1, 32, 16)
