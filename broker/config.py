"""Broker configuration: defaults as RabbitMQ's, overridable by keyword, TOML file or command line."""

from __future__ import annotations

import os
import tomllib
from dataclasses import dataclass, field, fields

from . import access, limits, versions

SSL_CERT_LOGIN_FROM = ("distinguished_name", "common_name")


@dataclass
class BrokerConfig:
    host: str = "127.0.0.1"
    port: int = 0                                    # 0: an ephemeral port, chosen at start
    # Users: name -> password (a string, kept in memory only as a salted hash), or name -> a table with
    # `password` or `password_hash` (as `rabbitmqctl hash_password` prints it; `hashing_algorithm` defaults
    # to rabbit_password_hashing_sha256) and `tags` (e.g. ["impersonator"]).
    users: dict[str, str | dict] = field(default_factory=lambda: {"guest": "guest"})
    # Virtual hosts: names, or tables {name, default_queue_type} (4.x's vhost default queue type: "quorum",
    # "stream" or "classic"; ignored with a WARNING under rabbitmq_version 3.10).
    vhosts: tuple = ("/",)
    # user -> vhost -> [configure, write, read] regular expressions (or a table with those keys), as
    # `rabbitmqctl set_permissions`. None (and no topic_permissions, no definitions): every user may do
    # everything on every vhost.
    permissions: dict[str, dict] | None = None
    # user -> vhost -> exchange -> [write, read] regular expressions, as `rabbitmqctl set_topic_permissions`.
    topic_permissions: dict[str, dict] | None = None
    # Users that may log in only from a loopback address (RabbitMQ's loopback_users).
    loopback_users: tuple[str, ...] = ("guest",)
    # RabbitMQ's definitions file (export_definitions JSON), a path or an already-parsed dict.
    definitions: str | dict | None = None
    # Policies and operator policies, as `rabbitmqctl set_policy` / `set_operator_policy` sets them: a list of
    # tables {name, pattern, definition, vhost = "/", apply_to = "all", priority = 0} (policies.py).
    policies: list | None = None
    operator_policies: list | None = None
    heartbeat: int = limits.DEFAULT_HEARTBEAT        # seconds offered in connection.tune
    frame_max: int = limits.DEFAULT_FRAME_MAX
    channel_max: int = limits.DEFAULT_CHANNEL_MAX
    # The RabbitMQ version whose behaviour the broker has where versions differ (versions.py): "4.3" (the
    # default) or "3.10". The resolved table is `behaviour`.
    rabbitmq_version: str = versions.DEFAULT_VERSION
    # Largest message body accepted; None: the version's default (RabbitMQ's `max_message_size`: 16 MiB
    # on 4.3, 128 MiB on 3.10).
    max_message_size: int | None = None
    max_connections: int | None = None
    # Milliseconds a delivery may stay unacked (RabbitMQ's `consumer_timeout`, 30 minutes by default): how it
    # times out depends on the version (versions.Behaviour.consumer_timeout_on_channel_tick). As RabbitMQ, a
    # channel reads it when it opens (3.10), a consumer or basic.get when it starts (4.x).
    consumer_timeout: int = limits.DEFAULT_CONSUMER_TIMEOUT
    # Milliseconds between a channel's ticks (RabbitMQ's `channel_tick_interval`): on 3.10, when a channel
    # checks its consumer timeout.
    channel_tick_interval: int = limits.DEFAULT_CHANNEL_TICK_INTERVAL
    # Bytes of message data (bodies and content headers) held in queues above which publishers are
    # blocked (connection.blocked), as RabbitMQ's vm_memory_high_watermark does: an int is a byte count
    # (RabbitMQ's vm_memory_high_watermark.absolute), a float in (0, 1] a fraction of the machine's total
    # memory (.relative; default 0.4, RabbitMQ 3.10's), "off" (or None, false) no limit. Checked every
    # MEMORY_CHECK_INTERVAL seconds. The resolved byte count is `memory_limit`.
    memory_high_watermark: int | float | str | None = limits.DEFAULT_MEMORY_HIGH_WATERMARK
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
    # SASL EXTERNAL (RabbitMQ's rabbitmq_auth_mechanism_ssl): a TLS client whose certificate was verified
    # against tls_ca logs in as the user its certificate names, without a password. Which name, as
    # RabbitMQ's `ssl_cert_login_from`: "distinguished_name" (RabbitMQ's default: the subject as RFC 4514
    # text, e.g. "CN=alice,O=example") or "common_name" (the subject's CN).
    ssl_cert_login_from: str = "distinguished_name"

    def __post_init__(self):
        self.behaviour = versions.behaviour(self.rabbitmq_version)
        self.rabbitmq_version = self.behaviour.version
        if self.max_message_size is None:
            self.max_message_size = self.behaviour.max_message_size
        elif isinstance(self.max_message_size, bool) or not isinstance(self.max_message_size, int) \
                or self.max_message_size < 1:
            raise ValueError(f"max_message_size must be a positive number of bytes, got {self.max_message_size!r}")
        if self.frame_max < limits.FRAME_MIN_SIZE:
            raise ValueError(f"frame_max must be at least {limits.FRAME_MIN_SIZE}, got {self.frame_max}")
        if not 1 <= self.channel_max <= 65535:
            raise ValueError(f"channel_max must be 1..65535, got {self.channel_max}")
        if self.heartbeat < 0:
            raise ValueError(f"heartbeat must be >= 0 seconds, got {self.heartbeat}")
        for key, least in (("consumer_timeout", 0), ("channel_tick_interval", 1)):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(f"{key} must be a number of milliseconds"
                                 f"{', at least 1' if least else ''}, got {value!r}")
        self._check_access()
        self._check_tls()
        self.memory_limit = memory_limit(self.memory_high_watermark)

    def _check_access(self) -> None:
        """Users, vhosts, permissions and definitions, checked here so that a bad entry fails at start with
        its key named (never a password). The result is kept in `access` and `loaded_definitions`."""
        from . import definitions
        if not isinstance(self.users, dict):
            raise ValueError(f"users must be a table of name = password (or name = {{...}}), "
                             f"got {type(self.users).__name__}")
        self.vhosts, dqts = _vhosts(self.vhosts)
        if isinstance(self.loopback_users, str) or not all(isinstance(u, str) for u in self.loopback_users):
            raise ValueError(f"loopback_users must be a list of user names, got {self.loopback_users!r}")
        self.loopback_users = tuple(self.loopback_users)
        users = {name: access.make_user(name, spec) for name, spec in self.users.items()}
        defs = definitions.parse(self.definitions) if self.definitions is not None else None
        self.loaded_definitions = defs
        vhosts = list(self.vhosts)
        perms, topics = {}, {}
        if defs is not None:
            users.update(defs.users)
            vhosts += [v for v in defs.vhosts if v not in vhosts]
            dqts = {**defs.default_queue_types, **dqts}
            perms.update(defs.permissions)
            topics.update(defs.topic_permissions)
        self.vhost_default_queue_types = dqts
        if not users:
            raise ValueError("at least one user is required")
        self.all_vhosts = tuple(vhosts)
        for user, per_vhost in (self.permissions or {}).items():
            for vhost, spec in self._table(per_vhost, f"permissions.{user}").items():
                perms[(user, vhost)] = access.parse_permission(spec, f"permissions.{user}.{vhost}")
        for user, per_vhost in (self.topic_permissions or {}).items():
            for vhost, per_x in self._table(per_vhost, f"topic_permissions.{user}").items():
                for x, spec in self._table(per_x, f"topic_permissions.{user}.{vhost}").items():
                    topics[(user, vhost, x)] = access.parse_topic_permission(
                        spec, f"topic_permissions.{user}.{vhost}.{x}")
        for key in [*perms, *topics]:
            kind = "permissions" if len(key) == 2 else "topic_permissions"
            if key[0] not in users:
                raise ValueError(f"{kind}: no such user {key[0]!r} (users: {sorted(users)})")
            if key[1] not in vhosts:
                raise ValueError(f"{kind}.{key[0]}: no such vhost {key[1]!r} (vhosts: {vhosts})")
        self._check_policies(defs)
        open_vhosts = self.permissions is None and self.topic_permissions is None and defs is None
        self.access = access.AccessControl(users, perms, topics, self.loopback_users, open_vhosts,
                                           self.behaviour.access_texts_name_permission)

    def _check_policies(self, defs) -> None:
        """`policy_list`: the definitions file's policies (one RabbitMQ refuses is a skipped item, logged), then
        those configured here (one RabbitMQ refuses is an error naming it), each checked as RabbitMQ checks
        it."""
        from . import policies
        self.policy_list = []
        if defs is not None:
            for kind, entries in ((policies.POLICY, defs.policies), (policies.OPERATOR_POLICY, defs.operator_policies)):
                for item in entries:
                    try:
                        self.policy_list.append(policies.validate(
                            kind, item.get("vhost", "/"), item.get("name"), item.get("pattern"),
                            item.get("definition"), item.get("priority", 0), item.get("apply-to", "all"),
                            behaviour=self.behaviour))
                    except policies.PolicyError as exc:
                        defs.skipped.append(f"{kind.replace('_', ' ')} '{item.get('name')}' in vhost "
                                            f"'{item.get('vhost')}': {exc}")
        for key, kind in (("policies", policies.POLICY), ("operator_policies", policies.OPERATOR_POLICY)):
            entries = getattr(self, key) or []
            if not isinstance(entries, (list, tuple)):
                raise ValueError(f"{key} must be a list of tables, got {entries!r}")
            for i, item in enumerate(entries):
                at = f"{key}[{i}]"
                if not isinstance(item, dict) or not isinstance(item.get("name"), str):
                    raise ValueError(f"{at} must be a table with a name, pattern and definition, got {item!r}")
                extra = set(item) - {"name", "vhost", "pattern", "apply_to", "priority", "definition"}
                if extra:
                    raise ValueError(f"{at} ('{item['name']}'): unknown keys {sorted(extra)}")
                vhost = item.get("vhost", "/")
                if vhost not in self.all_vhosts:
                    raise ValueError(f"{at} ('{item['name']}'): no such vhost {vhost!r} (vhosts: {list(self.all_vhosts)})")
                try:
                    self.policy_list.append(policies.validate(
                        kind, vhost, item["name"], item.get("pattern"), item.get("definition"),
                        item.get("priority", 0), item.get("apply_to", "all"), behaviour=self.behaviour))
                except policies.PolicyError as exc:
                    raise ValueError(f"{at} ('{item['name']}'): {exc}") from None

    @staticmethod
    def _table(value, where: str) -> dict:
        if not isinstance(value, dict):
            raise ValueError(f"{where} must be a table, got {value!r}")
        return value

    def plain_credentials(self) -> tuple[str, str]:
        """The first user configured with a plain password (for URLs); ValueError when every user is
        configured by hash only (a URL then needs the password, which the broker does not know)."""
        for name, spec in self.users.items():
            password = spec if isinstance(spec, str) else \
                spec.get("password") if isinstance(spec, dict) else None
            # a user the definitions file redefined (another password) is of no use in a URL
            if isinstance(password, str) and self.access.users[name].check(password):
                return name, password
        raise ValueError("no user has a plain password (only password hashes): build the URL yourself")

    def _check_tls(self) -> None:
        """Errors name the key (and the file), never a file's contents."""
        for key in ("tls_cert", "tls_key", "tls_ca"):
            value = getattr(self, key)
            if value is None:
                continue
            if not isinstance(value, (str, os.PathLike)) or not os.fspath(value):
                raise ValueError(f"{key} must be the path of a PEM file, got {type(value).__name__}")
            setattr(self, key, os.fspath(value))
        if self.ssl_cert_login_from not in SSL_CERT_LOGIN_FROM:
            raise ValueError(f"ssl_cert_login_from must be one of {', '.join(SSL_CERT_LOGIN_FROM)}, "
                             f"got {self.ssl_cert_login_from!r}")
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
        """Read `[broker]` keys, a `[users]` table (name = password, or name = {password_hash, tags}),
        `[permissions]` (user -> vhost -> [configure, write, read]) and `[topic_permissions]`
        (user -> vhost -> exchange -> [write, read]) from a TOML file."""
        with open(path, "rb") as fh:
            doc = tomllib.load(fh)
        known = {f.name for f in fields(cls)}
        values = dict(doc.get("broker", {}))
        unknown = set(values) - known
        if unknown:
            raise ValueError(f"{path}: unknown [broker] keys {sorted(unknown)}; allowed: {sorted(known)}")
        if "users" in doc:
            values["users"] = {str(k): v if isinstance(v, dict) else str(v) for k, v in doc["users"].items()}
        for table in ("permissions", "topic_permissions", "policies", "operator_policies"):
            if table in doc:
                values[table] = doc[table]
        unknown_tables = set(doc) - {"broker", "users", "permissions", "topic_permissions", "policies",
                                     "operator_policies"}
        if unknown_tables:
            raise ValueError(f"{path}: unknown tables {sorted(unknown_tables)}; allowed: [broker], [users], "
                             "[permissions], [topic_permissions], [[policies]], [[operator_policies]]")
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)


