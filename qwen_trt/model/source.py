"""Where the checkpoint comes from: a local folder or a Hugging Face hub id, checked to be Qwen3.

Every failure is one :class:`ModelSourceError` line that says what to do.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from qwen_trt import settings
from qwen_trt.errors import ModelSourceError, first_line
from qwen_trt.model.checks import (check_chat_template, check_config_numbers, check_file_kinds,
                                   check_generation_config, check_weights, template_file)

DEFAULT_MODEL_ID = settings.declared("QWEN_TRT_MODEL").default   # Qwen/Qwen3-4B-Instruct-2507
QWEN3_MODEL_TYPES = ("qwen3",)


@dataclass(frozen=True)
class ModelSource:
    """A resolved checkpoint: a local folder with config.json, tokenizer and weights."""

    path: Path
    name: str            # what the user asked for (folder or hub id)
    config: dict

    @property
    def model_type(self) -> str:
        return self.config.get("model_type", "?")


def looks_like_path(spec: str) -> bool:
    """Hub ids look like ``owner/name``; anything else is meant as a folder."""
    return spec.startswith(("/", ".", "~")) or spec.endswith("/") or spec.count("/") != 1


def _offline_help(model_id: str) -> str:
    return (f"Cannot reach the Hugging Face hub to fetch '{model_id}'. On a machine with network run "
            f"`hf download {model_id} --local-dir models/{model_id.split('/')[-1]}`, "
            f"copy the folder here and pass `--model models/{model_id.split('/')[-1]}` "
            f"(or set QWEN_TRT_MODEL); if '{model_id}' was meant as a local folder, it does not "
            f"exist. For an offline demo: `qwen-trt tiny-model .models/tiny-qwen3`.")


def _download(model_id: str) -> Path:
    """Download (or reuse the cache of) a hub checkpoint, with huggingface_hub's progress bars."""
    try:
        from huggingface_hub import snapshot_download
    except ImportError as e:  # pragma: no cover - a dependency of transformers
        raise ModelSourceError("huggingface_hub is not installed: pip install huggingface_hub") from e
    try:
        return Path(snapshot_download(
            model_id,
            allow_patterns=["*.json", "*.safetensors", "*.txt", "*.jinja", "*.model", "tokenizer*"],
        ))
    except Exception as e:  # network, auth, not found: all mean "give me a local folder"
        name = type(e).__name__
        if name in ("RepositoryNotFoundError", "GatedRepoError", "RevisionNotFoundError"):
            raise ModelSourceError(
                f"'{model_id}' is not a model on the Hugging Face hub and not a local folder: "
                f"check the id or pass an existing folder with --model.") from e
        raise ModelSourceError(_offline_help(model_id) + f" ({name})") from e


# config.json keys the loaders read beyond the shape (:class:`ModelShape` checks those), and
# what each must be (bool is not a number here).
_OPTIONAL_TYPES = {"rope_theta": (int, float), "rms_norm_eps": (int, float), "torch_dtype": str,
                   "dtype": str, "architectures": list}
_TYPE_NAMES = {str: "a string", list: "a list", (int, float): "a number"}


def _is(value, kind) -> bool:
    if isinstance(value, bool) and kind is not bool:
        return False
    return isinstance(value, kind)


def check_qwen3_config(config: dict, where: str, cfg_file: str | None = None):
    """``config`` (from ``cfg_file``, default ``where/config.json``) is a Qwen3 config with a
    complete, well-typed shape and sound numbers; returns the shape (:class:`ModelShape`)."""
    from qwen_trt.model.shape import ModelShape

    cfg_file = cfg_file or f"{where}/config.json"
    if not isinstance(config, dict):
        raise ModelSourceError(f"{cfg_file} is not a JSON object (it holds a "
                               f"{type(config).__name__}): the checkpoint is broken.")
    model_type = config.get("model_type")
    if model_type not in QWEN3_MODEL_TYPES:
        archs = ",".join(config.get("architectures") or []) or "unknown architecture"
        raise ModelSourceError(
            f"{where} is a '{model_type}' checkpoint ({archs}), not Qwen3: qwen-trt serves "
            f"Qwen3 models such as {DEFAULT_MODEL_ID}. Pass a Qwen3 folder with --model.")
    shape = ModelShape.from_config(config, cfg_file)
    for key, kind in _OPTIONAL_TYPES.items():
        if config.get(key) is not None and not _is(config[key], kind):
            raise ModelSourceError(f"{cfg_file}: '{key}' is {config[key]!r}; expected "
                                   f"{_TYPE_NAMES[kind]}.")
    check_config_numbers(config, shape.vocab, cfg_file)
    return shape


def _json_problem(e: BaseException) -> str:
    """Why a JSON file did not parse, in one short line."""
    if isinstance(e, RecursionError):
        return "nested too deeply"
    return str(e).splitlines()[0][:200] if str(e) else type(e).__name__


