"""Broker configuration: defaults as RabbitMQ's, overridable by keyword, TOML file or command line."""

from __future__ import annotations

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
