"""Checks of a checkpoint folder that catch what would otherwise load and answer nonsense, or hang.

Each failure is one :class:`ModelSourceError` line naming the file and the value:

* :func:`check_file_kinds`: every file a loader opens is a regular file (a FIFO named
  ``model.safetensors`` would block the reader for ever; a socket or device is no better);
* :func:`check_config_numbers`: ``rms_norm_eps`` and ``rope_theta`` finite and positive, the
  token ids (``eos_token_id``, ``bos_token_id``, ``pad_token_id``) inside the vocabulary, a known
  ``dtype``;
* :func:`check_weights`: from the safetensors headers, every Qwen3 tensor is there (none
  missing, none without a place in the model: a truncated download or another model's
  weights), each has the shape config.json implies, and a sample of each floating-point tensor (a few thousand elements, read
  directly from the file: no torch) holds no NaN or infinity;
* :func:`check_chat_template`: the tokenizer's chat template parses and renders a plain
  conversation.

All of them read headers and small samples only: milliseconds even for an 8 GB checkpoint.
"""
from __future__ import annotations

import json
import math
import stat
import struct
from pathlib import Path

from qwen_trt.errors import ModelSourceError

# The files loaders read from a checkpoint folder (the same patterns a hub download fetches).
CHECKPOINT_PATTERNS = ("*.json", "*.safetensors", "*.bin", "*.txt", "*.jinja", "*.model",
                       "tokenizer*")

# config.json / generation_config.json keys that hold token ids (an int, a list of ints, or null).
TOKEN_ID_KEYS = ("eos_token_id", "bos_token_id", "pad_token_id", "decoder_start_token_id")

# The dtype names transformers accepts in config.json ("torch_dtype" in 4.x, "dtype" in 5.x).
CONFIG_DTYPES = ("float32", "float16", "bfloat16", "float64", "float", "half", "double",
                 "auto")

SAMPLE_BLOCKS = 4            # contiguous blocks read per tensor, spread over its data
SAMPLE_BLOCK_ELEMS = 1024    # elements per block: at most 4096 per tensor

# safetensors dtype -> bytes per element, for the floating-point dtypes sampled for NaN / inf.
_FLOAT_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1}


