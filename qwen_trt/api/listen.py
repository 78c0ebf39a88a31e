"""Where ``qwen-trt serve`` listens and the key it asks for, checked before the model loads."""
from __future__ import annotations

import ipaddress
import re
import socket

from qwen_trt.errors import ConfigError

_HOST_RE = re.compile(r"^[a-z0-9_]([a-z0-9_.\-]*[a-z0-9_])?$")   # a DNS name or an IPv4 address


def normalize_host(host: str) -> str:
    """``[::1]`` -> ``::1`` (the URL spelling of an IPv6 address); anything else as given."""
    h = host.strip()
    if h.startswith("[") or h.endswith("]"):
        inner = h[1:-1] if h.startswith("[") and h.endswith("]") else ""
        try:
            ipaddress.IPv6Address(inner)
        except ValueError:
            raise ConfigError(f"--host '{host}' is not an address: brackets go around an IPv6 "
                              "address only (e.g. [::1]).") from None
        return inner
    if not h:
        raise ConfigError("--host is empty: give an address such as 127.0.0.1.")
    return h


def url_host(host: str) -> str:
    """The host as a URL spells it (IPv6 in brackets)."""
    return f"[{host}]" if ":" in host else host


def check_api_key(key: str | None) -> None:
    if key is None:
        return
    if not key.strip():
        raise ConfigError("--api-key / QWEN_TRT_API_KEY is empty: give a key or leave it unset.")
    if key != key.strip():
        raise ConfigError("--api-key / QWEN_TRT_API_KEY starts or ends with spaces, which no "
                          "client sends: remove them.")
    if not all("\x21" <= c <= "\x7e" for c in key):
        raise ConfigError("--api-key / QWEN_TRT_API_KEY may hold only visible ASCII characters "
                          "(no spaces or control characters): clients send it in an HTTP header.")


def check_bindable(host: str, port: int) -> None:
    """Bind ``host:port`` once (and let go), so a wrong address or a port in use is reported
    before the model loads."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise ConfigError(f"--host '{host}' does not resolve to an address ({e.strerror}).") \
            from None
    family, kind, proto, _name, addr = infos[0]
    with socket.socket(family, kind, proto) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(addr)
        except OSError as e:
            raise ConfigError(f"Cannot listen on {url_host(host)}:{port}: {e.strerror}.") from None


def host_name(header: str) -> str | None:
    """The name in a ``Host`` header (or an ``--allowed-hosts`` entry) without its port, in
    lower case, an IPv6 address without brackets (``[::1]:8000`` -> ``::1``); None when it is
    not ``host[:port]``."""
    h = header.strip().lower()
    if h.startswith("["):
        inner, sep, rest = h[1:].partition("]")
        if not sep or (rest and not (rest.startswith(":") and rest[1:].isdigit())):
            return None
        try:
            return str(ipaddress.IPv6Address(inner))
        except ValueError:
            return None
    name, sep, port = h.partition(":")
    if sep and not port.isdigit():
        try:                        # a bare IPv6 address (an --allowed-hosts entry)
            return str(ipaddress.IPv6Address(h))
        except ValueError:
            return None
    name = name.rstrip(".")
    return name if name and _HOST_RE.match(name) else None


def allowed_host(entry: str) -> str | None:
    """An ``--allowed-hosts`` entry as :func:`host_name` spells it (``*`` as is), or None when
    it is not a host name or address on its own (no scheme, port or path)."""
    e = entry.strip().lower()
    if e == "*":
        return e
    try:
        return str(ipaddress.ip_address(e[1:-1] if e.startswith("[") and e.endswith("]") else e))
    except ValueError:
        pass
    e = e.rstrip(".")
    return e if e and _HOST_RE.match(e) else None
