"""Queue and consumer arguments checked as RabbitMQ checks them, for every queue type.

RabbitMQ validates `queue.declare` arguments in one place for all queue types
(rabbit_amqqueue:check_declare_arguments): first `x-queue-type`, then the value of every argument the
queue's type takes, in one fixed order, then the names of arguments that belong to another queue type
("... of queue type rabbit_quorum_queue"); arguments no queue type knows are ignored. A redeclare compares
only the arguments the existing queue's type takes (rabbit_misc:assert_args_equivalence). Consumer arguments
follow the same pattern (check_consume_arguments). Doing this once here, for classic, quorum and stream
queues, keeps the three types' texts identical to RabbitMQ's and to each other; which arguments each type
takes, and which validators exist, differ between versions and come from `versions.Behaviour`.

Reply texts print Erlang terms as RabbitMQ's `~p` does: a reason string in double quotes
(`"expected integer, got longstr"`), a tuple in braces (`{value_negative,-1}`), an atom bare.
"""

from __future__ import annotations

import datetime
import re

from spark_amqp.codec import replies

# The queue types and the module names RabbitMQ prints for them.
CLASSIC, QUORUM, STREAM = "classic", "quorum", "stream"
TYPE_MODULES = {CLASSIC: "rabbit_classic_queue", QUORUM: "rabbit_quorum_queue", STREAM: "rabbit_stream_queue"}

OVERFLOW_MODES = ("drop-head", "reject-publish", "reject-publish-dlx")
DLX_STRATEGIES = ("at-most-once", "at-least-once")
QUEUE_MODES = ("default", "lazy")
MAX_PRIORITY = 255                    # rabbit.hrl MAX_SUPPORTED_PRIORITY
MAX_EXPIRY = 315_360_000_000          # rabbit_misc:check_expiry: ten years in milliseconds

# check_max_age units, in ms (rabbit_amqqueue:unit_value_in_ms).
AGE_UNITS = {"s": 1000, "m": 60_000, "h": 3_600_000, "D": 86_400_000, "M": 30 * 86_400_000,
             "Y": 365 * 86_400_000}
_AGE = re.compile(r"([0-9]*)(.*)", re.S)


class Crash(replies.AMQPError):
    """Where RabbitMQ crashes its channel on a bad argument (3.10's list_to_integer("") in check_max_age,
    osiris given an offset that is not an integer): the client sees connection.close 541 INTERNAL_ERROR."""

    def __init__(self):
        super().__init__(replies.INTERNAL_ERROR, "INTERNAL_ERROR", hard=True)
        self.text = "INTERNAL_ERROR"   # RabbitMQ's text for a crash: the name alone


def rs(name: str, vhost: str) -> str:
    """rabbit_misc:rs/1: how RabbitMQ names a queue in reply texts."""
    return f"queue '{name}' in vhost '{vhost}'"


def type_name(value) -> str:
    """The AMQP field type RabbitMQ names in texts, for a decoded value (pika and py-amqp send Python ints
    that fit 32 bits as signedint, larger ones as long)."""
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int):
        return "signedint" if -(1 << 31) <= value < (1 << 31) else "long"
    if isinstance(value, str):
        return "longstr"
    if isinstance(value, (bytes, bytearray)):
        return "binary"
    if isinstance(value, float):
        return "double"
    if isinstance(value, datetime.datetime):
        return "timestamp"
    if isinstance(value, dict):
        return "table"
    if isinstance(value, (list, tuple)):
        return "array"
    if value is None:
        return "void"
    return "decimal"


def text(value):
    """A longstr or binary value as text (other values unchanged)."""
    return bytes(value).decode("utf-8", "replace") if isinstance(value, (bytes, bytearray)) else value


def erl_string(s: str) -> str:
    """An Erlang string printed by ~p."""
    return '"' + s.replace("\\", "\\\\").replace('"', '\\"') + '"'