def _kind(mode: int) -> str | None:
    """What a non-regular file is, in words (None for a regular file)."""
    if stat.S_ISREG(mode):
        return None
    for test, what in ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
                       (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device")):
        if test(mode):
            return what
    return "not a regular file"


def check_file_kinds(folder: Path) -> None:
    """Every entry of ``folder`` a loader would open (:data:`CHECKPOINT_PATTERNS`) is a regular
    file, or a link to one; checked with ``stat`` only, never opened."""
    seen: set[Path] = set()
    for pattern in CHECKPOINT_PATTERNS:
        for p in sorted(folder.glob(pattern)):
            if p in seen:
                continue
            seen.add(p)
            try:
                mode = p.stat().st_mode              # follows links (the hub cache uses them)
            except FileNotFoundError:
                raise ModelSourceError(f"{p} is a broken link (its target does not exist): the "
                                       f"checkpoint is incomplete; download it again.") from None
            except OSError as e:
                raise ModelSourceError(f"{p} cannot be read ({e.strerror or e}).") from e
            what = _kind(mode)
            if what is not None:
                raise ModelSourceError(f"{p} is {what}, not a regular file: a checkpoint file "
                                       f"must be a plain file; replace it with the real one.")


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _positive_finite(config: dict, key: str, cfg_file: str, value=None) -> None:
    value = config.get(key) if value is None else value
    if value is None or not _number(value):
        return                                       # absent, or the type check's to report
    if not math.isfinite(value) or value <= 0:
        raise ModelSourceError(f"{cfg_file}: '{key}' is {value!r}; it must be a finite number "
                               f"above 0: the config is broken.")


def check_token_ids(config: dict, vocab: int, cfg_file: str) -> None:
    """The token-id keys of ``config`` are ids inside ``range(vocab)`` (or null)."""
    for key in TOKEN_ID_KEYS:
        value = config.get(key)
        if value is None:
            continue
        ids = value if isinstance(value, list) else [value]
        for tid in ids:
            if type(tid) is not int or not 0 <= tid < vocab:
                raise ModelSourceError(f"{cfg_file}: '{key}' is {value!r}, not a token id of the "
                                       f"model's vocabulary (0 to {vocab - 1}, vocab_size "
                                       f"{vocab}): the config is broken.")


def check_config_numbers(config: dict, vocab: int, cfg_file: str) -> None:
    """The numbers of a Qwen3 config.json that load without error but compute nonsense."""
    _positive_finite(config, "rms_norm_eps", cfg_file)
    _positive_finite(config, "rope_theta", cfg_file)
    rope = config.get("rope_parameters")
    if isinstance(rope, dict):                       # transformers 5 keeps rope_theta here
        _positive_finite(rope, "rope_theta", cfg_file)
    check_token_ids(config, vocab, cfg_file)
    for key in ("dtype", "torch_dtype"):
        value = config.get(key)
        if isinstance(value, str) and value not in CONFIG_DTYPES:
            raise ModelSourceError(f"{cfg_file}: '{key}' is {value!r}, not a dtype (use one of "
                                   f"{', '.join(CONFIG_DTYPES[:3])}).")


def expected_shapes(shape) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape for a Qwen3 checkpoint of ``shape`` (a :class:`ModelShape`)."""
    h, hd = shape.hidden, shape.head_dim
    q, kv = shape.heads * hd, shape.kv_heads * hd
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (shape.vocab, h),
                                       "lm_head.weight": (shape.vocab, h),
                                       "model.norm.weight": (h,)}
    for i in range(shape.layers):
        p = f"model.layers.{i}."
        out.update({p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
                    p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
                    p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q),
                    p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,),
                    p + "mlp.gate_proj.weight": (shape.intermediate, h),
                    p + "mlp.up_proj.weight": (shape.intermediate, h),
                    p + "mlp.down_proj.weight": (h, shape.intermediate)})
    return out


def _header(f) -> tuple[dict, int]:
    """A safetensors file's header (name -> entry) and where its data starts."""
    (n,) = struct.unpack("<Q", f.read(8))
    header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    return header, 8 + n


def _non_finite(raw: bytes, dtype: str) -> int:
    """How many of the elements in ``raw`` (of safetensors ``dtype``) are NaN or infinite."""
    import numpy as np

    if dtype == "F8_E4M3":                            # e4m3fn: no infinity; NaN is S.1111.111
        return int(np.count_nonzero((np.frombuffer(raw, np.uint8) & 0x7F) == 0x7F))
    if dtype == "F8_E5M2":                            # exponent all ones: inf or NaN
        return int(np.count_nonzero((np.frombuffer(raw, np.uint8) & 0x7C) == 0x7C))
    if dtype == "BF16":                               # the top half of a float32
        values = (np.frombuffer(raw, "<u2").astype(np.uint32) << 16).view(np.float32)
    else:
        values = np.frombuffer(raw, {"F64": "<f8", "F32": "<f4", "F16": "<f2"}[dtype])
    return int(values.size - np.count_nonzero(np.isfinite(values)))


def _sample(f, start: int, end: int, size: int) -> bytes:
    """Up to SAMPLE_BLOCKS blocks of SAMPLE_BLOCK_ELEMS elements spread over [start, end)."""
    n = (end - start) // size
    block = min(n, SAMPLE_BLOCK_ELEMS)
    if block == 0:
        return b""
    blocks = min(SAMPLE_BLOCKS, max(1, n // block))
    parts = []
    for i in range(blocks):
        first = (n - block) * i // max(1, blocks - 1) if blocks > 1 else 0
        f.seek(start + first * size)
        parts.append(f.read(block * size))
    return b"".join(parts)


# Tensors a Qwen3 checkpoint may hold beyond the model's (transformers ignores them too).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
NAMED_AT_MOST = 3            # tensor names one error line quotes (then "and N more")


def _names(names: list[str]) -> str:
    shown = ", ".join(names[:NAMED_AT_MOST])
    more = len(names) - NAMED_AT_MOST
    return shown + (f" and {more} more" if more > 0 else "")


def check_tensor_names(present: set[str], shape, where: str) -> None:
    """Every tensor of a Qwen3 model of ``shape`` is in ``present`` (the names of the
    checkpoint's safetensors headers), and nothing there lacks a place in it; one line naming
    them (``where``: the file, or the folder of a sharded checkpoint). A quantized projection
    counts by its stem (``q_proj.qweight`` / ``scales`` / ``weight_scale_inv`` ...); the LM
    head may be absent when the embeddings are tied."""
    want = expected_shapes(shape)
    stems = {n.rsplit(".", 1)[0] for n in want}
    have_stems = {n.rsplit(".", 1)[0] for n in present}
    missing = sorted((n for n in want if n not in present and n.rsplit(".", 1)[0] not in have_stems
                      and not (n == "lm_head.weight" and shape.tied_embeddings)),
                     key=_layer_order)
    unexpected = sorted((n for n in present if n.rsplit(".", 1)[0] not in stems
                         and not n.endswith(_IGNORED_SUFFIXES)), key=_layer_order)
    problems = []
    if missing:
        problems.append(f"{len(missing)} of the model's {len(want)} tensors missing "
                        f"({_names(missing)})")
    if unexpected:
        problems.append(f"{len(unexpected)} unexpected tensor{'s' if len(unexpected) > 1 else ''}"
                        f" ({_names(unexpected)}) that a {shape.layers}-layer Qwen3 has no "
                        f"place for")
    if problems:
        cause = ("the checkpoint is incomplete (a truncated or interrupted download?); download "
                 "it again" if missing else "the weights and config.json are from different "
                 "models")
        raise ModelSourceError(f"{where}: {'; '.join(problems)}: {cause}.")


def _layer_order(name: str):
    """Names in model order (layer 2 before layer 10)."""
    return [int(p) if p.isdigit() else p for p in name.split(".")]


def check_weights(files, shape) -> None:
    """Shapes (from the headers) and a NaN / inf sample of every floating-point tensor in
    ``files`` (safetensors files whose headers are known to be whole), then that the tensors
    are the model's, all of them (:func:`check_tensor_names`)."""
    want = expected_shapes(shape)
    present: set[str] = set()
    files = [Path(p) for p in files]
    for path in files:
        path = Path(path)
        with open(path, "rb") as f:
            header, base = _header(f)
            present.update(header)
            for name in sorted(header):
                entry = header[name]
                dtype, dims = entry.get("dtype"), tuple(entry.get("shape") or ())
                size = _FLOAT_BYTES.get(dtype)
                if size is None:                      # integer / packed (quantized) data
                    continue
                expected = want.get(name)
                if expected is not None and dims != expected:
                    raise ModelSourceError(
                        f"{path}: tensor '{name}' has shape {list(dims)}, but config.json "
                        f"implies {list(expected)} (hidden_size {shape.hidden}, vocab_size "
                        f"{shape.vocab}, ...): the weights and the config are from different "
                        f"models.")
                begin, end = (int(x) for x in entry["data_offsets"])
                raw = _sample(f, base + begin, base + end, size)
                bad = _non_finite(raw, dtype) if raw else 0
                if bad:
                    n = len(raw) // size
                    raise ModelSourceError(
                        f"{path}: tensor '{name}' holds NaN or infinite values ({bad} of {n} "
                        f"sampled): the weights are broken; download them again.")
    if not files:
        return                     # no safetensors (a .bin checkpoint): its loader checks it
    where = str(files[0]) if len(files) == 1 else f"{files[0].parent} ({len(files)} weight files)"
    check_tensor_names(present, shape, where)


def check_generation_config(folder: Path, vocab: int) -> None:
    """generation_config.json's token ids are inside the vocabulary (when the file exists)."""
    path = folder / "generation_config.json"
    if not path.is_file():
        return
    try:
        value = json.loads(path.read_bytes().decode("utf-8"))
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as e:
        raise ModelSourceError(f"{path} is not valid JSON ({str(e)[:200]}): the checkpoint is "
                               f"broken; download it again.") from e
    if isinstance(value, dict):
        check_token_ids(value, vocab, str(path))


# A conversation every chat template must take: the turns the app, the CLI and the API send.
_PROBE = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"},
          {"role": "assistant", "content": "a"}, {"role": "user", "content": "u"}]


def template_file(folder) -> str:
    """Where a folder's chat template comes from, for messages."""
    folder = Path(folder)
    jinja = folder / "chat_template.jinja"
    return str(jinja if jinja.is_file() else folder / "tokenizer_config.json")


def check_chat_template(tokenizer, where: str) -> None:
    """The tokenizer's chat template parses and renders a plain conversation (with and without
    a system prompt); ``where`` names its file. A tokenizer without one is left alone (the
    loader that needs one says so)."""
    if not getattr(tokenizer, "chat_template", None):
        return
    for messages in (_PROBE, _PROBE[1:]):
        try:
            tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        except Exception as e:  # noqa: BLE001 - jinja2's TemplateError family, and what the
            # template's own code raises
            detail = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
            raise ModelSourceError(f"{where}: the chat template does not work "
                                   f"({type(e).__name__}: {detail}): fix or remove it, or "
                                   f"download the checkpoint again.") from e
