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
ENV_KEEPALIVE = "QWEN_TRT_SSE_KEEPALIVE_S"
ENV_BODY, ENV_HEADER_T, ENV_BODY_T, ENV_GRACE = (
    "QWEN_TRT_MAX_BODY_MB", "QWEN_TRT_HEADER_TIMEOUT_S", "QWEN_TRT_BODY_TIMEOUT_S",
    "QWEN_TRT_SHUTDOWN_GRACE_S")
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
    p.add_argument("--sse-keepalive-s", default=None,
                   help=f"a streaming client that waits (queued, long prefill) gets an SSE comment "
                        f"this often so proxies keep it; 0 = off (default 10) [env {ENV_KEEPALIVE}]")
    p.add_argument("--max-body-mb", default=None,
                   help=f"largest request body in MiB; larger ones get 413 (default 16, as "
                        f"deploy/nginx.conf) [env {ENV_BODY}]")
    p.add_argument("--header-timeout-s", default=None,
                   help=f"seconds a client has to send a request's headers (default 10) "
                        f"[env {ENV_HEADER_T}]")
    p.add_argument("--body-timeout-s", default=None,
                   help=f"seconds a client has to send a request's body after its headers "
                        f"(default 30) [env {ENV_BODY_T}]")
    p.add_argument("--shutdown-grace-s", default=None,
                   help=f"on SIGTERM/SIGINT, seconds in-flight requests get to finish before "
                        f"they end with an error (default 10) [env {ENV_GRACE}]")
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


def _float(value: str | None, flag: str, default: float) -> float:
    if value is None or value == "":
        return default
    try:
        return float(value)
    except ValueError:
        raise ConfigError(f"{flag} must be a number, got '{value}'.") from None


def settings_from(args, environ=None):
    from qwen_trt.api.server import ServerSettings

    env = os.environ if environ is None else environ
    return ServerSettings(
        host=args.host or env.get(ENV_HOST) or "127.0.0.1",
        port=_int(args.port or env.get(ENV_PORT), "--port", 8000),
        api_key=args.api_key if args.api_key is not None else (env.get(ENV_KEY) or None),
        max_queue=_int(args.max_queue or env.get(ENV_QUEUE), "--max-queue", 256),
        sse_keepalive_s=_float(getattr(args, "sse_keepalive_s", None) or env.get(ENV_KEEPALIVE),
                               "--sse-keepalive-s", 10.0),
        model_name=args.served_model_name,
        max_body_mb=_float(args.max_body_mb or env.get(ENV_BODY), "--max-body-mb", 16.0),
        header_timeout_s=_float(args.header_timeout_s or env.get(ENV_HEADER_T),
                                "--header-timeout-s", 10.0),
        body_timeout_s=_float(args.body_timeout_s or env.get(ENV_BODY_T), "--body-timeout-s",
                              30.0),
        shutdown_grace_s=_float(args.shutdown_grace_s or env.get(ENV_GRACE),
                                "--shutdown-grace-s", 10.0),
        allowed_origins=_origins(getattr(args, "allowed_origins", None) or env.get(ENV_ORIGINS)))


def _origins(value: str | None) -> tuple[str, ...]:
    """``--allowed-origins a,b`` as a tuple (checked by ServerSettings)."""
    return tuple(dict.fromkeys(o.strip().rstrip("/") for o in (value or "").split(",")
                               if o.strip()))


def run(args) -> int:
    from qwen_trt.options import config_from

    from qwen_trt.api.listen import check_bindable, url_host

    settings = settings_from(args)        # a bad --host/--key refuses before the model loads
    check_bindable(settings.host, settings.port)     # so does an address we cannot bind
    cfg = config_from(args)
    if cfg.backend == "openai":
        raise ConfigError("qwen-trt serve runs a local engine: --backend openai is for the app "
                          "and chat (use auto, torch or trtllm here).")
    from qwen_trt.api.server import run_server
    from qwen_trt.serving.service import start_service

    print(f"loading the model for http://{url_host(settings.host)}:{settings.port}/v1 ...",
          file=sys.stderr)
    service = start_service(cfg)
    print(f"serving {service.info.describe()}", file=sys.stderr, flush=True)
    run_server(service, settings, model_name=cfg.model, log_level=args.log_level)
    return 0