def is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def parse_max_age(value: str, needs_digits: bool) -> int | None:
    """rabbit_amqqueue:check_max_age/1: digits then one unit of Y M D h m s, more than zero; the age in ms,
    or None when invalid. Without digits RabbitMQ 3.10 crashes (list_to_integer("")), raising Crash here;
    4.x's pattern needs a digit (`needs_digits`) and calls it invalid."""
    digits, unit = _AGE.match(value).groups()
    if not digits:
        if needs_digits:
            return None
        raise Crash()
    n = int(digits)
    if n <= 0 or unit not in AGE_UNITS:
        return None
    return n * AGE_UNITS[unit]


# --- the validators (rabbit_amqqueue:declare_args/0): each returns None or RabbitMQ's reason ----------------

def _int(v, _args, _b):
    return None if is_int(v) else erl_string(f"expected integer, got {type_name(v)}")


def _non_neg_int(v, args, b):
    return _int(v, args, b) or (f"{{value_negative,{v}}}" if v < 0 else None)


def _expiry(v):
    if v < 0:
        return f"{{value_negative,{v}}}"
    if v > MAX_EXPIRY:
        return f"{{value_too_large,{v}}}"
    return None


def _expires(v, args, b):
    return _int(v, args, b) or ("{value_zero,0}" if v == 0 else _expiry(v))


def _message_ttl(v, args, b):
    return _int(v, args, b) or _expiry(v)


def _string_of(choices, invalid):
    def check(v, _args, _b):
        if not isinstance(v, str):
            return f"{{unacceptable_type,{type_name(v)}}}"
        return None if v in choices else invalid
    return check


def _dlx_name(v, _args, _b):
    return None if isinstance(v, str) else f"{{unacceptable_type,{type_name(v)}}}"


def _dlx_routing_key(v, args, _b):
    if not isinstance(v, str):
        return f"{{unacceptable_type,{type_name(v)}}}"
    return None if "x-dead-letter-exchange" in args else "routing_key_but_no_dlx_defined"


def _max_priority(v, args, b):
    return _non_neg_int(v, args, b) or (f"{{max_value_exceeded,{v}}}" if v > MAX_PRIORITY else None)


def _queue_mode(v, _args, _b):
    if not isinstance(v, str):
        return f"{{unacceptable_type,{type_name(v)}}}"
    return None if v in QUEUE_MODES else erl_string(f"unsupported queue mode '{v}'")


def _queue_version(v, args, b):
    return _non_neg_int(v, args, b) or (
        None if v in b.queue_versions else erl_string(f"unsupported queue version '{v}'"))


def _bool(v, _args, _b):
    return None if isinstance(v, bool) else f"{{unacceptable_type,{type_name(v)}}}"


def _queue_type(v, _args, _b):
    if not isinstance(v, str):
        return f"{{unacceptable_type,{type_name(v)}}}"
    return None if v in TYPE_MODULES else erl_string(f"unsupported queue type '{v}'")


def _cluster_size(v, args, b):
    return _non_neg_int(v, args, b) or ("{value_zero,0}" if v == 0 else None)


def _max_age(v, _args, b):
    if not isinstance(v, str):
        return f"{{unacceptable_type,{type_name(v)}}}"
    return None if parse_max_age(v, b.max_age_needs_digits) is not None else "invalid_max_age"


def _leader_locator(v, _args, b):
    if not isinstance(v, str):
        return f"{{unacceptable_type,{type_name(v)}}}"
    return None if v in b.leader_locators else "invalid_queue_locator_arg"


