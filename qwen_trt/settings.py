"""Every ``QWEN_TRT_*`` environment variable, declared once: name, type, default, group, doc.

This module imports nothing of ``qwen_trt``, so every layer (the fast path's kernels included)
can read its settings here. :func:`get` parses a variable by its declaration (an empty value
counts as unset); a bad value raises :class:`SettingError` (a ``ValueError``) naming the
variable; :func:`parse_bool` is the one reading of an on/off text. :func:`unknown` lists the
``QWEN_TRT_*`` names in an environment that no declaration knows, and :func:`warn_unknown`
prints one line for them (a mistyped name would otherwise be ignored silently).

A declaration's ``doc`` is the one text of the setting: the ``--help`` of its flag
(:attr:`Setting.help`), README's configuration table and docs/settings.md are made from it.
``python -m qwen_trt.settings --write`` (``make docs-settings``) regenerates both documents;
``--check`` says whether they are current (``tests/test_settings.py`` runs it).

Groups (:data:`GROUPS`): ``user`` (what a person running the app, the CLI, ``qwen-trt serve``,
the build or the container sets; README lists them), ``tuning`` (switches of the fast path,
read once when its kernels are configured: :mod:`qwen_trt.fast.options`; for sweeps and
bisecting), ``test`` (the test suite, its tools and the benchmarks).
"""
from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

Group = Literal["user", "tuning", "test"]
GROUPS: dict[str, str] = {
    "user": "Set by whoever runs the app, the CLI, `qwen-trt serve`, the engine build or the "
            "container. A flag, where there is one, wins over its variable.",
    "tuning": "Switches of the fast path's kernels, read once when they are configured "
              "(`qwen_trt/fast/options.py`): for sweeps, profiling and bisecting. The defaults "
              "are what ships.",
    "test": "The test suite, its tools and the benchmarks.",
}
Kind = Literal["str", "int", "float", "bool", "path"]
PREFIX = "QWEN_TRT_"
TRUE_WORDS = ("1", "true", "yes", "on")
FALSE_WORDS = ("0", "false", "no", "off")


class SettingError(ValueError):
    """An environment variable holds a value its declaration does not allow."""


def parse_bool(text: str) -> bool:
    """``1 true yes on`` / ``0 false no off`` (any case, spaces around ignored); else
    ValueError. The one reading of an on/off text in the project."""
    low = text.strip().lower()
    if low in TRUE_WORDS:
        return True
    if low in FALSE_WORDS:
        return False
    raise ValueError(f"{text!r}: expected one of {', '.join(TRUE_WORDS + FALSE_WORDS)}")


@dataclass(frozen=True)
class Setting:
    name: str                    # the variable, QWEN_TRT_...
    kind: Kind
    default: object
    doc: str                     # one line: what it does (its flag's --help, README, reference)
    group: Group = "user"
    flag: str | None = None      # the CLI flag that sets the same value (it wins)
    choices: tuple[str, ...] = ()
    pattern: bool = False        # name is a prefix: QWEN_TRT_GEMV_<N>x<K>
    default_doc: str | None = None   # the default in words, where the value alone says too little

    def parse(self, raw: str) -> object:
        raw = raw.strip()
        try:
            if self.kind == "int":
                return int(raw)
            if self.kind == "float":
                return float(raw)
            if self.kind == "bool":
                return parse_bool(raw)
        except ValueError:
            raise SettingError(f"{self.name}={raw!r}: expected {_KIND_WORDS[self.kind]}") from None
        if self.choices and raw not in self.choices:
            raise SettingError(f"{self.name}={raw!r}: expected one of {', '.join(self.choices)}")
        return raw

    @property
    def default_text(self) -> str | None:
        """The default as the docs say it, in Markdown (None: there is none): the value in
        backticks, or ``default_doc`` as written."""
        if self.default_doc is not None:
            return self.default_doc
        if self.default is None:
            return None
        if self.kind == "bool":
            return "`1`" if self.default else "`0`"
        value = f"{self.default:g}" if isinstance(self.default, float) else str(self.default)
        return f"`{value}`"

    @property
    def help(self) -> str:
        """Its flag's ``--help``: the doc, the default, the variable (plain text, argparse's
        ``%`` escaped)."""
        default = self.default_text
        text = f"{self.doc}{'' if default is None else f' (default {default})'} [env {self.name}]"
        return text.replace("`", "").replace("%", "%%")


