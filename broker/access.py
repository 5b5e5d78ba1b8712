"""Users, passwords, vhost access and per-vhost permissions, as RabbitMQ 3.10's internal auth backend has them.

Why one module: the protocol core (connection.py, channel.py) only calls the hooks at the bottom of this file,
one line per method, so the rules (which permission each operation needs, in RabbitMQ's order, with
RabbitMQ's reply codes and texts) live in one place and the sans-I/O core stays about the protocol.

The rules, from rabbit_channel.erl / rabbit_access_control.erl / rabbit_auth_backend_internal.erl (3.10):

- A permission is three regular expressions (configure, write, read) per (user, vhost), searched (not
  anchored) in the resource name; the empty string means "^$" (nothing). No entry: no access to the vhost
  at all (connection.open gets 530 "access to vhost 'v' refused for user 'u'", the same for a vhost that
  does not exist).
- The default exchange is checked under the name "amq.default".
- configure: queue.declare (not passive; server-named queues under their amq.gen-* name), queue.delete,
  exchange.declare (not passive), exchange.delete. write: basic.publish (the exchange), the destination
  of queue.bind/unbind and exchange.bind/unbind, the alternate exchange of a new exchange and the
  dead-letter exchange of a new queue. read: basic.get, basic.consume, queue.purge, the source exchange of
  a binding, a new exchange that names an alternate exchange, a new queue that names a dead-letter exchange.
  Passive declares need no permission.
- Topic permissions (per user, vhost and topic exchange: write and read expressions matched against the
  routing key, with {username} and {vhost} expanded) apply to publishes to, and bindings from, topic
  exchanges; no entry for the exchange means allowed.
- Refusals are channel errors 403 ACCESS_REFUSED "access to <kind> '<name>' in vhost '<v>' refused for
  user '<u>'" (topics: "access to topic '<key>' in exchange '<x>' in vhost '<v>' refused for user '<u>'").
- Users listed in loopback_users (default: guest) may log in only from a loopback address.
- A user with the `impersonator` tag may publish messages whose user-id property names another user.
"""

from __future__ import annotations

import base64
import hashlib
import ipaddress
import os
import re
from dataclasses import dataclass, field

from spark_amqp.codec import methods, replies

from .exchange import EXCHANGE_TYPES

SHA256 = "rabbit_password_hashing_sha256"
SHA512 = "rabbit_password_hashing_sha512"
MD5 = "rabbit_password_hashing_md5"
HASHES = {SHA256: hashlib.sha256, SHA512: hashlib.sha512, MD5: hashlib.md5}

KINDS = ("configure", "write", "read")


def hash_password(password: str, algorithm: str = SHA256, salt: bytes | None = None) -> str:
    """What `rabbitmqctl hash_password` prints (and `export_definitions` stores as password_hash):
    base64(salt + H(salt + utf8(password))) with a random 4-byte salt (rabbit_password:hash/2)."""
    if algorithm not in HASHES:
        raise ValueError(f"unknown hashing_algorithm {algorithm!r}; known: {sorted(HASHES)}")
    salt = os.urandom(4) if salt is None else salt
    return base64.b64encode(salt + HASHES[algorithm](salt + password.encode("utf-8")).digest()).decode()


@dataclass
class User:
    """A user as RabbitMQ stores it: a salted hash (never the password itself, unless the configuration gave
    one in clear: then `password` is kept so that Broker.url can name it) and tags."""
    name: str
    password_hash: bytes
    hashing_algorithm: str = SHA256
    tags: tuple[str, ...] = ()
    password: str | None = field(default=None, repr=False)

    def check(self, password: str) -> bool:
        """rabbit_auth_backend_internal: a blank password is always refused; otherwise the salted hash of the
        candidate must equal the stored one."""
        if not password or len(self.password_hash) < 5:
            return False
        salt, digest = self.password_hash[:4], self.password_hash[4:]
        return HASHES[self.hashing_algorithm](salt + password.encode("utf-8")).digest() == digest


