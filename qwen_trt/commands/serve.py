"""``qwen-trt serve``: the OpenAI-compatible HTTP API on this machine's engine.

``qwen-trt serve [--model ...|--engine ...] [--host 127.0.0.1] [--port 8000] [--api-key KEY]``.
Binds 127.0.0.1 unless told otherwise; any other address needs a key (``--api-key`` or
``QWEN_TRT_API_KEY``). See :mod:`qwen_trt.api` and docs/deploy.md.
"""
from __future__ import annotations

import os
import sys

from qwen_trt.errors import ConfigError

ENV_HOST, ENV_PORT, ENV_KEY, ENV_QUEUE = ("QWEN_TRT_HOST", "QWEN_TRT_PORT", "QWEN_TRT_API_KEY",
                                          "QWEN_TRT_MAX_QUEUE")
ENV_ORIGINS = "QWEN_TRT_ALLOWED_ORIGINS"


def register(sub) -> None:
    from qwen_trt.options import add_backend_args

    p = sub.add_parser("serve", help="OpenAI-compatible HTTP API (/v1/chat/completions, ...)")
    add_backend_args(p)
    flags = {a for action in p._actions for a in action.option_strings}
    p.add_argument("--host", default=None, help=f"address to bind (default 127.0.0.1) [env {ENV_HOST}]")
    p.add_argument("--port", default=None, help=f"port (default 8000) [env {ENV_PORT}]")
    if "--api-key" not in flags:   # the backend options may already carry it
        p.add_argument("--api-key", default=None,
                       help=f"key clients must send as 'Authorization: Bearer KEY'; required for "
                            f"a non-loopback --host [env {ENV_KEY}]")
    p.add_argument("--max-queue", default=None,
                   help=f"requests waiting for the engine before new ones get 503 (default 256) "
                        f"[env {ENV_QUEUE}]")
    p.add_argument("--allowed-origins", default=None,
                   help="comma-separated browser origins (scheme://host[:port], or *) allowed to "
                        f"call the API directly (CORS; default: none) [env {ENV_ORIGINS}]")
    p.add_argument("--served-model-name", default=None,
                   help="model id clients send (default: the --model value)")
    p.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    p.set_defaults(func=run)


def _int(value: str | None, flag: str, default: int) -> int:
    if value is None or value == "":
        return default
    try:
        return int(value)
    except ValueError:
        raise ConfigError(f"{flag} must be a whole number, got '{value}'.") from None


def settings_from(args, environ=None):
    from qwen_trt.api.server import ServerSettings

    env = os.environ if environ is None else environ
    return ServerSettings(
        host=args.host or env.get(ENV_HOST) or "127.0.0.1",
        port=_int(args.port or env.get(ENV_PORT), "--port", 8000),
        api_key=args.api_key if args.api_key is not None else (env.get(ENV_KEY) or None),
        max_queue=_int(args.max_queue or env.get(ENV_QUEUE), "--max-queue", 256),
        model_name=args.served_model_name,
        allowed_origins=_origins(getattr(args, "allowed_origins", None) or env.get(ENV_ORIGINS)))


def _origins(value: str | None) -> tuple[str, ...]:
    """``--allowed-origins a,b`` as a tuple (checked by ServerSettings)."""
    return tuple(dict.fromkeys(o.strip().rstrip("/") for o in (value or "").split(",")
                               if o.strip()))


def run(args) -> int:
    from qwen_trt.options import config_from

    settings = settings_from(args)        # a bad --host/--key refuses before the model loads
    cfg = config_from(args)
    if cfg.backend == "openai":
        raise ConfigError("qwen-trt serve runs a local engine: --backend openai is for the app "
                          "and chat (use auto, torch or trtllm here).")
    from qwen_trt.api.server import run_server
    from qwen_trt.serving.service import start_service

    print(f"loading the model for http://{settings.host}:{settings.port}/v1 ...", file=sys.stderr)
    service = start_service(cfg)
    print(f"serving {service.info.describe()}", file=sys.stderr, flush=True)
    run_server(service, settings, model_name=cfg.model, log_level=args.log_level)
    return 0
