"""How ``qwen-trt serve`` listens (:class:`ServerSettings`), apart from the ASGI app: the
command checks them before it starts the engine, without importing FastAPI (whose import then
runs while the engine loads)."""
from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass

from qwen_trt.api.keepalive import DEFAULT_KEEPALIVE_S
from qwen_trt.errors import ConfigError

LOOPBACK_NAMES = ("localhost",)
ORIGIN_RE = re.compile(r"^https?://[A-Za-z0-9.\-\[\]:]+$")
KV_ENDPOINT_RE = re.compile(r"^(tcp://(\*|[A-Za-z0-9.\-]+|\[[0-9A-Fa-f:.]+\]):[0-9]{1,5}|ipc://\S+)$")


def is_loopback(host: str) -> bool:
    if host in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True)
class ServerSettings:
    """How ``qwen-trt serve`` listens; checked here, once."""

    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    max_queue: int = 256                # requests waiting for the engine before 503
    model_name: str | None = None       # the id clients send as "model" (default: the model's)
    retry_after_s: int = 2
    sse_keepalive_s: float = DEFAULT_KEEPALIVE_S   # a silent stream gets ': keep-alive' (0 = off)
    max_body_mb: float = 16.0           # larger request bodies get 413 (as deploy/nginx.conf)
    header_timeout_s: float = 10.0      # a request's headers must arrive within this
    body_timeout_s: float = 30.0        # ... and its body within this after them
    shutdown_grace_s: float = 10.0      # SIGTERM/SIGINT: in-flight requests get this long
    allowed_origins: tuple[str, ...] = ()   # browser origins allowed to call the API (CORS)
    responses_store: bool = True        # keep responses (previous_response_id, GET by id)
    responses_store_max: int = 1024     # ... at most this many
    responses_store_mb: float = 64.0    # ... holding at most this many MiB
    allowed_hosts: tuple[str, ...] = ()     # Host names answered besides loopback's (* = any)
    allow_slow_fallback: bool = False   # serve although a kernel family fell back to slow code
    access_log: bool = True             # one line per request on stderr (api/access.py)
    kv_events: str | None = None        # ZMQ endpoint of the KV-cache events (serving/kv_events.py)
    kv_events_topic: str = ""

    def __post_init__(self) -> None:
        from qwen_trt.api.listen import allowed_host, check_api_key, normalize_host

        object.__setattr__(self, "host", normalize_host(self.host))
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"--port must be in 0..65535, got {self.port}.")
        if self.max_queue < 1:
            raise ConfigError(f"--max-queue must be >= 1, got {self.max_queue}.")
        if not 0 <= self.sse_keepalive_s < float("inf"):
            raise ConfigError(f"--sse-keepalive-s must be >= 0 seconds, got {self.sse_keepalive_s}.")
        for flag, value in (("--max-body-mb", self.max_body_mb),
                            ("--header-timeout-s", self.header_timeout_s),
                            ("--body-timeout-s", self.body_timeout_s)):
            if not value > 0 or value == float("inf"):
                raise ConfigError(f"{flag} must be a positive number, got {value}.")
        if not 0 <= self.shutdown_grace_s < float("inf"):
            raise ConfigError(f"--shutdown-grace-s must be >= 0, got {self.shutdown_grace_s}.")
        if self.responses_store_max < 1:
            raise ConfigError(f"--responses-store-max must be >= 1, got {self.responses_store_max}.")
        if not 0 < self.responses_store_mb < float("inf"):
            raise ConfigError(f"--responses-store-mb must be a positive number, got "
                              f"{self.responses_store_mb}.")
        check_api_key(self.api_key)
        for origin in self.allowed_origins:
            if origin != "*" and not ORIGIN_RE.match(origin):
                raise ConfigError(f"--allowed-origins: {origin[:80]!r} is not an origin (give "
                                  "scheme://host[:port] without a path, or *).")
        hosts = []
        for entry in self.allowed_hosts:
            name = allowed_host(entry)
            if name is None:
                raise ConfigError(f"--allowed-hosts: {entry[:80]!r} is not a host name or "
                                  "address (give names without scheme, port or path, or *).")
            hosts.append(name)
        object.__setattr__(self, "allowed_hosts", tuple(dict.fromkeys(hosts)))
        if self.kv_events is not None and not KV_ENDPOINT_RE.match(self.kv_events):
            raise ConfigError(f"--kv-events: {self.kv_events[:80]!r} is not a ZMQ endpoint (give "
                              "tcp://HOST:PORT, tcp://*:PORT or ipc://PATH).")
        if not is_loopback(self.host) and not self.api_key:
            raise ConfigError(f"Refusing to listen on {self.host} without a key: set --api-key or "
                              "QWEN_TRT_API_KEY (only 127.0.0.1 / localhost may go without one).")
