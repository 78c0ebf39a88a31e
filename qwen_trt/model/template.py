"""The chat template of Qwen3-4B-Instruct-2507, tools included, and its tool tokens.

The real checkpoint ships its own template in ``tokenizer_config.json`` and we always use
that one (``tokenizer.apply_chat_template``). This copy is written into the offline tiny model
so that tests render prompts exactly like the real model: system, user and assistant turns,
the tools block in the system turn, assistant ``tool_calls`` as ``<tool_call>`` blocks and
``tool`` results as ``<tool_response>`` blocks in a user turn:

    <|im_start|>system\\n{system}\\n\\n# Tools ... <tools>\\n{tool json}\\n</tools> ...<|im_end|>\\n
    <|im_start|>user\\n{user}<|im_end|>\\n
    <|im_start|>assistant\\n<tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call><|im_end|>\\n
    <|im_start|>user\\n<tool_response>\\n{result}\\n</tool_response><|im_end|>\\n
    <|im_start|>assistant\\n

Source: the ``chat_template`` of Qwen/Qwen3-4B-Instruct-2507's tokenizer_config.json
(huggingface.co/Qwen/Qwen3-4B-Instruct-2507), the Qwen3 tool layout as quoted in
github.com/akougkas/warpio-cli@8dde6d21c14ca1c2167e7f8c86370e54fdbbc537
(warpio-docs/ai-docs/model_cards/qwen3:4b.md), without the thinking parts the Instruct-2507
model dropped (no ``<think>`` in replies or in the generation prompt). Written out here as
concatenated pieces; the rendered text is what matters.
"""

_TOOLS_HEADER = (
    "# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>"
)
_TOOLS_FOOTER = (
    "\\n</tools>\\n\\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n"
    '{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n'
)

QWEN3_INSTRUCT_CHAT_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}"
    '{{- "' + _TOOLS_HEADER + '" }}'
    '{%- for tool in tools %}{{- "\\n" }}{{- tool | tojson }}{%- endfor %}'
    '{{- "' + _TOOLS_FOOTER + '" }}'
    "{%- else %}"
    "{%- if messages[0].role == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.content is string %}{%- set content = message.content %}"
    "{%- else %}{%- set content = '' %}{%- endif %}"
    "{%- if (message.role == 'user') or (message.role == 'system' and not loop.first) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>' + '\\n' }}"
    "{%- elif message.role == 'assistant' %}"
    "{{- '<|im_start|>' + message.role + '\\n' + content }}"
    "{%- if message.tool_calls %}"
    "{%- for tool_call in message.tool_calls %}"
    "{%- if (loop.first and content) or (not loop.first) %}{{- '\\n' }}{%- endif %}"
    "{%- if tool_call.function %}{%- set tool_call = tool_call.function %}{%- endif %}"
    "{{- '<tool_call>\\n{\"name\": \"' }}{{- tool_call.name }}{{- '\", \"arguments\": ' }}"
    "{%- if tool_call.arguments is string %}{{- tool_call.arguments }}"
    "{%- else %}{{- tool_call.arguments | tojson }}{%- endif %}"
    "{{- '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.first or (messages[loop.index0 - 1].role != 'tool') %}"
    "{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' }}{{- content }}{{- '\\n</tool_response>' }}"
    "{%- if loop.last or (messages[loop.index0 + 1].role != 'tool') %}"
    "{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
ENDOFTEXT = "<|endoftext|>"
TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"

# Qwen3's added tokens after <|im_end|>, in id order, and whether each is special (the tool,
# fim and think tags are not: they decode as text, so a reply shows them).
QWEN3_EXTRA_TOKENS: tuple[tuple[str, bool], ...] = (
    ("<|object_ref_start|>", True), ("<|object_ref_end|>", True), ("<|box_start|>", True),
    ("<|box_end|>", True), ("<|quad_start|>", True), ("<|quad_end|>", True),
    ("<|vision_start|>", True), ("<|vision_end|>", True), ("<|vision_pad|>", True),
    ("<|image_pad|>", True), ("<|video_pad|>", True), (TOOL_CALL_START, False),
    (TOOL_CALL_END, False), ("<|fim_prefix|>", False), ("<|fim_middle|>", False),
    ("<|fim_suffix|>", False), ("<|fim_pad|>", False), ("<|repo_name|>", False),
    ("<|file_sep|>", False), ("<tool_response>", False), ("</tool_response>", False),
    ("<think>", False), ("</think>", False),
)


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


def stop_ids_from_files(parsed, folder) -> tuple[int, ...] | None:
    """:func:`default_stop_ids` without transformers: the ids from ``parsed`` (the folder's
    tokenizer.json as a ``tokenizers.Tokenizer``) and the eos named by tokenizer_config.json
    (else special_tokens_map.json). None when the files do not settle it (no tokenizer.json,
    an eos it does not have): the caller then asks the loaded tokenizer."""
    import json
    from pathlib import Path

    if parsed is None:
        return None
    eos = None
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        f = Path(folder) / name
        if f.is_file():
            try:
                eos = json.loads(f.read_text(encoding="utf-8")).get("eos_token")
            except (OSError, ValueError, AttributeError):
                return None
            if eos is not None:
                break
    if isinstance(eos, dict):
        eos = eos.get("content")
    if eos is not None and not isinstance(eos, str):
        return None
    ids: list[int] = []
    for tok in (IM_END, ENDOFTEXT, eos):
        if tok is None:
            continue
        tid = parsed.token_to_id(tok)
        if tid is None:
            if tok == eos:
                return None                    # an eos the vocabulary lacks: ask transformers
            continue
        if tid not in ids:
            ids.append(tid)
    return tuple(ids)


def end_and_pad_ids(tokenizer) -> tuple[int, int]:
    """TensorRT-LLM's end id (``<|im_end|>``, else eos) and pad id (the tokenizer's pad token,
    else ``<|endoftext|>``): recorded in the engine manifest at build time, used at run time."""
    end_id = special_id(tokenizer, IM_END)
    pad_id = tokenizer.pad_token_id
    if pad_id is None:
        pad_id = special_id(tokenizer, ENDOFTEXT)
    return (end_id if end_id is not None else tokenizer.eos_token_id), pad_id