def make_user(name: str, spec, where: str = "users") -> User:
    """A User from the configuration: a string is a plain password (today's `users={"guest": "guest"}`); a
    table has `password` or `password_hash` (+ `hashing_algorithm`, default sha256) and optional `tags`.
    Errors name the key, never the password or hash."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"{where}: a user name must be a non-empty string, got {name!r}")
    if isinstance(spec, str):
        return User(name, base64.b64decode(hash_password(spec)), SHA256, (), spec)
    if not isinstance(spec, dict):
        raise ValueError(f"{where}.{name} must be a password (string) or a table with password or "
                         f"password_hash and tags; got {type(spec).__name__}")
    unknown = set(spec) - {"password", "password_hash", "hashing_algorithm", "tags"}
    if unknown:
        raise ValueError(f"{where}.{name}: unknown keys {sorted(unknown)}; allowed: password, password_hash, "
                         "hashing_algorithm, tags")
    tags = parse_tags(spec.get("tags", ()), f"{where}.{name}.tags")
    algorithm = spec.get("hashing_algorithm", SHA256)
    if algorithm not in HASHES:
        raise ValueError(f"{where}.{name}.hashing_algorithm: unsupported {algorithm!r}; supported: "
                         f"{', '.join(sorted(HASHES))}")
    if "password" in spec:
        if "password_hash" in spec:
            raise ValueError(f"{where}.{name}: give password or password_hash, not both")
        password = spec["password"]
        if not isinstance(password, str):
            raise ValueError(f"{where}.{name}.password must be a string (value not shown)")
        return User(name, base64.b64decode(hash_password(password, algorithm)), algorithm, tags, password)
    encoded = spec.get("password_hash")
    if not isinstance(encoded, str):
        raise ValueError(f"{where}.{name}: needs password or password_hash (a string)")
    try:
        raw = base64.b64decode(encoded, validate=True)
    except ValueError:
        raise ValueError(f"{where}.{name}.password_hash is not base64 (value not shown)") from None
    # An empty hash is RabbitMQ's "no password" user (only certificate logins): nobody logs in with one.
    return User(name, raw, algorithm, tags)


def parse_tags(tags, where: str) -> tuple[str, ...]:
    """Tags as a list, or as RabbitMQ's older comma-separated string ("administrator,management")."""
    if isinstance(tags, str):
        return tuple(t.strip() for t in tags.split(",") if t.strip())
    if isinstance(tags, (list, tuple)) and all(isinstance(t, str) for t in tags):
        return tuple(tags)
    raise ValueError(f"{where} must be a list of strings, got {tags!r}")


def compile_regex(pattern, where: str) -> re.Pattern:
    """RabbitMQ's permission expression: searched anywhere in the name; "" means "^$"."""
    if not isinstance(pattern, str):
        raise ValueError(f"{where} must be a regular expression (string), got {pattern!r}")
    try:
        return re.compile(pattern or "^$")
    except re.error as exc:
        raise ValueError(f"{where}: invalid regular expression {pattern!r}: {exc}") from None


def parse_permission(spec, where: str) -> tuple[str, str, str]:
    """[configure, write, read] or {configure = .., write = .., read = ..} (all three keys required)."""
    if isinstance(spec, dict):
        missing = [k for k in KINDS if k not in spec]
        unknown = set(spec) - set(KINDS) - {"user", "vhost"}
        if missing or unknown:
            raise ValueError(f"{where} needs exactly the keys configure, write, read; "
                             f"missing {missing}, unknown {sorted(unknown)}")
        spec = [spec[k] for k in KINDS]
    if not isinstance(spec, (list, tuple)) or len(spec) != 3:
        raise ValueError(f"{where} must be [configure, write, read] regular expressions, got {spec!r}")
    for kind, pattern in zip(KINDS, spec):
        compile_regex(pattern, f"{where}.{kind}")
    return tuple(spec)


def parse_topic_permission(spec, where: str) -> tuple[str, str]:
    """[write, read] or {write = .., read = ..}."""
    if isinstance(spec, dict):
        unknown = set(spec) - {"write", "read", "user", "vhost", "exchange"}
        if unknown or "write" not in spec or "read" not in spec:
            raise ValueError(f"{where} needs the keys write and read; unknown {sorted(unknown)}")
        spec = [spec["write"], spec["read"]]
    if not isinstance(spec, (list, tuple)) or len(spec) != 2:
        raise ValueError(f"{where} must be [write, read] regular expressions, got {spec!r}")
    for kind, pattern in zip(("write", "read"), spec):
        compile_regex(pattern, f"{where}.{kind}")
    return tuple(spec)


def is_loopback(peer: str) -> bool:
    """peer is "host:port" as the server names it. No address (an in-process connection, the sans-I/O
    tests) counts as local, as RabbitMQ's direct connections do."""
    if not peer:
        return True
    host = peer.rsplit(":", 1)[0].strip("[]")
    try:
        addr = ipaddress.ip_address(host)
    except ValueError:
        return host == "localhost"
    if getattr(addr, "ipv4_mapped", None) is not None:
        addr = addr.ipv4_mapped
    return addr.is_loopback