VALIDATORS = {
    "x-expires": _expires,
    "x-message-ttl": _message_ttl,
    "x-dead-letter-exchange": _dlx_name,
    "x-dead-letter-routing-key": _dlx_routing_key,
    "x-dead-letter-strategy": _string_of(DLX_STRATEGIES, "invalid_dlx_strategy"),
    "x-max-length": _non_neg_int,
    "x-max-length-bytes": _non_neg_int,
    "x-max-in-memory-length": _non_neg_int,
    "x-max-in-memory-bytes": _non_neg_int,
    "x-max-priority": _max_priority,
    "x-overflow": _string_of(OVERFLOW_MODES, "invalid_overflow"),
    "x-queue-mode": _queue_mode,
    "x-queue-version": _queue_version,
    "x-single-active-consumer": _bool,
    "x-consumer-timeout": _non_neg_int,
    "x-consumer-disconnected-timeout": _non_neg_int,
    "x-queue-type": _queue_type,
    "x-quorum-initial-group-size": _cluster_size,
    "x-max-age": _max_age,
    "x-stream-max-segment-size-bytes": _non_neg_int,
    "x-stream-filter-size-bytes": _non_neg_int,
    "x-initial-cluster-size": _cluster_size,
    "x-queue-leader-locator": _leader_locator,
    # consumer arguments (rabbit_amqqueue:consume_args/0)
    "x-priority": _int,
    "x-cancel-on-ha-failover": _bool,
}


def invalid_arg(key: str, name: str, vhost: str, reason: str) -> replies.AMQPError:
    return replies.channel_error(replies.PRECONDITION_FAILED, f"invalid arg '{key}' for {rs(name, vhost)}: {reason}")


def queue_type(args: dict, behaviour, default: str | None = None) -> str:
    """The type a declare with `args` asks for: x-queue-type, the vhost's default (classic unless set) when
    absent or empty."""
    value = text(args.get("x-queue-type"))
    return value if value else default or CLASSIC


def with_queue_type(args: dict, behaviour) -> dict:
    """The arguments RabbitMQ works with: 4.x adds x-queue-type=classic to a declare that names no type
    (rabbit_amqqueue:augment_declare_args; the queue keeps it, which shows in equivalence texts); 3.10 keeps
    the arguments as sent."""
    args = dict(args or {})
    if behaviour.declare_names_queue_type and "x-queue-type" not in args:
        args["x-queue-type"] = CLASSIC
    return args


def _comparable(args: dict, behaviour) -> dict:
    """The arguments as a redeclare compares them: 4.x keeps a stream's x-max-age as milliseconds, so
    "60m" is "1h", and its texts print the milliseconds."""
    if behaviour.stream_max_age_in_ms and isinstance(args.get("x-max-age"), str):
        ms = parse_max_age(args["x-max-age"], behaviour.max_age_needs_digits)
        if ms is not None:
            return {**args, "x-max-age": str(ms)}
    return args


def check_dead_letter_exchange(args: dict, name: str, vhost: str) -> None:
    """rabbit_channel's check on a new queue's x-dead-letter-exchange, before the other arguments: it must
    be a longstr."""
    v = args.get("x-dead-letter-exchange")
    if v is not None and not isinstance(v, str):
        raise replies.channel_error(
            replies.PRECONDITION_FAILED,
            f"invalid type '{type_name(v)}' for arg 'x-dead-letter-exchange' in {rs(name, vhost)}")


def check_declare(args: dict, name: str, vhost: str, behaviour, default: str | None = None) -> str:
    """rabbit_amqqueue:check_declare_arguments for a new queue; returns its type. Raises 406 with RabbitMQ's
    text for the first bad value (in the validators' order), then for the first argument (in the client's
    order) that belongs to another queue type."""
    qtype = text(args.get("x-queue-type"))
    if qtype:    # an empty x-queue-type means the default type (4.x; 3.10 refuses it below)
        reason = _queue_type(qtype, args, behaviour)
        if reason:
            raise invalid_arg("x-queue-type", name, vhost, reason)
    elif "x-queue-type" in args and not behaviour.declare_names_queue_type:
        raise invalid_arg("x-queue-type", name, vhost, erl_string("unsupported queue type ''"))
    if not qtype:
        qtype = default or CLASSIC
        args = {**args, "x-queue-type": qtype}   # what 4.x validates an empty type as (the vhost's default)
    takes = behaviour.queue_arguments[qtype]
    for key in behaviour.declare_validators:
        if key in takes and key in args:
            reason = VALIDATORS[key](args[key], args, behaviour)
            if reason:
                raise invalid_arg(key, name, vhost, reason)
    _refuse_other_types(args, behaviour.queue_arguments, qtype, name, vhost)
    return qtype


