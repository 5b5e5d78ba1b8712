"""Exchanges and their routing rules (AMQP 0-9-1 section 3.1.3, the AMQ model's exchange types).

A binding's destination is a Queue or an Exchange (RabbitMQ's exchange-to-exchange bindings). `route`
returns the destinations one exchange selects; following exchange destinations, alternate exchanges and
de-duplication is the virtual host's job (`VirtualHost.route`).
"""

from __future__ import annotations

import random

from spark_amqp.codec import fields, replies


class Exchange:
    type_name = ""

    def __init__(self, name: str, durable: bool = False, auto_delete: bool = False,
                 internal: bool = False, arguments: dict | None = None):
        self.name = name
        self.durable = durable
        self.auto_delete = auto_delete
        self.internal = internal
        self.arguments = dict(arguments or {})
        self.policy_alternate_exchange = None   # a policy's alternate-exchange (the argument wins over it)
        # (destination, routing_key, frozen arguments) -> binding arguments
        self.bindings: dict[tuple, dict] = {}

    @property
    def alternate_exchange(self) -> str | None:
        ae = self.arguments.get("alternate-exchange", self.policy_alternate_exchange)   # rabbit_policy:get_arg
        return ae if isinstance(ae, str) and ae else None

    def bind(self, dest, routing_key: str, arguments: dict) -> None:
        key = (dest, routing_key, _freeze(arguments))
        if key not in self.bindings:
            self.bindings[key] = arguments
            self._bound(dest, routing_key, arguments)

    def unbind(self, dest, routing_key: str, arguments: dict) -> bool:
        key = (dest, routing_key, _freeze(arguments))
        if self.bindings.pop(key, None) is None:
            return False
        self._unbound(dest, routing_key, arguments)
        return True

    def unbind_destination(self, dest) -> None:
        for key in [k for k in self.bindings if k[0] is dest]:
            self.unbind(dest, key[1], self.bindings[key])

    def configure(self, behaviour) -> None:
        """Take what the exchange type does differently in the RabbitMQ version the broker behaves as."""

    def _bound(self, dest, routing_key, arguments):
        pass

    def _unbound(self, dest, routing_key, arguments):
        pass

    def route(self, routing_key: str, message) -> list:
        raise NotImplementedError


class DirectExchange(Exchange):
    """Routes to bindings whose key equals the routing key."""
    type_name = "direct"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._by_key: dict[str, list] = {}

    def _bound(self, dest, routing_key, arguments):
        dests = self._by_key.setdefault(routing_key, [])
        if dest not in dests:
            dests.append(dest)

    def _unbound(self, dest, routing_key, arguments):
        if any(k[0] is dest and k[1] == routing_key for k in self.bindings):
            return  # still bound under other arguments
        dests = self._by_key.get(routing_key)
        if dests and dest in dests:
            dests.remove(dest)
            if not dests:
                del self._by_key[routing_key]

    def route(self, routing_key, message):
        return self._by_key.get(routing_key, ())


class FanoutExchange(Exchange):
    """Routes to every binding, ignoring the routing key."""
    type_name = "fanout"

    def route(self, routing_key, message):
        seen = []
        for dest, _, _ in self.bindings:
            if dest not in seen:
                seen.append(dest)
        return seen


class TopicExchange(Exchange):
    """Routing keys are dot-separated words; in binding keys `*` matches one word, `#` zero or more."""
    type_name = "topic"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._cache: dict[str, list] = {}

    def _bound(self, dest, routing_key, arguments):
        self._cache.clear()

    def _unbound(self, dest, routing_key, arguments):
        self._cache.clear()

    def route(self, routing_key, message):
        hit = self._cache.get(routing_key)
        if hit is not None:
            return hit
        words = _words(routing_key)
        out = []
        for dest, binding_key, _ in self.bindings:
            if dest not in out and topic_matches(_words(binding_key), words):
                out.append(dest)
        if len(self._cache) > 10000:
            self._cache.clear()
        self._cache[routing_key] = out
        return out


def _words(key: str) -> list[str]:
    """RabbitMQ splits on '.': the empty key has no words, while "." is two empty words."""
    return key.split(".") if key else []


def topic_matches(pattern: list[str], words: list[str]) -> bool:
    """RabbitMQ's topic rule: `*` is exactly one word, `#` any number of words (including none)."""
    # Dynamic programming over (pattern index, word index): no exponential backtracking on many '#'.
    reachable = {0}
    for p in pattern:
        nxt = set()
        for i in reachable:
            if p == "#":
                nxt.update(range(i, len(words) + 1))
            elif i < len(words) and (p == "*" or p == words[i]):
                nxt.add(i + 1)
        if not nxt:
            return False
        reachable = nxt
    return len(words) in reachable