def _refused(text: str) -> replies.AMQPError:
    return replies.channel_error(replies.ACCESS_REFUSED, text)


class AccessControl:
    """The user database and the permission checks.

    `permissions` maps (user, vhost) to compiled (configure, write, read); `topic_permissions` maps
    (user, vhost, exchange) to compiled (write, read). `open_vhosts`: no permissions were configured at all,
    so every user may do everything on every vhost (the broker's behaviour before permissions existed).
    `name_permission`: refusal texts start with the permission refused ("configure access to ...", as 4.x's;
    versions.Behaviour.access_texts_name_permission)."""

    def __init__(self, users: dict[str, User], permissions: dict, topic_permissions: dict,
                 loopback_users=("guest",), open_vhosts: bool = False, name_permission: bool = False):
        self.users = users
        self.name_permission = name_permission
        self.permissions = {k: tuple(compile_regex(p, "permission") for p in v) for k, v in permissions.items()}
        self.topic_permissions = {k: tuple(compile_regex(p, "topic permission") for p in v)
                                  for k, v in topic_permissions.items()}
        self.loopback_users = frozenset(loopback_users)
        self.open_vhosts = open_vhosts
        self.all_allowed = open_vhosts and not self.topic_permissions
        self._memo: dict = {}

    # --- connection ----------------------------------------------------------------------------

    def login_refused(self, user: str, password: str, peer: str) -> str | None:
        """None when the user may log in from peer; otherwise the reason, for the log (never the password)."""
        u = self.users.get(user)
        if u is None or not u.check(password or ""):
            return f"user '{user}' - invalid credentials"
        if user in self.loopback_users and not is_loopback(peer):
            return f"user '{user}' can only connect via localhost"
        return None

    def external_login_refused(self, user: str, peer: str) -> str | None:
        """SASL EXTERNAL: the TLS layer has authenticated the peer; the user it names must exist (any
        password, as RabbitMQ's internal backend checks EXTERNAL logins) and loopback_users still apply."""
        if user not in self.users:
            return f"user '{user}' - invalid credentials"
        if user in self.loopback_users and not is_loopback(peer):
            return f"user '{user}' can only connect via localhost"
        return None

    def vhost_allowed(self, user: str, vhost: str, exists: bool) -> bool:
        return exists and (self.open_vhosts or (user, vhost) in self.permissions)

    def has_tag(self, user: str, tag: str) -> bool:
        u = self.users.get(user)
        return u is not None and tag in u.tags

    # --- resources -----------------------------------------------------------------------------

    def check(self, user: str, vhost: str, kind: str, name: str, perm: int) -> None:
        """perm: 0 configure, 1 write, 2 read. Raises 403 on the channel when refused."""
        if self.open_vhosts:
            return
        if kind == "exchange" and name == "":
            name = "amq.default"
        key = (user, vhost, kind, name, perm)
        if key in self._memo:
            return
        regexes = self.permissions.get((user, vhost))
        if regexes is None or regexes[perm].search(name) is None:
            raise _refused(f"{self._which(('configure', 'write', 'read')[perm])}access to {kind} '{name}' in "
                           f"vhost '{vhost}' refused for user '{user}'")
        if len(self._memo) > 10_000:
            self._memo.clear()
        self._memo[key] = True

    def check_topic(self, user: str, vhost: str, exchange: str, routing_key: str, perm: int) -> None:
        """perm: 0 write, 1 read (the topic permission's order)."""
        regexes = self.topic_permissions.get((user, vhost, exchange))
        if regexes is None:
            return
        pattern = regexes[perm].pattern
        if "{" in pattern:
            pattern = pattern.replace("{username}", user).replace("{vhost}", vhost)
        if re.search(pattern or "^$", routing_key) is None:
            raise _refused(f"{self._which(('write', 'read')[perm])}access to topic '{routing_key}' in exchange "
                           f"'{exchange}' in vhost '{vhost}' refused for user '{user}'")

    def _which(self, permission: str) -> str:
        return permission + " " if self.name_permission else ""


CONFIGURE, WRITE, READ = 0, 1, 2


# --- hooks called by the channel (one line each there) ---------------------------------------------
# Each takes the Channel and the method and raises AMQPError when refused; nothing here changes the model.

def _ac(ch) -> AccessControl:
    return ch.conn.core.access


