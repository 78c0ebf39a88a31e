"""The ChatML chat template of Qwen3-Instruct-2507, for the turns this product uses.

The real checkpoint ships its own template in ``tokenizer_config.json`` and we always use
that one (``tokenizer.apply_chat_template``). This copy is only written into the offline tiny
model so that tests render prompts exactly like the real model for system, user and assistant
turns with ``add_generation_prompt``:

    <|im_start|>system\\n{system}<|im_end|>\\n<|im_start|>user\\n{user}<|im_end|>\\n
    <|im_start|>assistant\\n{reply}<|im_end|>\\n ... <|im_start|>assistant\\n
"""

QWEN3_INSTRUCT_CHAT_TEMPLATE = (
    "{%- if messages[0].role == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.content is string %}{%- set content = message.content %}"
    "{%- else %}{%- set content = '' %}{%- endif %}"
    "{%- if (message.role == 'user') or (message.role == 'system' and not loop.first) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>' + '\\n' }}"
    "{%- elif message.role == 'assistant' %}"
    "{{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
ENDOFTEXT = "<|endoftext|>"


def special_id(tokenizer, token: str) -> int | None:
    """The id of ``token`` when the tokenizer really has it (not mapped to unk)."""
    tid = tokenizer.convert_tokens_to_ids(token)
    known = isinstance(tid, int) and tokenizer.convert_ids_to_tokens(tid) == token
    return tid if known else None


def default_stop_ids(tokenizer) -> tuple[int, ...]:
    """``<|im_end|>`` and ``<|endoftext|>`` (whichever the tokenizer has), plus its eos.

    Resolved once when a backend loads (``BackendInfo.stop_token_ids``)."""
    ids: list[int] = []
    for tok in (IM_END, ENDOFTEXT):
        tid = special_id(tokenizer, tok)
        if tid is not None and tid not in ids:
            ids.append(tid)
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in ids:
        ids.append(tokenizer.eos_token_id)
    return tuple(ids)


def end_and_pad_ids(tokenizer) -> tuple[int, int]:
    """TensorRT-LLM's end id (``<|im_end|>``, else eos) and pad id (the tokenizer's pad token,
    else ``<|endoftext|>``): recorded in the engine manifest at build time, used at run time."""
    end_id = special_id(tokenizer, IM_END)
    pad_id = tokenizer.pad_token_id
    if pad_id is None:
        pad_id = special_id(tokenizer, ENDOFTEXT)
    return (end_id if end_id is not None else tokenizer.eos_token_id), pad_id
