"""Broker configuration: defaults as RabbitMQ's, overridable by keyword, TOML file or command line."""

from __future__ import annotations

import os
import tomllib
from dataclasses import dataclass, field, fields

from . import limits


@dataclass
class BrokerConfig:
    host: str = "127.0.0.1"
    port: int = 0                                    # 0: an ephemeral port, chosen at start
    users: dict[str, str] = field(default_factory=lambda: {"guest": "guest"})
    vhosts: tuple[str, ...] = ("/",)
    heartbeat: int = limits.DEFAULT_HEARTBEAT        # seconds offered in connection.tune
    frame_max: int = limits.DEFAULT_FRAME_MAX
    channel_max: int = limits.DEFAULT_CHANNEL_MAX
    max_message_size: int = limits.DEFAULT_MAX_MESSAGE_SIZE
    max_connections: int | None = None
    # Bytes of message data (bodies and content headers) held in queues above which publishers are
    # blocked (connection.blocked), as RabbitMQ's vm_memory_high_watermark does. None: no limit.
    memory_high_watermark: int | None = None
    data_dir: str | None = None
    # TLS (amqps) listener beside the plain one, as RabbitMQ's `listeners.ssl` and `ssl_options`.
    # None: no TLS listener; 0: an ephemeral port. tls_cert / tls_key: the server's certificate chain and
    # private key (PEM files). tls_ca: CA certificates (PEM) that client certificates are verified
    # against; a client presenting a certificate not signed by them is refused. tls_verify_peer: refuse
    # clients presenting no certificate too (RabbitMQ's verify_peer + fail_if_no_peer_cert = true).
    tls_port: int | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_ca: str | None = None
    tls_verify_peer: bool = False

    def __post_init__(self):
        if self.frame_max < limits.FRAME_MIN_SIZE:
            raise ValueError(f"frame_max must be at least {limits.FRAME_MIN_SIZE}, got {self.frame_max}")
        if not 1 <= self.channel_max <= 65535:
            raise ValueError(f"channel_max must be 1..65535, got {self.channel_max}")
        if self.heartbeat < 0:
            raise ValueError(f"heartbeat must be >= 0 seconds, got {self.heartbeat}")
        if not self.users:
            raise ValueError("at least one user is required")
        self.vhosts = tuple(self.vhosts)
        self._check_tls()

    def _check_tls(self) -> None:
        """Errors name the key (and the file), never a file's contents."""
        for key in ("tls_cert", "tls_key", "tls_ca"):
            value = getattr(self, key)
            if value is None:
                continue
            if not isinstance(value, (str, os.PathLike)) or not os.fspath(value):
                raise ValueError(f"{key} must be the path of a PEM file, got {type(value).__name__}")
            setattr(self, key, os.fspath(value))
        if not isinstance(self.tls_verify_peer, bool):
            raise ValueError(f"tls_verify_peer must be true or false, got {self.tls_verify_peer!r}")
        if self.tls_port is None:
            given = [k for k in ("tls_cert", "tls_key", "tls_ca") if getattr(self, k) is not None]
            if self.tls_verify_peer:
                given.append("tls_verify_peer")
            if given:
                raise ValueError(f"{', '.join(given)} set but tls_port is not: set tls_port "
                                 "(5671 is the usual amqps port; 0 = ephemeral) to listen for TLS")
            return
        if isinstance(self.tls_port, bool) or not isinstance(self.tls_port, int) \
                or not 0 <= self.tls_port <= 65535:
            raise ValueError(f"tls_port must be a port number 0..65535 (0 = ephemeral), got {self.tls_port!r}")
        if self.tls_port != 0 and self.tls_port == self.port:
            raise ValueError(f"tls_port must differ from port (both are {self.port})")
        for key, what in (("tls_cert", "the server certificate (chain) PEM file"),
                          ("tls_key", "the server private key PEM file")):
            if getattr(self, key) is None:
                raise ValueError(f"tls_port is set but {key} is not: give {what}")
        if self.tls_verify_peer and self.tls_ca is None:
            raise ValueError("tls_verify_peer is true but tls_ca is not set: give the PEM file of the CA "
                             "that signs the client certificates")
        for key in ("tls_cert", "tls_key", "tls_ca"):
            path = getattr(self, key)
            if path is None:
                continue
            try:
                with open(path, "rb"):
                    pass
            except OSError as exc:
                raise ValueError(f"{key}: cannot read {path!r}: {exc.strerror or exc}") from None

    @classmethod
    def from_toml(cls, path: str, **overrides) -> "BrokerConfig":
        """Read `[broker]` keys and a `[users]` table (name = password) from a TOML file."""
        with open(path, "rb") as fh:
            doc = tomllib.load(fh)
        known = {f.name for f in fields(cls)}
        values = dict(doc.get("broker", {}))
        unknown = set(values) - known
        if unknown:
            raise ValueError(f"{path}: unknown [broker] keys {sorted(unknown)}; allowed: {sorted(known)}")
        if "users" in doc:
            values["users"] = {str(k): str(v) for k, v in doc["users"].items()}
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)