def _queue_name(ch, name: str) -> str:
    """RabbitMQ expands "" to the channel's last declared queue before checking (expand_queue_name_shortcut);
    with none, it answers 404 "no previously declared queue"."""
    if name:
        return name
    if ch.last_queue is None:
        raise replies.channel_error(replies.NOT_FOUND, "no previously declared queue")
    return ch.last_queue


def _check(ch, kind: str, name: str, perm: int) -> None:
    ac = _ac(ch)
    if not ac.open_vhosts:
        ac.check(ch.conn.user, ch.vhost.name, kind, name, perm)


def _passive(ch, kind: str, name: str) -> None:
    """A passive declare: no permission on 3.10; any one of read, write, configure on 4.x (refused as
    configure, rabbit_channel:check_any_resource_access_permitted)."""
    ac = _ac(ch)
    if ac.open_vhosts or not ch.conn.core.behaviour.passive_declare_needs_a_permission:
        return
    for perm in (READ, WRITE):
        try:
            ac.check(ch.conn.user, ch.vhost.name, kind, name, perm)
            return
        except replies.AMQPError:
            pass
    ac.check(ch.conn.user, ch.vhost.name, kind, name, CONFIGURE)


def exchange_declare(ch, m) -> None:
    """Passive: see _passive. Else (after the type and default-exchange checks, which the vhost makes):
    configure on the exchange; for a new exchange with an alternate-exchange: read on it, write on the AE."""
    if m.passive and m.exchange:
        _passive(ch, "exchange", m.exchange)
    if m.passive or m.exchange == "" or _ac(ch).open_vhosts:
        return
    if m.exchange_type not in EXCHANGE_TYPES:
        return       # RabbitMQ checks the type first (503, a connection error): the vhost raises it
    _check(ch, "exchange", m.exchange, CONFIGURE)
    ae = (m.arguments or {}).get("alternate-exchange")
    if m.exchange not in ch.vhost.exchanges and isinstance(ae, (str, bytes)):
        _check(ch, "exchange", m.exchange, READ)
        _check(ch, "exchange", ae.decode() if isinstance(ae, bytes) else ae, WRITE)


def exchange_delete(ch, m) -> None:
    """configure, after the default-exchange and amq.* refusals (the vhost raises those)."""
    if m.exchange and not m.exchange.startswith("amq."):
        _check(ch, "exchange", m.exchange, CONFIGURE)


def exchange_binding(ch, m) -> None:
    """exchange.bind / unbind: write on the destination, read on the source (rabbit_channel:binding_action),
    then the topic read permission on the routing key when the source is a topic exchange."""
    _binding(ch, "exchange", m.destination, m.source, m.routing_key)


def queue_binding(ch, m) -> None:
    """queue.bind / unbind: write on the queue, read on the exchange, topic read on the routing key."""
    _binding(ch, "queue", _queue_name(ch, m.queue), m.exchange, m.routing_key)


def _binding(ch, dest_kind: str, dest: str, source: str, routing_key: str) -> None:
    if _ac(ch).all_allowed:
        return
    _check(ch, dest_kind, dest, WRITE)
    if dest == "" or source == "":
        return       # "operation not permitted on the default exchange": the vhost raises it
    _check(ch, "exchange", source, READ)
    _topic(ch, source, routing_key, 1)


def queue_declare(ch, m) -> str | None:
    """Not passive: configure on the queue (a server-named one under the amq.gen-* name it gets, which is
    returned for the vhost to use); for a new queue with a dead-letter exchange: read on the queue, write on
    the DLX. Names with the reserved amq. prefix are refused by the vhost before any permission check."""
    if m.passive:
        if m.queue:
            _passive(ch, "queue", m.queue)
        return None
    name = m.queue
    server_name = None
    if not name:
        name = server_name = "amq.gen-" + base64.urlsafe_b64encode(os.urandom(16)).decode().rstrip("=")
    elif name.startswith("amq.") or _ac(ch).open_vhosts:
        return None
    _check(ch, "queue", name, CONFIGURE)
    dlx = (m.arguments or {}).get("x-dead-letter-exchange")
    if name not in ch.vhost.queues and isinstance(dlx, (str, bytes)):
        _check(ch, "queue", name, READ)
        _check(ch, "exchange", dlx.decode() if isinstance(dlx, bytes) else dlx, WRITE)
    return server_name


