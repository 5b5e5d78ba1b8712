"""Policies and operator policies: stored per vhost, matched to queues and exchanges, and resolved against a
queue's own arguments, as RabbitMQ does (rabbit_policy, rabbit_policies, rabbit_queue_type_util).

- A policy is (vhost, name, pattern, apply-to, priority, definition). Its pattern is a regular expression
  searched, unanchored, in the queue's or exchange's name (re.search; RabbitMQ's re:run). `apply-to` is
  `queues`, `exchanges` or `all`, and on 4.x also `classic_queues`, `quorum_queues`, `streams`.
- One policy applies to an object: the matching one of highest priority; between equal priorities, the name
  that sorts first (measured on both reference nodes). A policy holding a key the queue's type does not take
  (its `unsupported_policies` capability, e.g. `max-age` for a classic queue) does not match that queue at
  all, and the next one does. The same for operator policies, separately.
- The operator policy is merged into the policy (rabbit_policy:merge_operator_definitions): for a key both
  set, the lower number wins (delivery-limit: the higher when one is negative), and on 4.x the operator's
  `overflow` and `queue-version`. Operator policies take only the version's operator keys.
- What a queue acts on is the merged definition resolved against its x-arguments per key (`effective`):
  see RESOLVE.
- Keys the version's RabbitMQ recognises but this broker does not act on (ha-*, queue-mode,
  consumer-disconnected-timeout, ...) are accepted and named in a WARNING (`broker.policies` logger) when the
  policy is set; keys the version does not recognise are refused, as RabbitMQ refuses them.

Definitions are checked as RabbitMQ checks them (rabbit_policy:policy_validation, rabbit_policies:
validate_policy0) and refused with `PolicyError`, whose text is what rabbitmqctl prints after "Validation
failed". Regular expression errors carry Python's message, not PCRE's.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field

from . import arguments
from .arguments import CLASSIC, QUORUM, STREAM, is_int

log = logging.getLogger("broker.policies")

POLICY, OPERATOR_POLICY = "policy", "operator_policy"
APPLY_TO_TYPE = {"classic_queues": CLASSIC, "quorum_queues": QUORUM, "streams": STREAM}
MAX_STREAM_MAX_SEGMENT_SIZE = 3_000_000_000

# The keys the broker acts on; every other key a version recognises is accepted and logged as not supported.
IMPLEMENTED = frozenset("""alternate-exchange dead-letter-exchange dead-letter-routing-key dead-letter-strategy
    message-ttl expires max-length max-length-bytes overflow delivery-limit max-age stream-max-segment-size-bytes
    queue-leader-locator consumer-timeout""".split())

# How each queue type resolves a key set both by the policy and by an x-argument (rabbit_amqqueue_process:
# process_args_policy, rabbit_quorum_queue:gather_policy_config / dead_letter_handler, rabbit_stream_queue:
# update_stream_conf): "min" the lower, "arg" the argument, "policy" the policy. A key missing here does not
# act on that type.
RESOLVE = {
    CLASSIC: {"expires": "min", "dead-letter-exchange": "arg", "dead-letter-routing-key": "arg",
              "message-ttl": "min", "max-length": "min", "max-length-bytes": "min", "overflow": "arg"},
    QUORUM: {"max-length": "min", "max-length-bytes": "min", "overflow": "policy", "expires": "min",
             "message-ttl": "min", "dead-letter-exchange": "arg", "dead-letter-routing-key": "arg",
             "dead-letter-strategy": "arg", "delivery-limit": "delivery-limit", "consumer-timeout": "min"},
    STREAM: {"max-length-bytes": "policy", "max-age": "policy", "stream-max-segment-size-bytes": "policy"},
}


class PolicyError(ValueError):
    """A policy RabbitMQ would refuse; the text is RabbitMQ's."""