QUEUE_TYPES = ("classic", "quorum", "stream")


def _vhosts(value) -> tuple[tuple, dict]:
    """`vhosts` as names, and the default queue type each table names."""
    shown = f"vhosts must be a list of names or tables {{name, default_queue_type}}, got {value!r}"
    if isinstance(value, (str, dict)):
        raise ValueError(shown)
    names, dqts = [], {}
    for item in value:
        if isinstance(item, dict):
            extra = set(item) - {"name", "default_queue_type"}
            if extra or not isinstance(item.get("name"), str) or not item["name"]:
                raise ValueError(shown)
            qtype = item.get("default_queue_type")
            if qtype is not None:
                if qtype not in QUEUE_TYPES:
                    raise ValueError(f"vhosts: default_queue_type of '{item['name']}' must be one of "
                                     f"{', '.join(QUEUE_TYPES)}, got {qtype!r}")
                dqts[item["name"]] = qtype
            item = item["name"]
        if not isinstance(item, str) or not item:
            raise ValueError(shown)
        names.append(item)
    return tuple(names), dqts


def total_memory() -> int:
    """The machine's physical memory in bytes (what RabbitMQ's relative watermark is a fraction of)."""
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def memory_limit(value) -> int | None:
    """`memory_high_watermark` as bytes (None: no limit). Accepts what the TOML file and the command line
    can say: an int (bytes), a float fraction of total memory, "off", or those as strings ("0.4")."""
    shown = f"memory_high_watermark must be a byte count (e.g. 1073741824), a fraction of total memory " \
            f"in (0, 1] (e.g. 0.4) or \"off\", got {value!r}"
    if value is None or value is False:
        return None
    if isinstance(value, str):
        text = value.strip().lower()
        if text in ("off", "none", "false"):
            return None
        try:
            value = int(text) if text.isdigit() else float(text)
        except ValueError:
            raise ValueError(shown) from None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(shown)
    if isinstance(value, int):
        if value <= 0:
            raise ValueError(shown)
        return value
    if not 0.0 < value <= 1.0:
        raise ValueError(shown)
    return int(total_memory() * value)