def queue_configure(ch, m) -> None:
    """queue.delete: configure. The name is expanded (404 without a last declared queue) even when every
    user may do everything: RabbitMQ expands it before any handler runs."""
    name = _queue_name(ch, m.queue)
    if not _ac(ch).open_vhosts:
        _check(ch, "queue", name, CONFIGURE)


def queue_read(ch, m) -> None:
    """basic.get, basic.consume, queue.purge: read."""
    if not _ac(ch).open_vhosts:
        _check(ch, "queue", _queue_name(ch, m.queue), READ)


def publish_exchange(ch, exchange: str) -> None:
    """basic.publish: write on the exchange, before the exchange is looked up."""
    if not _ac(ch).open_vhosts:
        try:
            _ac(ch).check(ch.conn.user, ch.vhost.name, "exchange", exchange, WRITE)
        except replies.AMQPError as exc:
            raise _on_publish(exc) from None


def publish_topic(ch, x, routing_key: str) -> None:
    """basic.publish to a topic exchange: the topic write permission on the routing key."""
    if x.type_name == "topic" and _ac(ch).topic_permissions:
        try:
            _ac(ch).check_topic(ch.conn.user, ch.vhost.name, x.name, routing_key, 0)
        except replies.AMQPError as exc:
            raise _on_publish(exc) from None


def _on_publish(exc: replies.AMQPError) -> replies.AMQPError:
    """The content frames that complete a publish carry no method: name basic.publish (60, 40) as RabbitMQ."""
    exc.class_id, exc.method_id = methods.BASIC_PUBLISH
    return exc


def _topic(ch, exchange: str, routing_key: str, perm: int) -> None:
    ac = _ac(ch)
    if not ac.topic_permissions:
        return
    x = ch.vhost.exchanges.get(exchange)
    if x is not None and x.type_name == "topic":
        ac.check_topic(ch.conn.user, ch.vhost.name, exchange, routing_key, perm)


def impersonator(conn) -> bool:
    """A user tagged `impersonator` may set another user's name in the user-id property."""
    return conn.core.access.has_tag(conn.user, "impersonator")


# Attribute names as Python's ssl module gives a certificate's subject (getpeercert()) -> the short names
# RabbitMQ writes in a distinguished name (rabbit_cert_info:format_rdn); others are written as given.
_RDN_NAMES = {
    "surname": "SN", "givenName": "GIVENNAME", "initials": "INITIALS",
    "generationQualifier": "GENERATIONQUALIFIER", "commonName": "CN", "localityName": "L",
    "stateOrProvinceName": "ST", "organizationName": "O", "organizationalUnitName": "OU", "title": "TITLE",
    "countryName": "C", "serialNumber": "SERIALNUMBER", "pseudonym": "PSEUDONYM", "domainComponent": "DC",
    "emailAddress": "EMAILADDRESS", "streetAddress": "STREET", "userId": "UID",
}


def _escape_rdn_value(value: str) -> str:
    """RabbitMQ's escape_rdn_value (RFC 4514): a leading space or '#', a trailing space and ",+\"\\;<>"
    are escaped with a backslash; bytes below 32 or from 126 up (every byte of a non-ASCII character's
    UTF-8) as \\XX."""
    data = value.encode("utf-8")
    out = []
    for i, byte in enumerate(data):
        c = chr(byte)
        if i == 0 and c in " #":
            out.append("\\" + c)
        elif i == len(data) - 1 and c == " " and i > 0:
            out.append("\\ ")
        elif c in '"+,;<>\\':
            out.append("\\" + c)
        elif byte < 32 or byte >= 126:
            out.append(f"\\{byte:02X}")
        else:
            out.append(c)
    return "".join(out)


def cert_login_name(subject, mode: str) -> str | None:
    """The user a verified client certificate logs in as with SASL EXTERNAL, from its subject as Python's
    ssl module gives it (a tuple of RDNs, each a tuple of (attribute, value) pairs, in certificate order).

    "distinguished_name": RabbitMQ's rabbit_ssl:peer_cert_auth_name(distinguished_name): the RDNs in
    reverse order joined with ",", the values of a multi-valued RDN joined with "+", e.g.
    "CN=alice,OU=Testing,O=example". "common_name": the CN values joined with ","; None without a CN."""
    if mode == "common_name":
        names = [value for rdn in subject for attr, value in rdn if attr == "commonName"]
        return ",".join(names) if names else None
    return ",".join("+".join(f"{_RDN_NAMES.get(attr, attr)}={_escape_rdn_value(value)}" for attr, value in rdn)
                    for rdn in reversed(subject))