_KIND_WORDS = {"int": "a whole number", "float": "a number",
               "bool": "1 or 0 (true/false, yes/no, on/off)", "str": "text", "path": "a path"}

_S = Setting
SETTINGS: tuple[Setting, ...] = (
    # -- the backend (qwen_trt.options; the app, the CLI and qwen-trt serve) ---------------------
    _S("QWEN_TRT_MODEL", "str", "Qwen/Qwen3-4B-Instruct-2507",
       "model folder or hub id; for trtllm the checkpoint of the LLM API path (no engine "
       "folder) or the engine's tokenizer; for openai one of the server's models (default: its "
       "first)", flag="--model"),
    _S("QWEN_TRT_BACKEND", "str", "auto",
       "auto: TensorRT-LLM when an engine for this GPU exists and tensorrt_llm is installed "
       "(unless --model names another model), else torch; trtllm: that engine, or without one "
       "the --model checkpoint through TensorRT-LLM's LLM API; openai: a remote "
       "OpenAI-compatible server", flag="--backend", choices=("auto", "torch", "trtllm", "openai")),
    _S("QWEN_TRT_ENGINE", "path", None, "TensorRT-LLM engine folder", flag="--engine",
       default_doc="`engines/<gpu>/`"),
    _S("QWEN_TRT_DEVICE", "str", "auto", "torch backend: auto | cpu | cuda | cuda:N (auto: CUDA "
       "if present)", flag="--device"),
    _S("QWEN_TRT_DTYPE", "str", "auto", "torch backend: auto (bfloat16 on CUDA, float32 on CPU) "
       "| float32 | bfloat16 | float16", flag="--dtype",
       choices=("auto", "float32", "bfloat16", "float16")),
    _S("QWEN_TRT_MAX_SEQ_LEN", "int", None,
       "context limit in tokens, prompt + reply (torch backend, the trtllm LLM API path, and "
       "openai when /v1/models does not say)", flag="--max-seq-len",
       default_doc="min(32768, the model's); trtllm: this GPU's build profile"),
    _S("QWEN_TRT_MAX_BATCH", "int", None,
       "fast path: chats decoded together (continuous batching, paged KV, prefix reuse); 1 = "
       "one request at a time on the batch-1 decoder, the lowest single-user latency",
       flag="--max-batch", default_doc="`32`"),
    _S("QWEN_TRT_SPECULATIVE", "str", "off",
       "fast path: speculative decoding: off | ngram (draft-free prompt lookup: several tokens "
       "a step where the reply repeats its context) | eagle3:PATH (an EAGLE-3 draft folder, "
       "either published layout); exact either way", flag="--speculative"),
    _S("QWEN_TRT_NUM_SPECULATIVE_TOKENS", "str", "auto",
       "fast path with --speculative: draft tokens verified a step, 1..8, or auto (from each "
       "request's acceptance and the batch size)", flag="--num-speculative-tokens"),
    _S("QWEN_TRT_FAST", "str", "auto",
       "torch backend: the compiled CUDA-graph fast path: auto (on CUDA) | on | off",
       flag="--fast", choices=("auto", "on", "off")),
    _S("QWEN_TRT_WATCHDOG_S", "float", 30.0,
       "the worker: no step progress for this many seconds while requests wait or run (a hung "
       "GPU or process) and it is killed and restarted, those requests get one error line and "
       "/health says 503 meanwhile; 0 = off", flag="--watchdog-s"),
    _S("QWEN_TRT_MAX_STEP_S", "float", 120.0,
       "a worker step running longer than this stops beating: the watchdog counts it as stuck "
       "(0 = no limit)"),
    _S("QWEN_TRT_GRAMMAR_MAX_BYTES", "int", 65536,
       "largest JSON schema (a tool_choice: all the tools' schemas together) in bytes; larger: 400"),
    _S("QWEN_TRT_GRAMMAR_MAX_DEPTH", "int", 64,
       "deepest nesting of objects and arrays in a JSON schema document; deeper: 400"),
    _S("QWEN_TRT_GRAMMAR_MAX_ENUM", "int", 4096,
       "most enum values plus consts in one grammar's schemas; more: 400"),
    _S("QWEN_TRT_GRAMMAR_BUDGET_S", "float", 5.0,
       "seconds a grammar may take to check or compile; longer: 400 (API) or the request fails"),
    _S("QWEN_TRT_RESTART_BACKOFF_S", "float", 1.0,
       "the worker, once it died: started again at once by itself; while starts keep failing (a "
       "crash during the load or soon after), the next waits this many seconds, doubling each "
       "time (/health 503 \"crashing\"); docs/deploy.md"),
    _S("QWEN_TRT_RESTART_BACKOFF_MAX_S", "float", 60.0,
       "the worker: the longest wait between two starts; a start that stays up this long ends "
       "the streak"),
    _S("QWEN_TRT_RESTART_KEEP", "int", 3,
       "the worker: deaths in a row that queued requests wait through; then they, and new ones, "
       "get a 503 until a start succeeds"),
    _S("QWEN_TRT_QUANTIZATION", "str", "auto",
       "fast path weights: auto (as the checkpoint has them: bf16, or an FP8 / AWQ / GPTQ "
       "checkpoint) | none (dequantize a packed one) | fp8 | int4 (quantize a bf16 checkpoint "
       "at load); docs/fast-path.md", flag="--quantization",
       choices=("auto", "none", "fp8", "int4")),
    _S("QWEN_TRT_CACHE_DIR", "path", "~/.cache/qwen-trt",
       "fast path on CUDA: where compiled kernels, the autotuners' choices and the warm-up's "
       "timed choices are kept between starts, a folder per GPU, driver, torch, Triton, dtype, "
       "shapes, weight format, batch buckets and kernel-source hash, so a second start skips "
       "those timings (a stale or corrupt one is reported in one line and rebuilt); off: none",
       flag="--cache-dir"),
    _S("QWEN_TRT_BASE_URL", "str", None,
       "openai backend: an OpenAI-compatible server, e.g. http://127.0.0.1:8000/v1",
       flag="--base-url"),
    _S("QWEN_TRT_API_KEY", "str", None,
       "openai backend: the key to send; qwen-trt serve: the key clients must send as "
       "'Authorization: Bearer KEY' (required for a non-loopback --host)", flag="--api-key"),
    _S("QWEN_TRT_WORKER", "str", "process",
       "where the model runs: process (its own worker process; a crash or hang restarts it) | "
       "inline (a thread of this process: tests, debugging)", choices=("process", "inline")),
    _S("QWEN_TRT_DEBUG", "bool", False,
       "print the traceback behind an error line (qwen-trt --debug COMMAND sets it, for the "
       "worker too); off: every failure is one line", flag="--debug"),
    # -- qwen-trt serve ---------------------------------------------------------------------------
    _S("QWEN_TRT_HOST", "str", "127.0.0.1",
       "address qwen-trt serve binds (any other than loopback needs an API key)", flag="--host"),
    _S("QWEN_TRT_PORT", "int", 8000, "port of qwen-trt serve", flag="--port"),
    _S("QWEN_TRT_MAX_QUEUE", "int", 256,
       "requests qwen-trt serve lets wait for the worker (then 503 + Retry-After)",
       flag="--max-queue"),
    _S("QWEN_TRT_SSE_KEEPALIVE_S", "float", 10.0,
       "qwen-trt serve: seconds between ': keep-alive' comments on a silent stream (queued, "
       "long prefill), so proxies keep it open; 0 = off", flag="--sse-keepalive-s"),
    _S("QWEN_TRT_MAX_BODY_MB", "float", 16.0,
       "qwen-trt serve: largest request body in MiB; larger ones get 413 (as deploy/nginx.conf)",
       flag="--max-body-mb"),
    _S("QWEN_TRT_HEADER_TIMEOUT_S", "float", 10.0,
       "qwen-trt serve: seconds a client has to send a request's headers (then the connection "
       "is closed)", flag="--header-timeout-s"),
    _S("QWEN_TRT_BODY_TIMEOUT_S", "float", 30.0,
       "qwen-trt serve: seconds a client has to send a request's body after its headers (then "
       "the connection is closed)", flag="--body-timeout-s"),
    _S("QWEN_TRT_SHUTDOWN_GRACE_S", "float", 10.0,
       "qwen-trt serve: on SIGTERM/SIGINT new requests get 503 and in-flight ones this many "
       "seconds to finish; the rest end with an error event; exit 0", flag="--shutdown-grace-s"),
    _S("QWEN_TRT_ALLOWED_ORIGINS", "str", None,
       "qwen-trt serve: comma-separated browser origins (scheme://host[:port] each, or *) "
       "allowed to call the API directly (CORS)", flag="--allowed-origins",
       default_doc="none (no CORS headers)"),
    _S("QWEN_TRT_RESPONSES_STORE", "bool", True,
       "qwen-trt serve: keep responses for previous_response_id and GET /v1/responses/{id}; "
       "--no-responses-store (or 0) keeps none", flag="--no-responses-store"),
    _S("QWEN_TRT_RESPONSES_STORE_MAX", "int", 1024,
       "qwen-trt serve: responses kept at most (the least recently used go first)",
       flag="--responses-store-max"),
    _S("QWEN_TRT_RESPONSES_STORE_MB", "float", 64.0,
       "qwen-trt serve: MiB the kept responses hold at most, their conversations counted whole",
       flag="--responses-store-mb"),
    _S("QWEN_TRT_ALLOWED_HOSTS", "str", None,
       "qwen-trt serve: comma-separated Host names the API answers besides loopback and its own "
       "address (behind a proxy: the name clients use; * = any)", flag="--allowed-hosts",
       default_doc="loopback names and the bound address"),
    _S("QWEN_TRT_ALLOW_SLOW_FALLBACK", "bool", False,
       "qwen-trt serve: start even when a fast-path kernel family fell back to a much slower "
       "path (else it refuses, naming the family and why); docs/fast-path.md",
       flag="--allow-slow-fallback"),
    _S("QWEN_TRT_ACCESS_LOG", "bool", True,
       "qwen-trt serve: one stderr line per request (client, method, path, status, duration, "
       "request id); --no-access-log (or 0) turns it off", flag="--no-access-log"),
    _S("QWEN_TRT_KV_EVENTS", "str", None,
       "qwen-trt serve: publish KV-cache events in vLLM's format (ZMQ PUB, msgpack) on this "
       "endpoint: `tcp://HOST:PORT` connects, `tcp://*:PORT` or `ipc://PATH` binds",
       flag="--kv-events", default_doc="none (no events)"),
    _S("QWEN_TRT_KV_EVENTS_TOPIC", "str", "",
       "qwen-trt serve: the ZMQ topic of the KV-cache events (llm-d's: `kv@<pod-ip>@<model>`)",
       flag="--kv-events-topic", default_doc="empty"),
    # -- build and container ----------------------------------------------------------------------
    _S("QWEN_TRT_ENGINES_DIR", "path", "engines", "where engines are built and looked up "
       "(qwen-trt build --engines-dir)", flag="--engines-dir"),
    _S("QWEN_TRT_PROFILES_DIR", "path", None, "the engine build profiles folder (`<gpu>.toml` each)",
       default_doc="`build/profiles` of the checkout, else of the current folder"),
    _S("QWEN_TRT_IMAGE", "str", None,
       "the container image an engine is built in, written into its manifest.json "
       "(docker/Dockerfile sets it)"),
    _S("QWEN_TRT_BIND", "str", "127.0.0.1",
       "host address docker/compose.yaml publishes the app's and the API's ports on "
       "(0.0.0.0 exposes them: then set QWEN_TRT_API_KEY)"),
    # -- fast-path kernel switches (qwen_trt.fast.options; read once, when the kernels are set up)
    _S("QWEN_TRT_PDL", "bool", True,
       "programmatic dependent launch between the decode kernels (0 to bisect a suspected race)",
       group="tuning"),
    _S("QWEN_TRT_CHAIN", "bool", True,
       "chained greedy decode steps in the batched runner (0: every step syncs on the host)",
       group="tuning"),
    _S("QWEN_TRT_STEP_COMPILE", "bool", True,
       "fused kernels for the batched step's norms/activation pieces (0: plain PyTorch ops, "
       "to debug)", group="tuning"),
    _S("QWEN_TRT_STEP_TRITON", "bool", True,
       "the batched step's norms/activation pieces as Triton kernels (no torch.compile, no "
       "dynamo import at start; batched._pre_triton / _post_triton; 0: compiled by "
       "torch.compile, or QWEN_TRT_STEP_COMPILE's plain ops)", group="tuning"),
    _S("QWEN_TRT_FP8_PREFILL", "str", "auto",
       "FP8 weights' prefill: auto (tensorcore on Hopper when its load-time check passes, "
       "else dequant) | dequant (then bf16 GEMMs) | tensorcore (activations in FP8 per 128 "
       "columns, cuBLAS's block-scaled FP8 GEMM; Hopper, checked at load, else an error)",
       group="tuning", choices=("auto", "dequant", "tensorcore")),
    _S("QWEN_TRT_FP8_TENSOR_CORES", "bool", True,
       "0: act as if the GPU had no FP8 tensor cores (tests the W8A16 fallback anywhere)",
       group="tuning"),
    _S("QWEN_TRT_SELF_CHECKS", "str", "auto",
       "fast path kernel self-checks: auto (skipped when the warm compile cache recorded them "
       "passing for these weights) | always (every start)", group="tuning",
       choices=("auto", "always")),
    _S("QWEN_TRT_ATTN_SPLIT", "int", None,
       "keys per split of the batch-1 RoPE attention (for sweeps)", group="tuning",
       default_doc="`64`"),
    _S("QWEN_TRT_PAGED_SPLIT", "int", None,
       "keys per split of the paged RoPE attention (for sweeps)", group="tuning",
       default_doc="`64` for one row, else `128`"),
    _S("QWEN_TRT_GEMV_", "str", None,
       "`QWEN_TRT_GEMV_<N>x<K>=block_n:warps:ctas_per_sm`: the persistent configuration of the "
       "GEMV of one (N, K) weight shape (for sweeps)", group="tuning", pattern=True,
       default_doc="the tuned table in `qwen_trt/fast/kernels/gemv.py`"),
    # -- tests, tools and benchmarks --------------------------------------------------------------
    _S("QWEN_TRT_TRACE_HOPS", "bool", False,
       "qwen-trt serve: time each hop of a request, summed at GET /debug/hops (the HTTP "
       "benchmarks set it)", group="test"),
    _S("QWEN_TRT_TEST_LOADER", "str", None,
       "the worker loads its backend with this 'module:function' instead (the tests' fakes: a "
       "slow or crashing load)", group="test"),
    _S("QWEN_TRT_APP_SEED_DIR", "path", None,
       "folder of saved chats the app starts from (the browser tests and the UI benchmark)",
       group="test"),
    _S("QWEN_TRT_TRITON_PATH", "path", ".venv-triton",
       "a Triton copy for the kernel interpreter tests (make test-kernels sets it)",
       group="test"),
    _S("QWEN_TRT_QWEN_VOCAB_GGUF", "path", None,
       "llama.cpp's ggml-vocab-qwen2.gguf, for the real-vocabulary tokenizer test (skipped "
       "without it)", group="test"),
    _S("QWEN_TRT_PROPERTY_EXAMPLES", "int", 400,
       "examples per property test of the Markdown sanitiser", group="test"),
    _S("QWEN_TRT_CORPUS", "path", None,
       "the Markdown payload file the browser sanitiser test loads (the test writes it and "
       "starts the page with it)", group="test"),
)

