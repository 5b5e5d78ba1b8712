"""RabbitMQ's definitions file (what `rabbitmqctl export_definitions` writes) loaded into the embedded broker.

Why: a user can take the topology of their production RabbitMQ (users with their password hashes, vhosts
with their default queue type, permissions, topic permissions, exchanges, queues, bindings, policies and
operator policies) into their tests unchanged. Policies are read here and checked by config.py
(policies.validate), since what RabbitMQ accepts depends on the version the broker behaves as.

What the broker does not support is never dropped silently: each such item is named in a WARNING log line
(`broker.definitions` logger) and kept in `BrokerCore.definitions_skipped`: policies the version's RabbitMQ
would refuse (with its text), parameters, global_parameters, user and vhost limits, users whose hashing_algorithm is unknown, queues or exchanges the
broker refuses (e.g. invalid arguments, an unknown exchange type: the warning carries the broker's
reason), bindings whose source or destination was skipped, and unknown top-level keys. A file that is not
a definitions document (not JSON, a list where a list of objects belongs, a permission without its
expressions) is an error naming the file and the entry.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field

from spark_amqp.codec import replies

from . import access

log = logging.getLogger("broker.definitions")

# Keys export_definitions writes that carry no topology: informational.
_INFORMATIONAL = {"rabbit_version", "rabbitmq_version", "product_name", "product_version"}
_TOPOLOGY = {"users", "vhosts", "permissions", "topic_permissions", "queues", "exchanges", "bindings", "policies",
             "operator_policies"}
_UNSUPPORTED = {"parameters", "global_parameters"}


@dataclass
class Definitions:
    users: dict = field(default_factory=dict)              # name -> access.User
    vhosts: list = field(default_factory=list)
    permissions: dict = field(default_factory=dict)        # (user, vhost) -> (configure, write, read)
    topic_permissions: dict = field(default_factory=dict)  # (user, vhost, exchange) -> (write, read)
    exchanges: list = field(default_factory=list)
    queues: list = field(default_factory=list)
    bindings: list = field(default_factory=list)
    policies: list = field(default_factory=list)           # entries as exported (checked by config.py)
    operator_policies: list = field(default_factory=list)
    default_queue_types: dict = field(default_factory=dict)  # vhost -> its default_queue_type
    skipped: list = field(default_factory=list)            # what the broker does not support, by name


def read(source) -> tuple[dict, str]:
    """The document and a name for errors: source is a path (str / PathLike) or an already-parsed dict."""
    if isinstance(source, dict):
        return source, "definitions"
    if not isinstance(source, (str, os.PathLike)):
        raise ValueError(f"definitions must be a path to a JSON file or a dict, got {type(source).__name__}")
    path = os.fspath(source)
    try:
        with open(path, encoding="utf-8") as fh:
            doc = json.load(fh)
    except OSError as exc:
        raise ValueError(f"definitions: cannot read {path!r}: {exc.strerror or exc}") from None
    except ValueError as exc:
        raise ValueError(f"definitions: {path!r} is not JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise ValueError(f"definitions: {path!r} must hold a JSON object (as export_definitions writes)")
    return doc, f"definitions {path!r}"


def parse(source) -> Definitions:
    doc, where = read(source)
    d = Definitions()
    for key in sorted(set(doc) - _INFORMATIONAL - _TOPOLOGY - _UNSUPPORTED):
        d.skipped.append(f"unknown key '{key}'")
    for key in ("policies", "operator_policies"):
        for i, item in enumerate(_entries(doc, key, where)):
            _str(item, "name", f"{where}: {key}[{i}]"), _str(item, "vhost", f"{where}: {key}[{i}]")
            getattr(d, key).append(item)
    for item in _entries(doc, "parameters", where):
        d.skipped.append(f"parameter '{item.get('name')}' of component '{item.get('component')}' "
                         f"in vhost '{item.get('vhost')}'")
    for item in _entries(doc, "global_parameters", where):
        d.skipped.append(f"global parameter '{item.get('name')}'")
    for i, item in enumerate(_entries(doc, "users", where)):
        name = _str(item, "name", f"{where}: users[{i}]")
        if item.get("limits"):
            d.skipped.append(f"limits of user '{name}' ({json.dumps(item['limits'], sort_keys=True)})")
        algorithm = item.get("hashing_algorithm") or _default_hashing(doc)
        if algorithm not in access.HASHES:
            d.skipped.append(f"user '{name}': unsupported hashing_algorithm '{algorithm}' (the user cannot "
                             "log in; supported: " + ", ".join(sorted(access.HASHES)) + ")")
            continue
        spec = {"password_hash": item.get("password_hash", ""), "hashing_algorithm": algorithm,
                "tags": item.get("tags", ())}
        d.users[name] = access.make_user(name, spec, where=f"{where}: users")
    for i, item in enumerate(_entries(doc, "vhosts", where)):
        name = _str(item, "name", f"{where}: vhosts[{i}]")
        if item.get("limits"):
            d.skipped.append(f"limits of vhost '{name}' ({json.dumps(item['limits'], sort_keys=True)})")
        d.vhosts.append(name)
        qtype = item.get("default_queue_type") or (item.get("metadata") or {}).get("default_queue_type")
        if qtype:
            if qtype not in ("classic", "quorum", "stream"):
                d.skipped.append(f"default_queue_type '{qtype}' of vhost '{name}' (an unknown queue type)")
            else:
                d.default_queue_types[name] = qtype
    for i, item in enumerate(_entries(doc, "permissions", where)):
        at = f"{where}: permissions[{i}]"
        key = (_str(item, "user", at), _str(item, "vhost", at))
        d.permissions[key] = access.parse_permission(item, at)
    for i, item in enumerate(_entries(doc, "topic_permissions", where)):
        at = f"{where}: topic_permissions[{i}]"
        key = (_str(item, "user", at), _str(item, "vhost", at), _str(item, "exchange", at))
        d.topic_permissions[key] = access.parse_topic_permission(item, at)
    for i, item in enumerate(_entries(doc, "exchanges", where)):
        at = f"{where}: exchanges[{i}]"
        _str(item, "name", at), _str(item, "vhost", at), _str(item, "type", at)
        d.exchanges.append(item)
    for i, item in enumerate(_entries(doc, "queues", where)):
        at = f"{where}: queues[{i}]"
        _str(item, "name", at), _str(item, "vhost", at)
        d.queues.append(item)
    for i, item in enumerate(_entries(doc, "bindings", where)):
        at = f"{where}: bindings[{i}]"
        for key in ("source", "vhost", "destination", "destination_type"):
            _str(item, key, at)
        if item["destination_type"] not in ("queue", "exchange"):
            raise ValueError(f"{at}.destination_type must be 'queue' or 'exchange', "
                             f"got {item['destination_type']!r}")
        d.bindings.append(item)
    return d


def _default_hashing(doc: dict) -> str:
    """A user exported without hashing_algorithm (before 3.6.1): RabbitMQ's import takes MD5 for files from
    3.0 to 3.5 (their rabbit_version says so) and its default, SHA-256, otherwise."""
    version = str(doc.get("rabbit_version") or doc.get("rabbitmq_version") or "")
    old = any(version.startswith(f"3.{minor}.") for minor in range(6))
    return access.MD5 if old else access.SHA256


def _entries(doc: dict, key: str, where: str) -> list[dict]:
    items = doc.get(key) or []
    if not isinstance(items, list) or not all(isinstance(i, dict) for i in items):
        raise ValueError(f"{where}: '{key}' must be a list of objects")
    return items


def _str(item: dict, key: str, at: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise ValueError(f"{at}.{key} must be a string, got {value!r}")
    return value


def apply_topology(core, d: Definitions) -> None:
    """Declare the definitions' exchanges, queues and bindings in the core's vhosts (the vhosts exist by now),
    as RabbitMQ's import does: exchanges, then queues, then bindings. Refusals become skipped items."""
    skipped = list(d.skipped)

    def vhost_of(item: dict, what: str):
        vhost = core.vhosts.get(item["vhost"])
        if vhost is None:
            skipped.append(f"{what}: the vhost is not defined")
        return vhost

    for x in d.exchanges:
        what = f"exchange '{x['name']}' in vhost '{x['vhost']}'"
        vhost = vhost_of(x, what)
        if vhost is None or x["name"] == "" or x["name"].startswith("amq."):
            continue     # the default and amq.* exchanges exist in every vhost (exports list none of them)
        _declare(skipped, what, vhost.declare_exchange, x["name"], x["type"], False, bool(x.get("durable", True)),
                 bool(x.get("auto_delete", False)), bool(x.get("internal", False)), x.get("arguments") or {})
    for q in d.queues:
        what = f"queue '{q['name']}' in vhost '{q['vhost']}'"
        vhost = vhost_of(q, what)
        if vhost is None:
            continue
        args = dict(q.get("arguments") or {})
        if q.get("type", "classic") != "classic":
            args.setdefault("x-queue-type", q["type"])     # 3.10 exports name the type beside the arguments
        _declare(skipped, what, vhost.declare_queue, q["name"], False, bool(q.get("durable", True)), False,
                 bool(q.get("auto_delete", False)), args, None)
    for b in d.bindings:
        what = (f"binding from exchange '{b['source']}' to {b['destination_type']} '{b['destination']}' "
                f"with routing key {b.get('routing_key', '')!r} in vhost '{b['vhost']}'")
        vhost = vhost_of(b, what)
        if vhost is None:
            continue
        key, args = b.get("routing_key", ""), b.get("arguments") or {}
        if b["destination_type"] == "queue":
            q = vhost.queues.get(b["destination"])
            if q is None:
                skipped.append(f"{what}: no such queue")
                continue
            _declare(skipped, what, vhost.bind_queue, q, b["source"], key, args)
        else:
            _declare(skipped, what, vhost.bind_exchange, b["destination"], b["source"], key, args)
    log.info("definitions: %d users, %d vhosts, %d permissions, %d topic permissions, %d exchanges, %d queues, "
             "%d bindings read; %d items not loaded", len(d.users), len(d.vhosts), len(d.permissions),
             len(d.topic_permissions), len(d.exchanges), len(d.queues), len(d.bindings), len(skipped))
    for item in skipped:
        log.warning("definitions: not loaded (not supported by the embedded broker): %s", item)
    core.definitions_skipped = skipped


def _declare(skipped: list, what: str, fn, *args) -> None:
    try:
        fn(*args)
    except replies.AMQPError as exc:
        skipped.append(f"{what}: {exc.text}")