def erl(value) -> str:
    """A JSON value as Erlang's ~tp prints the term RabbitMQ decodes it to."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    if isinstance(value, str):
        return '<<"' + value.replace("\\", "\\\\").replace('"', '\\"') + '">>'
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(erl(v) for v in value) + "]"
    if isinstance(value, dict):
        return "#{" + ",".join(f"{erl(k)} => {erl(v)}" for k, v in sorted(value.items())) + "}"
    return repr(value)


def _nonneg(text):
    return lambda v, b: None if is_int(v) and v >= 0 else text


def _positive(text):
    return lambda v, b: None if is_int(v) and v >= 1 else text


def _string(text):
    return lambda v, b: None if isinstance(v, str) else text


def _one_of(choices, text):
    return lambda v, b: None if v in choices and isinstance(v, str) else text


def _delivery_limit(v, b):
    ok = is_int(v) and (v >= 0 or b.policy_negative_delivery_limit)
    return None if ok else "~ is not a valid delivery limit"


def _max_age(v, b):
    ok = isinstance(v, str) and arguments._AGE.match(v).group(1) \
        and arguments.parse_max_age(v, True) is not None
    return None if ok else "~ is not a valid max age"


def _segment_size(v, b):
    return None if is_int(v) and 0 <= v <= MAX_STREAM_MAX_SEGMENT_SIZE else "~ is not a valid segment size"


# rabbit_policies:validate_policy0 (and the quorum queue's): None, or the text with ~ for the value.
VALIDATORS = {
    "alternate-exchange": _string("~ is not a valid alternate exchange name"),
    "consumer-disconnected-timeout": _nonneg("~ is not a valid consumer disconnected timeout"),
    "consumer-timeout": _nonneg("~ is not a valid consumer timeout"),
    "dead-letter-exchange": _string("~ is not a valid dead letter exchange name"),
    "dead-letter-routing-key": _string("~ is not a valid dead letter routing key"),
    "dead-letter-strategy": _one_of(("at-most-once", "at-least-once"), "~ is not a valid dead letter strategy"),
    "message-ttl": _nonneg("~ is not a valid message TTL"),
    "expires": _positive("~ is not a valid queue expiry"),
    "max-length": _nonneg("~ is not a valid maximum length"),
    "max-length-bytes": _nonneg("~ is not a valid maximum length in bytes"),
    "max-in-memory-length": _nonneg("~ is not a valid maximum memory in bytes"),
    "max-in-memory-bytes": _nonneg("~ is not a valid maximum memory in bytes"),
    "queue-mode": _one_of(("default", "lazy"), "~ is not a valid queue-mode value"),
    "queue-version": lambda v, b: None if is_int(v) and v in (1, 2) else "~ is not a valid queue-version value",
    "overflow": _one_of(arguments.OVERFLOW_MODES, "~ is not a valid overflow value"),
    "delivery-limit": _delivery_limit,
    "max-age": _max_age,
    "queue-leader-locator": _one_of(("client-local", "balanced", "random", "least-leaders"),
                                    "~ is not a valid queue leader locator value"),
    "initial-cluster-size": _nonneg("~ is not a valid cluster size"),
    "stream-max-segment-size-bytes": _segment_size,
    "stream-filter-size-bytes": lambda v, b: None if is_int(v) and 16 <= v <= 255 else
    "~ is not a valid filter size. Valid range is 16-255",
    "target-group-size": lambda v, b: None if is_int(v) and v > 0 else "~ is not a valid qq target count value",
}


@dataclass(frozen=True)
class Policy:
    kind: str                 # POLICY or OPERATOR_POLICY
    vhost: str
    name: str
    pattern: str
    apply_to: str
    priority: int | float
    definition: dict
    regex: re.Pattern = field(compare=False, repr=False)

    def as_definition(self) -> dict:
        """The entry as export_definitions writes it."""
        return {"vhost": self.vhost, "name": self.name, "pattern": self.pattern, "apply-to": self.apply_to,
                "definition": dict(self.definition), "priority": self.priority}


def validate(kind: str, vhost: str, name: str, pattern, definition, priority=0, apply_to="all", *,
             behaviour) -> Policy:
    """A checked Policy, or PolicyError with RabbitMQ's text (priority, pattern, apply-to, then the
    definition's keys in sorted order, then the keys the version does not recognise)."""
    if priority is None:
        priority = 0
    if apply_to is None:
        apply_to = "all"
    if isinstance(priority, bool) or not isinstance(priority, (int, float)):
        raise PolicyError(f"priority should be a number, actually was {erl(priority)}")
    if not isinstance(pattern, str):
        raise PolicyError(f"pattern should be a binary but was {erl(pattern)}")
    try:
        regex = re.compile(pattern)
    except re.error as exc:
        raise PolicyError(f'pattern should be regular expression but is invalid: {{"{exc.msg}",{exc.pos}}}') \
            from None
    if apply_to not in behaviour.policy_apply_to:
        raise PolicyError(behaviour.policy_apply_to_text.format(apply_to))
    if not isinstance(definition, dict):
        raise PolicyError(f"definition must be a dictionary: {erl(definition)}")
    if not definition:
        raise PolicyError("no policy provided")
    known = behaviour.operator_policy_keys if kind == OPERATOR_POLICY else behaviour.policy_keys
    for key in sorted(definition):
        check = VALIDATORS.get(key)
        if key in known and check is not None:
            reason = check(definition[key], behaviour)
            if reason:
                raise PolicyError(reason.replace("~", erl(definition[key]), 1))
    unknown = [(k, definition[k]) for k in sorted(definition) if k not in known]
    if unknown:
        terms = ",".join(f"{{{erl(k)},{erl(v)}}}" for k, v in unknown)
        raise PolicyError(f"[{terms}] are not recognised policy settings")
    return Policy(kind, vhost, name, pattern, apply_to, priority, dict(definition), regex)