def _refuse_other_types(args: dict, table: dict, qtype: str, name: str, vhost: str) -> None:
    """406 for the first argument that only another queue type takes (`table`: type -> argument names)."""
    others = {k for t, keys in table.items() if t != qtype for k in keys} - set(table[qtype])
    for key in args:
        if key in others:
            raise replies.channel_error(
                replies.PRECONDITION_FAILED,
                f"invalid arg '{key}' for {rs(name, vhost)} of queue type {TYPE_MODULES[qtype]}")


def check_consume(args: dict, qtype: str, name: str, vhost: str, behaviour, skip=()) -> None:
    """rabbit_amqqueue:check_consume_arguments: the values of the consumer arguments the queue's type takes,
    then the names of other types' consumer arguments. `skip`: arguments the caller checks itself
    (a stream's x-stream-offset)."""
    takes = behaviour.consumer_arguments[qtype]
    for key in ("x-priority", "x-cancel-on-ha-failover", "x-consumer-timeout"):
        if key in takes and key in args and key not in skip:
            reason = VALIDATORS.get(key, _non_neg_int)(args[key], args, behaviour)
            if reason:
                raise invalid_arg(key, name, vhost, reason)
    _refuse_other_types(args, behaviour.consumer_arguments, qtype, name, vhost)


# --- redeclare: rabbit_misc:assert_args_equivalence ---------------------------------------------------------

def _type_class(value) -> str:
    """rabbit_misc:type_class/1: all integer types compare as one class, as do float and double."""
    t = type_name(value)
    return "int" if t in ("signedint", "long", "decimal") else "float" if t == "double" else t


def _val(value, typed: bool) -> str:
    """rabbit_misc:val/1: how a value is printed in an equivalence failure."""
    if value is None:
        return "none"
    shown = text(value)
    shown = str(shown).lower() if isinstance(shown, bool) else str(shown)
    return f"the value '{shown}' of type '{type_name(value)}'" if typed else f"'{shown}'"


def assert_equivalent(have: dict, want: dict, qtype: str, name: str, vhost: str, behaviour) -> None:
    """A redeclare of an existing queue of type `qtype` (durable, auto-delete and exclusivity compared by
    the caller): each argument the type takes, in its order, must be the same. One side missing prints
    "the value 'v' of type 't'" / "none"; both present prints the values alone."""
    have, want = _comparable(have, behaviour), _comparable(want, behaviour)
    for key in behaviour.queue_arguments[qtype]:
        a, b = have.get(key), want.get(key)
        if a is None and b is None:
            continue
        if a is not None and b is not None:
            if _type_class(a) == _type_class(b) and text(a) == text(b):
                continue
            detail = f"received {_val(b, False)} but current is {_val(a, False)}"
        else:
            if key == "x-queue-type" and text(a if a is not None else b) == CLASSIC:
                continue   # assert_field_equivalence: no type and classic are the same
            detail = f"received {_val(b, True)} but current is {_val(a, True)}"
        raise replies.channel_error(replies.PRECONDITION_FAILED,
                                    f"inequivalent arg '{key}' for {rs(name, vhost)}: {detail}")


def deprecated_feature_denied(feature: str) -> replies.AMQPError:
    """541 INTERNAL_ERROR carrying the warning of a deprecated feature 4.x denies by default
    (rabbit_deprecated_features, phase denied_by_default), cut as RabbitMQ cuts every reply text: to 255
    characters, the last three being "..." (rabbit_binary_generator, io_lib chars_limit)."""
    warning = (f"Feature `{feature}` is deprecated.\n"
               "By default, this feature is not permitted anymore.\n"
               "The feature will be removed from a future major RabbitMQ version, regardless of the "
               "configuration; actual version to be determined.\n"
               "To continue using this feature when it is not permitted by default, set the following "
               "parameter in your configuration:\n"
               f'    "deprecated_features.permit.{feature} = true"')
    room = 255 - len("INTERNAL_ERROR - ")
    if len(warning) > room:
        warning = warning[:room - 3] + "..."
    return replies.connection_error(replies.INTERNAL_ERROR, warning)
