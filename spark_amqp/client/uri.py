"""amqp:// URIs: parsing (RabbitMQ's URI specification) and redaction.

Rules followed (https://www.rabbitmq.com/uri-spec.html and uri-query-parameters.html):

- ``amqp://user:password@host:port/vhost?query``; every part is optional. User, password, host and vhost
  are percent-decoded, so a vhost "/" is written ``%2F`` and a password containing ``@`` as ``%40``.
- Defaults: user and password "guest", host "localhost", port 5672 (5671 for amqps).
- The vhost is the path without its leading "/", percent-decoded, and may not contain a raw "/"
  (``/%2F`` is "/"). An absent path means "/". Departure from the spec: the spec maps ``amqp://host/`` to
  the empty vhost "", which no broker has; like pika and py-amqp we map it to "/" as well.
- Query: ``heartbeat`` (seconds), ``connection_timeout`` (milliseconds, as RabbitMQ's page says),
  ``frame_max``, ``channel_max``; other parameters (TLS ones, auth_mechanism) are accepted and ignored here.

Passwords never leave this module unredacted except into the PLAIN auth response: `ConnectionParameters`
keeps the password out of its repr, and `redact()` is what every message and log line uses.
"""

from __future__ import annotations

import re
import urllib.parse
from dataclasses import dataclass, field

DEFAULT_PORTS = {"amqp": 5672, "amqps": 5671}
REDACTED = "***"


@dataclass(frozen=True)
class ConnectionParameters:
    """What an amqp:// URI says; `None` for query parameters the URI does not set."""

    scheme: str = "amqp"
    host: str = "localhost"
    port: int = 5672
    username: str = "guest"
    password: str = field(default="guest", repr=False)
    vhost: str = "/"
    heartbeat: int | None = None
    connect_timeout: float | None = None  # seconds (the URI gives milliseconds)
    frame_max: int | None = None
    channel_max: int | None = None

    @property
    def tls(self) -> bool:
        return self.scheme == "amqps"

    @property
    def redacted(self) -> str:
        """A URI for messages and logs: everything but the password."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        user = urllib.parse.quote(self.username, safe="")
        vhost = urllib.parse.quote(self.vhost, safe="")
        return f"{self.scheme}://{user}:{REDACTED}@{host}:{self.port}/{vhost}"


def _int_param(query: dict[str, list[str]], name: str, safe_uri: str) -> int | None:
    values = query.get(name)
    if not values:
        return None
    try:
        value = int(values[-1])
    except ValueError:
        raise ValueError(f"invalid {name}={values[-1]!r} in {safe_uri}: expected an integer") from None
    if value < 0:
        raise ValueError(f"invalid {name}={value} in {safe_uri}: must be >= 0")
    return value


def parse_uri(uri: str) -> ConnectionParameters:
    """Parse an amqp:// or amqps:// URI; raises ValueError whose message carries only the redacted URI."""
    safe = redact(uri)
    if not isinstance(uri, str):
        raise TypeError(f"the URI must be a string, not {type(uri).__name__}")
    scheme, sep, rest = uri.partition("://")
    scheme = scheme.lower()
    if not sep or scheme not in DEFAULT_PORTS:
        raise ValueError(f"unsupported URI {safe}: expected amqp://user:password@host:port/vhost "
                         "(or amqps://)")
    rest, _, _fragment = rest.partition("#")
    rest, _, query_string = rest.partition("?")
    authority, slash, path = rest.partition("/")
    if "@" in path:
        # A raw "/" in the password (or user) splits the authority early; refuse rather than guess.
        raise ValueError(f"invalid URI {safe}: the vhost contains '@'; percent-encode '/', '?', '#' "
                         "and '@' in the user name and password (e.g. '/' as %2F)")
    if "/" in path:
        raise ValueError(f"invalid URI {safe}: the vhost may not contain a raw '/' (write %2F)")
    userinfo, at, hostport = authority.rpartition("@")
    username, password = "guest", "guest"
    if at:
        user_raw, colon, pass_raw = userinfo.partition(":")
        username = urllib.parse.unquote(user_raw)
        password = urllib.parse.unquote(pass_raw) if colon else ""
    if hostport.startswith("["):
        host, bracket, port_part = hostport[1:].partition("]")
        if not bracket or (port_part and not port_part.startswith(":")):
            raise ValueError(f"invalid IPv6 host in {safe}")
        port_raw = port_part[1:]
    else:
        host, _, port_raw = hostport.partition(":")
        host = urllib.parse.unquote(host)
    port = DEFAULT_PORTS[scheme]
    if port_raw:
        if not port_raw.isdigit() or not 0 < int(port_raw) < 65536:
            raise ValueError(f"invalid port {port_raw!r} in {safe}")
        port = int(port_raw)
    vhost = urllib.parse.unquote(path) if path else "/"
    query = urllib.parse.parse_qs(query_string, keep_blank_values=True)
    timeout_ms = _int_param(query, "connection_timeout", safe)
    return ConnectionParameters(
        scheme=scheme, host=host or "localhost", port=port, username=username, password=password,
        vhost=vhost, heartbeat=_int_param(query, "heartbeat", safe),
        connect_timeout=None if timeout_ms is None else timeout_ms / 1000.0,
        frame_max=_int_param(query, "frame_max", safe), channel_max=_int_param(query, "channel_max", safe))


# [scheme://]user:<secret>@ — the secret runs to the LAST "@" of the string, so that a password holding raw
# "@", "/", "?" or "#" (an invalid URI, but one a user may well type) is still hidden entirely. Over-
# redacting a vhost that contains "@" is the price, and an acceptable one.
_WITH_SCHEME = re.compile(r"(?P<head>[A-Za-z][A-Za-z0-9+.-]*://[^:@]*:)(?P<secret>.*)@", re.DOTALL)
_BARE = re.compile(r"(?P<head>[^:@]*:)(?P<secret>.*)@", re.DOTALL)  # "user:secret@host", scheme forgotten


def redact(uri: object) -> str:
    """The URI with its password replaced by ``***``; safe on malformed input, never raises.

    Used for every message, repr and log line that mentions a URI (DESIGN: credentials never appear in
    errors, logs or plans).
    """
    text = uri if isinstance(uri, str) else str(uri)
    match = (_WITH_SCHEME if "://" in text else _BARE).search(text)
    if match is None:
        return text
    return f"{text[:match.start()]}{match.group('head')}{REDACTED}@{text[match.end():]}"