BY_NAME: dict[str, Setting] = {s.name: s for s in SETTINGS}


def declared(name: str) -> Setting:
    """The declaration of ``name`` (a pattern setting matches by prefix); KeyError if none."""
    if name in BY_NAME:
        return BY_NAME[name]
    for s in SETTINGS:
        if s.pattern and name.startswith(s.name):
            return s
    raise KeyError(f"{name} is not a declared qwen-trt setting (qwen_trt/settings.py)")


def raw(name: str, environ: Mapping[str, str] | None = None) -> str | None:
    """The variable's text, stripped; None when unset or empty. ``name`` must be declared."""
    declared(name)
    env = os.environ if environ is None else environ
    val = env.get(name)
    val = val.strip() if isinstance(val, str) else val
    return val or None


def get(name: str, environ: Mapping[str, str] | None = None):
    """The parsed value of ``name``, or its declared default."""
    s = declared(name)
    val = raw(name, environ)
    return s.default if val is None else s.parse(val)


def prefixed(prefix: str, environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The variables of a declared pattern (``prefix``, e.g. ``QWEN_TRT_GEMV_``) set in
    ``environ``, by the rest of their names: their stripped, non-empty values."""
    if not declared(prefix).pattern:
        raise KeyError(f"{prefix} is not a declared pattern (qwen_trt/settings.py)")
    env = os.environ if environ is None else environ
    return {name[len(prefix):]: val.strip() for name, val in env.items()
            if name.startswith(prefix) and isinstance(val, str) and val.strip()}


def unknown(environ: Mapping[str, str] | None = None) -> list[str]:
    """``QWEN_TRT_*`` names set in ``environ`` that no declaration knows."""
    env = os.environ if environ is None else environ
    out = []
    for name in sorted(env):
        if name.startswith(PREFIX):
            try:
                declared(name)
            except KeyError:
                out.append(name)
    return out


_warned: set[str] = set()


def warn_unknown(environ: Mapping[str, str] | None = None, stream=None) -> list[str]:
    """Print one line naming the unknown ``QWEN_TRT_*`` variables (once per name a process)."""
    names = [n for n in unknown(environ) if n not in _warned]
    if names:
        _warned.update(names)
        print(f"warning: unknown qwen-trt setting{'s' if len(names) > 1 else ''} ignored: "
              f"{', '.join(names)} (the known ones: qwen_trt/settings.py, README "
              f"'Configuration')", file=stream or sys.stderr)
    return names


# -- the documents made from the declarations ----------------------------------------------------
ROOT = Path(__file__).resolve().parent.parent          # the checkout (README.md, docs/)
README_BEGIN = ("<!-- settings:begin: generated from qwen_trt/settings.py by `make docs-settings`; "
                "edit the declarations, not this table -->")
README_END = "<!-- settings:end -->"
REGENERATE = "make docs-settings (python -m qwen_trt.settings --write)"


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def _code(text: str | None) -> str:
    return "" if not text else f"`{text}`"


def _display_name(s: Setting) -> str:
    return f"{s.name}<N>x<K>" if s.pattern else s.name    # in backticks: <N> is no HTML


def problems() -> list[str]:
    """What keeps the declarations from making the documents: a group that is not one of
    :data:`GROUPS`, a doc that is empty or not one line, a ``<`` outside backticks (Markdown
    would read it as HTML)."""
    out = []
    for s in SETTINGS:
        if s.group not in GROUPS:
            out.append(f"{s.name}: group {s.group!r} is not one of {', '.join(GROUPS)}")
        for what, text in (("doc", s.doc), ("default_doc", s.default_doc)):
            if what == "doc" and (not text or "\n" in text):
                out.append(f"{s.name}: the doc must be one non-empty line")
            if text and "<" in "".join(text.split("`")[::2]):
                out.append(f"{s.name}: its {what} has a '<' outside backticks")
    return out


def _check_groups() -> None:
    if bad := problems():
        raise ValueError("qwen_trt/settings.py: " + "; ".join(bad))


def readme_table() -> str:
    """README's configuration table: the ``user`` settings, in declaration order."""
    _check_groups()
    rows = ["| variable | flag | default | what |", "|---|---|---|---|"]
    for s in SETTINGS:
        if s.group == "user":
            rows.append(f"| `{_display_name(s)}` | {_code(s.flag)} | "
                        f"{_cell(s.default_text or 'none')} | {_cell(s.doc)} |")
    return "\n".join(rows)


def reference() -> str:
    """docs/settings.md: every declaration, by group."""
    _check_groups()
    out = ["# Settings reference", "",
           "Every `QWEN_TRT_*` environment variable the project reads, generated from its one "
           "declaration in `qwen_trt/settings.py` (regenerate: `make docs-settings`; "
           "`tests/test_settings.py` fails when this file is stale). An empty value counts as "
           "unset; a value its type does not allow is refused with one line naming the "
           "variable; an unknown `QWEN_TRT_*` name gets one warning line. Booleans read "
           f"{' / '.join(TRUE_WORDS)} as on and {' / '.join(FALSE_WORDS)} as off.", ""]
    for group, about in GROUPS.items():
        members = [s for s in SETTINGS if s.group == group]
        if not members:
            continue
        out += [f"## {group}", "", about, "",
                "| variable | type | flag | default | what |", "|---|---|---|---|---|"]
        for s in members:
            kind = s.kind if not s.choices else " \\| ".join(s.choices)
            out.append(f"| `{_display_name(s)}` | {kind} | {_code(s.flag)} | "
                       f"{_cell(s.default_text or 'none')} | {_cell(s.doc)} |")
        out.append("")
    return "\n".join(out)


def with_readme_table(readme: str) -> str:
    """``readme`` with the text between its settings markers replaced by :func:`readme_table`."""
    head, sep, rest = readme.partition(README_BEGIN)
    _, sep2, tail = rest.partition(README_END)
    if not sep or not sep2:
        raise ValueError(f"README.md lacks the markers {README_BEGIN!r} ... {README_END!r}")
    return f"{head}{README_BEGIN}\n{readme_table()}\n{README_END}{tail}"


def documents(root: Path = ROOT) -> dict[Path, str]:
    """The generated files, by path, as they should read."""
    return {root / "README.md": with_readme_table((root / "README.md").read_text()),
            root / "docs" / "settings.md": reference()}


def stale(root: Path = ROOT) -> list[Path]:
    """The generated files that differ from what the declarations make."""
    return [p for p, text in documents(root).items()
            if not p.exists() or p.read_text() != text]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m qwen_trt.settings",
                                description="README's configuration table and docs/settings.md "
                                            "from the declarations")
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--write", action="store_true", help="rewrite the stale files")
    mode.add_argument("--check", action="store_true", help="exit 1 naming the stale files")
    mode.add_argument("--markdown", action="store_true", help="print the reference")
    args = p.parse_args(argv)
    if args.markdown:
        print(reference(), end="")
        return 0
    old = stale()
    if args.check:
        for path in old:
            print(f"{path.relative_to(ROOT)} is stale: run {REGENERATE}", file=sys.stderr)
        return 1 if old else 0
    for path, text in documents().items():
        if path in old:
            path.write_text(text)
            print(f"wrote {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