class HeadersExchange(Exchange):
    """Routes on message headers against binding arguments; `x-match` = all (default) or any.

    RabbitMQ also accepts `all-with-x` / `any-with-x`, which compare `x-` prefixed keys too; plain
    all/any ignore them. A binding value of type void matches on the header's presence alone.
    """
    type_name = "headers"
    exact = False      # see configure

    def configure(self, behaviour) -> None:
        # 4.x compares header and binding values with exact equality (1 and 1.0 differ); 3.10 compares
        # numbers by value.
        self.exact = behaviour.headers_exact_match

    def bind(self, dest, routing_key: str, arguments: dict) -> None:
        _check_x_match(arguments)
        super().bind(dest, routing_key, arguments)

    def route(self, routing_key, message):
        headers = _message_headers(message)
        out = []
        for (dest, _, _), args in self.bindings.items():
            if dest not in out and headers_match(args, headers, self.exact):
                out.append(dest)
        return out


def _message_headers(message) -> dict:
    """The message's headers, each value decoded on its own: a value nested deeper than fields.MAX_DEPTH
    stays an opaque object that equals no binding value (RabbitMQ decodes any depth; such a value could only
    match a binding argument as deep), so the message is still routed on its other headers."""
    props = message.read_properties()
    raw = props.get("headers_raw")
    if not raw:
        return {}
    headers = {}
    for key, value in fields.table_items(raw):
        try:
            headers[key] = fields.decode_value(value)
        except fields.FieldError:
            if value[:1] not in (b"F", b"A"):
                raise
            headers[key] = _TOO_DEEP
    return headers


_TOO_DEEP = object()


_X_MATCH_MODES = ("all", "any", "all-with-x", "any-with-x")


def _check_x_match(arguments: dict) -> None:
    """RabbitMQ 3.10 refuses a headers binding whose x-match is not one of the four strings (measured):
    406 "Invalid x-match field type bool (value true); expected longstr" or "Invalid x-match field value
    <<"bogus">>; expected all, any, all-with-x, or any-with-x"."""
    if "x-match" not in arguments:
        return
    mode = arguments["x-match"]
    if not isinstance(mode, str):
        kind = {bool: "bool", int: "long", float: "double", bytes: "binary", dict: "table",
                list: "array"}.get(type(mode), type(mode).__name__)
        shown = str(mode).lower() if isinstance(mode, bool) else str(mode)[:60]
        raise replies.channel_error(
            replies.PRECONDITION_FAILED,
            f"Invalid x-match field type {kind} (value {shown}); expected longstr")
    if mode not in _X_MATCH_MODES:
        raise replies.channel_error(
            replies.PRECONDITION_FAILED,
            f'Invalid x-match field value <<"{mode[:60]}">>; expected all, any, all-with-x, or any-with-x')


def headers_match(args: dict, headers: dict, exact: bool = False) -> bool:
    mode = args.get("x-match", "all")
    if isinstance(mode, bytes):
        mode = mode.decode()
    with_x = mode.endswith("-with-x")
    pairs = [(k, v) for k, v in args.items() if k != "x-match" and (with_x or not k.startswith("x-"))]
    if mode.startswith("any"):
        return any(_header_equal(k, v, headers, exact) for k, v in pairs)
    return all(_header_equal(k, v, headers, exact) for k, v in pairs)


def _header_equal(key, value, headers, exact: bool) -> bool:
    if key not in headers:
        return False
    if value is None:
        return True
    have = headers[key]
    if isinstance(have, bytes) and isinstance(value, str):
        have = have.decode("utf-8", "replace")
    elif isinstance(value, bytes) and isinstance(have, str):
        value = value.decode("utf-8", "replace")
    return type(have) is type(value) and have == value or not exact and (
        isinstance(have, (int, float)) and isinstance(value, (int, float))
        and not isinstance(have, bool) and not isinstance(value, bool) and have == value)


class LocalRandomExchange(Exchange):
    """RabbitMQ 4.x's x-local-random: each message goes to one of the bound queues, picked at random
    (every queue is local to this broker). Only classic queues may be bound, with an empty key
    (rabbit_exchange_type_local_random:validate_binding)."""
    type_name = "x-local-random"

    def bind(self, dest, routing_key: str, arguments: dict) -> None:
        if routing_key:
            reason = f"Non empty binding '{routing_key}' key not permitted"
        elif isinstance(dest, Exchange):
            reason = "Destination not found"
        elif dest.queue_type != "classic":
            reason = f"Queue type rabbit_{dest.queue_type}_queue not valid for this exchange type"
        else:
            reason = None
        if reason:
            raise replies.channel_error(replies.PRECONDITION_FAILED, reason)
        super().bind(dest, routing_key, arguments)

    def route(self, routing_key, message):
        dests = list(dict.fromkeys(dest for dest, _, _ in self.bindings))
        return [random.choice(dests)] if dests else []


EXCHANGE_TYPES = {cls.type_name: cls for cls in (DirectExchange, FanoutExchange, TopicExchange,
                                                  HeadersExchange, LocalRandomExchange)}


def _freeze(value):
    if isinstance(value, dict):
        return tuple(sorted((k, _freeze(v)) for k, v in value.items()))
    if isinstance(value, list):
        return tuple(_freeze(v) for v in value)
    if isinstance(value, bytearray):
        return bytes(value)
    return value