def not_supported(policy: Policy) -> list[str]:
    """The policy's keys this broker accepts but does not act on."""
    return sorted(k for k in policy.definition if k not in IMPLEMENTED)


def merge(policy: Policy | None, op: Policy | None, behaviour) -> dict:
    """rabbit_policy:merge_operator_definitions: the effective definition of the two."""
    if op is None:
        return dict(policy.definition) if policy is not None else {}
    if policy is None:
        return dict(op.definition)
    merged = dict(policy.definition)
    for key, op_value in op.definition.items():
        value = merged.get(key)
        if value is None:
            merged[key] = op_value
        elif key in behaviour.operator_policy_wins or (isinstance(value, bool) and isinstance(op_value, bool)):
            merged[key] = op_value
        elif key == "delivery-limit" and behaviour.policy_negative_delivery_limit and (value < 0 or op_value < 0):
            merged[key] = max(value, op_value)
        elif is_int(value) and is_int(op_value):
            merged[key] = min(value, op_value)
    return merged


def effective(args: dict, definition: dict, qtype: str, behaviour) -> dict:
    """The x-arguments a queue of type `qtype` acts on: its own `args` with each key of the effective policy
    `definition` resolved as RESOLVE says (keys the type does not act on stay out)."""
    if not definition:
        return args
    out = dict(args)
    for key, how in RESOLVE[qtype].items():
        p = definition.get(key)
        if p is None:
            continue
        if key == "expires" and qtype == QUORUM and behaviour.quorum_expires_policy_wins:
            how = "policy"
        name = "x-" + key
        a = args.get(name)
        if a is None or how == "policy" or (how != "arg" and not is_int(a)):
            out[name] = p
        elif how == "min" or (how == "delivery-limit" and not behaviour.policy_negative_delivery_limit):
            out[name] = min(p, a)
        elif how == "delivery-limit":
            out[name] = max(p, a) if p < 0 or a < 0 else min(p, a)
    return out


class Policies:
    """Every vhost's policies and operator policies (RabbitMQ's runtime parameters of those components)."""

    def __init__(self, behaviour):
        self.behaviour = behaviour
        self.by_kind: dict[str, dict[tuple, Policy]] = {POLICY: {}, OPERATOR_POLICY: {}}

    def set(self, policy: Policy) -> None:
        unsupported = not_supported(policy)
        if unsupported:
            what = "operator policy" if policy.kind == OPERATOR_POLICY else "policy"
            log.warning("%s '%s' in vhost '%s': %s not supported by the embedded broker (accepted, not acted "
                        "on)", what, policy.name, policy.vhost, ", ".join(f"'{k}'" for k in unsupported))
        self.by_kind[policy.kind][(policy.vhost, policy.name)] = policy

    def clear(self, kind: str, vhost: str, name: str) -> Policy | None:
        return self.by_kind[kind].pop((vhost, name), None)

    def list(self, kind: str, vhost: str | None = None) -> list[Policy]:
        return [p for (v, _n), p in sorted(self.by_kind[kind].items()) if vhost is None or v == vhost]

    def any_in(self, vhost: str) -> bool:
        return any(v == vhost for kind in self.by_kind.values() for v, _n in kind)

    def _match(self, kind: str, vhost: str, name: str, qtype: str | None) -> Policy | None:
        best = None
        unsupported = self.behaviour.policy_unsupported
        for (v, _n), p in sorted(self.by_kind[kind].items()):
            if v != vhost:
                continue
            if qtype is None:
                if p.apply_to not in ("exchanges", "all"):
                    continue
            else:
                if p.apply_to == "exchanges" or (p.apply_to in APPLY_TO_TYPE and APPLY_TO_TYPE[p.apply_to] != qtype):
                    continue
                if any(k in unsupported[qtype] for k in p.definition):
                    continue
            if not p.regex.search(name):
                continue
            if best is None or p.priority > best.priority:
                best = p
        return best

    def for_queue(self, vhost: str, name: str, qtype: str) -> tuple[Policy | None, Policy | None]:
        return self._match(POLICY, vhost, name, qtype), self._match(OPERATOR_POLICY, vhost, name, qtype)

    def for_exchange(self, vhost: str, name: str) -> tuple[Policy | None, Policy | None]:
        return self._match(POLICY, vhost, name, None), self._match(OPERATOR_POLICY, vhost, name, None)

    def queue_definition(self, vhost: str, name: str, qtype: str) -> dict:
        return merge(*self.for_queue(vhost, name, qtype), self.behaviour)

    def exchange_definition(self, vhost: str, name: str) -> dict:
        return merge(*self.for_exchange(vhost, name), self.behaviour)
