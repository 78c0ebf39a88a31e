"""``qwen-trt serve``: the OpenAI-compatible HTTP API on this machine's engine.

``qwen-trt serve [--model ...|--engine ...] [--host 127.0.0.1] [--port 8000] [--api-key KEY]``.
Binds 127.0.0.1 unless told otherwise; any other address needs a key (``--api-key`` or
``QWEN_TRT_API_KEY``). See :mod:`qwen_trt.api` and docs/deploy.md.
"""
from __future__ import annotations

import os
import sys

from qwen_trt import settings
from qwen_trt.errors import ConfigError

ENV_KEY = "QWEN_TRT_API_KEY"
# The server's own options, in --help order: each flag, default and doc from its declaration
# (qwen_trt.settings), parsed here as ServerSettings' field of the same name.
SERVER_SETTINGS = (
    ("QWEN_TRT_HOST", "host"), ("QWEN_TRT_PORT", "port"), ("QWEN_TRT_MAX_QUEUE", "max_queue"),
    ("QWEN_TRT_SSE_KEEPALIVE_S", "sse_keepalive_s"), ("QWEN_TRT_MAX_BODY_MB", "max_body_mb"),
    ("QWEN_TRT_HEADER_TIMEOUT_S", "header_timeout_s"),
    ("QWEN_TRT_BODY_TIMEOUT_S", "body_timeout_s"),
    ("QWEN_TRT_SHUTDOWN_GRACE_S", "shutdown_grace_s"),
    ("QWEN_TRT_ALLOWED_ORIGINS", "allowed_origins"),
    ("QWEN_TRT_RESPONSES_STORE_MAX", "responses_store_max"),
    ("QWEN_TRT_RESPONSES_STORE_MB", "responses_store_mb"),
    ("QWEN_TRT_ALLOWED_HOSTS", "allowed_hosts"),
    ("QWEN_TRT_KV_EVENTS", "kv_events"), ("QWEN_TRT_KV_EVENTS_TOPIC", "kv_events_topic"),
)
# on unless their --no-... flag says (or their variable = 0)
SWITCHES = (("QWEN_TRT_RESPONSES_STORE", "responses_store"), ("QWEN_TRT_ACCESS_LOG", "access_log"))


def register(sub) -> None:
    from qwen_trt.options import add_backend_args

    p = sub.add_parser("serve", help="OpenAI-compatible HTTP API (/v1/chat/completions, ...)")
    add_backend_args(p)
    flags = {a for action in p._actions for a in action.option_strings}
    for name, field in SERVER_SETTINGS:
        s = settings.declared(name)
        p.add_argument(s.flag, dest=field, default=None, help=s.help)
    for name, field in SWITCHES:
        switch = settings.declared(name)
        p.add_argument(switch.flag, dest=field, action="store_false", default=None,
                       help=switch.help)
    if "--api-key" not in flags:   # the backend options may already carry it
        p.add_argument("--api-key", default=None, help=settings.declared(ENV_KEY).help)
    slow = settings.declared("QWEN_TRT_ALLOW_SLOW_FALLBACK")
    p.add_argument(slow.flag, action="store_true", default=None, help=slow.help)
    p.add_argument("--served-model-name", default=None,
                   help="model id clients send (default: the --model value)")
    p.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    p.set_defaults(func=run)


_KIND_WORDS = {"int": "a whole number", "float": "a number"}


def _value(args, name: str, field: str, env):
    """The flag's value, else its variable's, else its declared default, parsed as declared."""
    s = settings.declared(name)
    raw = getattr(args, field, None)
    raw = raw.strip() if isinstance(raw, str) else raw
    if raw in (None, ""):
        raw = settings.raw(name, env)
    if raw is None:
        return s.default
    try:
        return s.parse(raw)
    except settings.SettingError:
        raise ConfigError(f"{s.flag} must be {_KIND_WORDS.get(s.kind, 'valid')}, got "
                          f"'{raw}'.") from None


def settings_from(args, environ=None):
    from qwen_trt.api.server_settings import ServerSettings

    env = os.environ if environ is None else environ
    values = {field: _value(args, name, field, env) for name, field in SERVER_SETTINGS}
    values["allowed_origins"] = _origins(values["allowed_origins"])
    try:
        values["allow_slow_fallback"] = bool(getattr(args, "allow_slow_fallback", None)
                                             or settings.get("QWEN_TRT_ALLOW_SLOW_FALLBACK", env))
    except settings.SettingError as e:
        raise ConfigError(str(e)) from None
    for name, field in SWITCHES:
        values[field] = (False if getattr(args, field, None) is False
                         else _value(args, name, "", env))
    values["allowed_hosts"] = _names(values["allowed_hosts"])
    return ServerSettings(
        api_key=args.api_key if args.api_key is not None else settings.get(ENV_KEY, env),
        model_name=args.served_model_name, **values)


def _origins(value: str | None) -> tuple[str, ...]:
    """``--allowed-origins a,b`` as a tuple (checked by ServerSettings)."""
    return tuple(dict.fromkeys(o.strip().rstrip("/") for o in (value or "").split(",")
                               if o.strip()))


def _names(value: str | None) -> tuple[str, ...]:
    """``--allowed-hosts a,b`` as a tuple (checked by ServerSettings)."""
    return tuple(n.strip() for n in (value or "").split(",") if n.strip())


def run(args) -> int:
    """Check the options, start the engine process, then -- while it loads -- import the
    HTTP server (FastAPI, the routes; the engine client reads the tokenizer meanwhile) and
    listen: ``/health`` answers 503 while the engine loads, and the API serves once it is
    ready. The engine's load is the long pole, so nothing of this process runs before it is
    started."""
    from qwen_trt.options import config_from

    from qwen_trt.api.listen import check_bindable, url_host

    settings = settings_from(args)        # a bad --host/--key refuses before the model loads
    check_bindable(settings.host, settings.port)     # so does an address we cannot bind
    cfg = config_from(args)
    if cfg.backend == "openai":
        raise ConfigError("qwen-trt serve runs the model on this machine: --backend openai is "
                          "for the app and chat (use auto, torch or trtllm here).")
    from qwen_trt.serving.service import start_service

    print(f"loading the model for http://{url_host(settings.host)}:{settings.port}/v1 ...",
          file=sys.stderr)
    kv_events = None
    if settings.kv_events:
        from qwen_trt.serving.kv_events import KvEventsConfig

        kv_events = KvEventsConfig(settings.kv_events, settings.kv_events_topic)
    # a kernel family on a much slower path refuses the start, unless allowed (one line)
    service = start_service(cfg, wait=False, refuse_slow=not settings.allow_slow_fallback,
                            kv_events=kv_events)
    try:
        from qwen_trt.api.server import run_server          # while the engine loads
    except BaseException:
        service.close()
        raise
    # The port is bound now: /health says 503 "loading" until the engine is ready, then the
    # API serves (a load error stops the server and is raised here: one line, exit non-zero).
    run_server(service, settings, model_name=cfg.model, log_level=args.log_level)
    return 0