def _read_json_object(path: Path, what: str) -> dict:
    try:
        value = json.loads(path.read_bytes().decode("utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise ModelSourceError(f"{path} is not valid JSON ({_json_problem(e)}): the {what} is "
                               f"broken; download it again.") from e
    if not isinstance(value, dict):
        raise ModelSourceError(f"{path} is not a JSON object: the {what} is broken; download "
                               f"it again.")
    return value


# safetensors' header errors, in words.
_SAFETENSORS_PROBLEMS = (("too small", "empty or shorter than a header"),
                         ("incomplete metadata", "truncated (shorter than its header says)"),
                         ("not fully covered", "truncated (shorter than its header says)"),
                         ("invalid json", "corrupt (its header is not valid JSON)"),
                         ("too large", "corrupt (its header size is impossible)"))


def check_weight_files(folder: Path, shape=None) -> None:
    """Every weight file named by the index exists, and every safetensors header is whole and
    matches the file's size (read from the header only: fast even for large shards); with the
    config's ``shape`` (:class:`ModelShape`), every tensor's shape fits it and a sample of its
    values is finite (:func:`qwen_trt.model.checks.check_weights`)."""
    from safetensors import safe_open

    for index in sorted(folder.glob("*.safetensors.index.json")):
        weight_map = _read_json_object(index, "weight index").get("weight_map")
        if not isinstance(weight_map, dict):
            raise ModelSourceError(f"{index} has no 'weight_map' object: the checkpoint is broken.")
        for shard in sorted(set(map(str, weight_map.values()))):
            if not (folder / shard).is_file():
                raise ModelSourceError(f"{folder / shard} is missing (named in {index.name}): "
                                       f"the download is incomplete.")
    files = sorted(folder.glob("*.safetensors"))
    for f in files:
        try:
            with safe_open(str(f), framework="numpy") as fh:   # the header only: no torch
                fh.keys()
        except Exception as e:    # SafetensorError, OSError: the file, not the code, is wrong
            detail = first_line(e) or type(e).__name__
            what = next((w for key, w in _SAFETENSORS_PROBLEMS if key in detail.lower()),
                        f"not a readable safetensors file ({detail})")
            raise ModelSourceError(f"{f} is {what}: the checkpoint is broken; download it "
                                   f"again.") from e
    if shape is not None:
        check_weights(files, shape)


def check_tokenizer_files(folder: Path, vocab: int | None = None):
    """tokenizer.json parses as a tokenizer (whose ids all fit the model's ``vocab``, when
    given); tokenizer_config.json is a JSON object. Returns the parsed ``tokenizers.Tokenizer``
    (None without a tokenizer.json)."""
    cfg = folder / "tokenizer_config.json"
    if cfg.is_file():
        _read_json_object(cfg, "tokenizer")
    tok = folder / "tokenizer.json"
    parsed = None
    if tok.is_file():
        from tokenizers import Tokenizer

        try:
            parsed = Tokenizer.from_file(str(tok))
            size = parsed.get_vocab_size(with_added_tokens=True)
        except Exception as e:    # the tokenizers library raises a bare Exception
            detail = first_line(e) or type(e).__name__
            raise ModelSourceError(f"{tok} is not a valid tokenizer ({detail[:200]}): the "
                                   f"checkpoint is broken; download it again.") from e
        if vocab is not None and size > vocab:
            raise ModelSourceError(f"{tok} has {size} tokens, more than the model's vocab_size "
                                   f"{vocab} (config.json): the tokenizer is from another "
                                   f"model.")
    return parsed


def resolve_model(spec: str | None = None, *, check_tokenizer: bool = True) -> ModelSource:
    """Resolve ``spec`` (folder or hub id; default from QWEN_TRT_MODEL or the Qwen3-4B id).
    ``check_tokenizer=False`` leaves :func:`check_tokenizer_files` (a parse of tokenizer.json,
    a large part of this on the real vocabulary) to the caller: the fast backend runs it on the
    thread that loads the tokenizer, beside the weights."""
    spec = spec or settings.get("QWEN_TRT_MODEL")
    path = Path(spec).expanduser()
    if path.is_dir():
        local = path
    elif path.exists():
        raise ModelSourceError(f"--model '{spec}' is a file, not a checkpoint folder: pass the "
                               f"folder that holds config.json and the weights.")
    elif looks_like_path(spec):
        raise ModelSourceError(
            f"Model folder '{spec}' does not exist. Pass an existing Qwen3 checkpoint folder with "
            f"--model, or create the offline demo model: `qwen-trt tiny-model {spec}`.")
    else:
        local = _download(spec)
    check_file_kinds(local)              # before anything is opened: a FIFO blocks a reader
    cfg_path = local / "config.json"
    if not cfg_path.is_file():
        raise ModelSourceError(
            f"'{spec}' has no config.json: it is not a Hugging Face checkpoint folder.")
    try:
        config = json.loads(cfg_path.read_bytes().decode("utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise ModelSourceError(f"{cfg_path} is not valid JSON: {_json_problem(e)}") from e
    shape = check_qwen3_config(config, f"'{spec}'", str(cfg_path))
    check_generation_config(local, shape.vocab)
    if not any(local.glob("*.safetensors")) and not any(local.glob("*.bin")):
        raise ModelSourceError(f"'{spec}' has no weights (*.safetensors): the download is incomplete.")
    if not (local / "tokenizer.json").is_file() and not (local / "vocab.json").is_file():
        raise ModelSourceError(f"'{spec}' has no tokenizer files (tokenizer.json).")
    check_weight_files(local, shape)
    if check_tokenizer:
        check_tokenizer_files(local, shape.vocab)
    return ModelSource(path=local, name=spec, config=config)


def load_tokenizer(path: str | os.PathLike, name: str | None = None):
    """The checkpoint's own tokenizer (and chat template) from a folder; a broken one is one
    clear :class:`ModelSourceError` line naming ``name`` (default: the folder)."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as e:
        raise ModelSourceError(f"Could not load the tokenizer of '{name or path}': "
                               f"{first_line(e) or type(e).__name__}") from e
    check_chat_template(tokenizer, template_file(path))
    return tokenizer
