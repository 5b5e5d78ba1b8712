"""The RabbitMQ versions the broker behaves as, and every behaviour that differs between them: one table.

The broker behaves as RabbitMQ 4.3 by default; `rabbitmq_version = "3.10"` (TOML), `--rabbitmq-version
3.10` or `Broker(rabbitmq_version="3.10")` gives 3.10's behaviour where the two differ. Each field of
`Behaviour` is one such difference, measured against both reference nodes over AMQP 0-9-1 (pika); the
code that acts on it reads it from `BrokerCore.behaviour`, never compares version strings, so that a
third version is one more row here and no new branch anywhere else.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType


@dataclass(frozen=True)
class Behaviour:
    version: str
    # basic.qos(global=true): 3.10 limits the channel as a whole; 4.3 denies the deprecated feature and
    # treats it as a per-consumer limit for the consumers created afterwards.
    global_qos: bool
    # Largest message body accepted (406 above): rabbit's `max_message_size` default, unless configured.
    max_message_size: int
    # x-queue-version values a classic queue accepts (4.3 has only version 2; 3 is refused by both).
    queue_versions: tuple[int, ...]
    # x-queue-master-locator on a classic queue: 3.10 accepts it; 4.3 denies the deprecated feature by
    # closing the connection (541 INTERNAL_ERROR with the deprecation warning as its text).
    master_locator_allowed: bool
    # x-queue-leader-locator on a classic queue: 4.3 accepts it; 3.10 refuses it (406, "of queue type").
    classic_leader_locator: bool
    # The x-local-random exchange type exists (4.x).
    local_random_exchange: bool
    # Dead-lettered messages also carry x-last-death-exchange/-queue/-reason (4.x).
    last_death_headers: bool
    # A consumer of a stream may basic.nack / basic.reject / basic.recover (4.x: each settles the delivery,
    # giving its credit back, and nothing is redelivered); 3.10 closes the connection (540 for nack and
    # reject, 541 for recover).
    stream_settle: bool
    # A declare that names no x-queue-type is stored with x-queue-type=classic (4.x's augment_declare_args),
    # which shows in equivalence texts ("received 'classic' but current is 'quorum'"); an empty
    # x-queue-type means the default type. 3.10 stores what was sent and refuses an empty type.
    declare_names_queue_type: bool
    # The declare arguments RabbitMQ validates, in its order (rabbit_amqqueue:declare_args/0).
    declare_validators: tuple[str, ...]
    # The arguments each queue type takes (its `queue_arguments` capability): validated on declare,
    # compared on redeclare, in this order; another type's arguments are refused by name.
    queue_arguments: MappingProxyType
    # The consumer arguments each queue type takes (its `consumer_arguments` capability).
    consumer_arguments: MappingProxyType
    # x-max-age (and a stream offset interval) without digits: 4.x calls it invalid (406); 3.10 crashes
    # the channel (541).
    max_age_needs_digits: bool
    # The values x-queue-leader-locator takes (4.x adds min-masters, the old master locator's name).
    leader_locators: tuple[str, ...]
    # A headers exchange compares header and binding values exactly (4.x: 1 and 1.0 differ); 3.10 compares
    # numbers by value.
    headers_exact_match: bool
    # A message's headers table is delivered sorted by key, each key once (4.x); 3.10 passes it through.
    sorted_headers: bool
    # Dead letters routed to a stream are appended to it (4.x); 3.10 drops them.
    stream_dead_letters: bool
    # x-max-age is kept as its number of milliseconds (4.x: "60m" is equivalent to "1h", and equivalence
    # texts print the milliseconds); 3.10 keeps the text as sent.
    stream_max_age_in_ms: bool
    # Stream filtering (4.x, from RabbitMQ 3.13): a publish's x-stream-filter-value header goes into its
    # chunk's filter, x-stream-filter / x-stream-match-unfiltered on basic.consume skip chunks, and
    # x-stream-filter-size-bytes must be 16..255. 3.10 takes none of these names: it delivers everything.
    stream_filtering: bool
    # Refusal texts of basic.consume on a stream, formatted with {q} = "queue 'q' in vhost 'v'".
    stream_no_prefetch_text: str
    stream_no_ack_text: str
    # Queues count each message's failed deliveries (basic.reject, a channel closed with it unacked) and a
    # dead letter carries the count: the dead-letter queue delivers it as a redelivery, and a quorum queue
    # starts its delivery count from it (4.x). 3.10 carries nothing.
    delivery_count_annotation: bool
    # exchange.declare of an unknown type: 3.10 closes the connection (503 COMMAND_INVALID), 4.x the
    # channel (406 PRECONDITION_FAILED).
    unknown_exchange_type_closes_connection: bool
    # The smallest frame_max a client may negotiate (rabbit_framing FRAME_MIN_SIZE: 4096, 8192 on 4.x).
    frame_min_size: int
    # An unsupported protocol header is answered with AMQP 1.0's SASL header (4.x; an AMQP 0-9-x one still
    # gets 0-9-1's); 3.10 answers 0-9-1's to every one.
    refuse_with_amqp10_header: bool
    # A 403 on a resource names the permission refused: "configure access to queue 'q' in vhost 'v' refused
    # for user 'u'" (4.x); 3.10 says "access to queue ...".
    access_texts_name_permission: bool
    # A passive declare needs one of the permissions on the resource (4.x); 3.10 needs none.
    passive_declare_needs_a_permission: bool
    # Quorum queues. The delivery limit when none is given (4.x: 20; 3.10: unlimited), and whether a
    # negative one means unlimited (4.x) or that the first return exceeds it (3.10).
    quorum_default_delivery_limit: int | None
    quorum_negative_limit_unlimited: bool
    # 4.x counts every return in x-acquired-count (redelivered once above zero) and only failed deliveries
    # (basic.reject, a consumer gone) in x-delivery-count, which the delivery limit reads; 3.10 counts
    # every return in x-delivery-count.
    quorum_acquired_count: bool
    # 3.10 adds x-delivery-count to every basic.get delivery, 0 included.
    quorum_get_always_counts: bool
    # 3.10 without a delivery limit puts what nack, reject or recover return at the tail (4.x: the head).
    quorum_requeue_to_tail_without_limit: bool
    # 32 message priority levels (4.x); 3.10 quorum queues are FIFO.
    quorum_priorities: bool
    # Single active consumer: a waiting consumer of higher x-priority takes over (4.x).
    quorum_sac_priority: bool
    # How basic.get's refusal on a single-active-consumer queue names the type ('<<"quorum">>' on 4.x).
    quorum_sac_get_name: str
    # x-max-length-bytes counts the encoded properties too (4.x); 3.10 counts bodies.
    quorum_bytes_with_properties: bool
    # Messages a quorum queue drops at once when a policy lowers its limit are dead-lettered newest first
    # (3.10's rabbit_fifo update_config); 4.x dead-letters them oldest first.
    quorum_drops_newest_first: bool = False
    # Policies (policies.py). The keys a policy may set (each version's registered policy validators: 3.10
    # also has the ha-* keys of classic mirroring) and an operator policy may set; the `apply-to` values
    # (4.x adds one per queue type) and the text refusing another one.
    policy_keys: frozenset = frozenset()
    operator_policy_keys: frozenset = frozenset()
    policy_apply_to: tuple[str, ...] = ("all", "exchanges", "queues")
    policy_apply_to_text: str = ""
    # Keys an operator policy's value overrides the policy's with (4.x: overflow, queue-version); every
    # other numeric key merges as the lower value.
    operator_policy_wins: frozenset = frozenset()
    # The keys that make a policy not apply to a queue type at all (each type's `unsupported_policies`
    # capability): a policy holding one of them does not match that type's queues.
    policy_unsupported: MappingProxyType = None
    # A delivery-limit policy may be negative (4.x: no limit); 3.10 refuses it.
    policy_negative_delivery_limit: bool = True
    # A quorum queue's expires: 3.10 takes the policy's over the argument's (4.x: the lower of the two);
    # its delivery-limit: 3.10 the lower, 4.x the lower unless one is negative (then the higher).
    quorum_expires_policy_wins: bool = False
    # A vhost's default queue type (4.x): a declare without x-queue-type gets it when the type allows the
    # declare's properties, else classic. 3.10 has none.
    vhost_default_queue_type: bool = True
    # The consumer timeout (`consumer_timeout`). 3.10 (rabbit_channel:evaluate_consumer_timeout): at each
    # tick of a channel (`channel_tick_interval`) whose oldest unacked delivery, of any queue type and
    # basic.get's too, is older than the timeout the channel read when it opened, the channel is closed
    # (406), which returns its deliveries; queue and consumer arguments play no part. 4.x (rabbit_fifo's
    # evaluate_consumer_timeout): only quorum queue deliveries time out, each at its own deadline, from the
    # consumer argument x-consumer-timeout, else the lower of the queue argument and the policy's
    # consumer-timeout, else consumer_timeout; those that expire go back to the queue and the consumer is
    # sent basic.cancel (the channel is closed when the client cannot take one, and for basic.get).
    consumer_timeout_on_channel_tick: bool = False


def _table(**by_type) -> MappingProxyType:
    return MappingProxyType({k: tuple(v.split()) for k, v in by_type.items()})


_DECLARE_VALIDATORS_310 = tuple("""x-expires x-message-ttl x-dead-letter-exchange x-dead-letter-routing-key
    x-dead-letter-strategy x-max-length x-max-length-bytes x-max-in-memory-length x-max-in-memory-bytes
    x-max-priority x-overflow x-queue-mode x-queue-version x-single-active-consumer x-queue-type
    x-quorum-initial-group-size x-max-age x-stream-max-segment-size-bytes x-initial-cluster-size
    x-queue-leader-locator""".split())
_DECLARE_VALIDATORS_43 = tuple("""x-expires x-message-ttl x-dead-letter-exchange x-dead-letter-routing-key
    x-dead-letter-strategy x-max-length x-max-length-bytes x-max-in-memory-length x-max-in-memory-bytes
    x-max-priority x-overflow x-queue-version x-single-active-consumer x-consumer-timeout
    x-consumer-disconnected-timeout x-queue-type x-quorum-initial-group-size x-max-age
    x-stream-max-segment-size-bytes x-stream-filter-size-bytes x-initial-cluster-size
    x-queue-leader-locator""".split())
_QUEUE_ARGUMENTS_310 = _table(
    classic="""x-expires x-message-ttl x-dead-letter-exchange x-dead-letter-routing-key x-max-length
        x-max-length-bytes x-max-priority x-overflow x-queue-mode x-queue-version x-single-active-consumer
        x-queue-type x-queue-master-locator""",
    quorum="""x-dead-letter-exchange x-dead-letter-routing-key x-dead-letter-strategy x-expires x-max-length
        x-max-length-bytes x-max-in-memory-length x-max-in-memory-bytes x-overflow x-single-active-consumer
        x-queue-type x-quorum-initial-group-size x-delivery-limit x-message-ttl x-queue-leader-locator""",
    stream="""x-max-length-bytes x-queue-type x-max-age x-stream-max-segment-size-bytes x-initial-cluster-size
        x-queue-leader-locator""")
_QUEUE_ARGUMENTS_43 = _table(
    classic="""x-expires x-message-ttl x-dead-letter-exchange x-dead-letter-routing-key x-max-length
        x-max-length-bytes x-max-priority x-overflow x-queue-mode x-queue-version x-single-active-consumer
        x-queue-type x-queue-master-locator x-queue-leader-locator""",
    quorum="""x-dead-letter-exchange x-dead-letter-routing-key x-dead-letter-strategy x-expires x-max-length
        x-max-length-bytes x-max-in-memory-length x-max-in-memory-bytes x-overflow x-single-active-consumer
        x-queue-type x-quorum-initial-group-size x-delivery-limit x-message-ttl x-queue-leader-locator
        x-consumer-disconnected-timeout x-consumer-timeout x-delayed-retry-type x-delayed-retry-min
        x-delayed-retry-max""",
    stream="""x-max-length-bytes x-queue-type x-max-age x-stream-max-segment-size-bytes
        x-stream-filter-size-bytes x-initial-cluster-size x-queue-leader-locator""")
_CONSUMER_ARGUMENTS_310 = _table(classic="x-cancel-on-ha-failover x-priority x-credit",
                                 quorum="x-priority x-credit", stream="x-stream-offset x-credit")
_CONSUMER_ARGUMENTS_43 = _table(classic="x-priority", quorum="x-priority x-consumer-timeout",
                                stream="x-stream-offset x-stream-filter x-stream-match-unfiltered")

# rabbit_policies:register/0 (and rabbit_quorum_queue's, 3.10's rabbit_mirror_queue_misc's validators).
_POLICY_KEYS_310 = frozenset('''alternate-exchange dead-letter-exchange dead-letter-routing-key
    dead-letter-strategy message-ttl expires max-length max-length-bytes max-in-memory-length max-in-memory-bytes
    queue-mode queue-version overflow delivery-limit max-age stream-max-segment-size-bytes queue-leader-locator
    initial-cluster-size ha-mode ha-params ha-sync-mode ha-sync-batch-size ha-promote-on-shutdown
    ha-promote-on-failure'''.split())
_POLICY_KEYS_43 = frozenset('''alternate-exchange consumer-disconnected-timeout consumer-timeout
    dead-letter-exchange dead-letter-routing-key dead-letter-strategy message-ttl expires max-length
    max-length-bytes max-in-memory-length max-in-memory-bytes queue-mode queue-version overflow delivery-limit
    max-age stream-max-segment-size-bytes stream-filter-size-bytes queue-leader-locator initial-cluster-size
    target-group-size delayed-retry-type delayed-retry-min delayed-retry-max'''.split())
_OPERATOR_KEYS_310 = frozenset('''expires message-ttl max-length max-length-bytes max-in-memory-length
    max-in-memory-bytes delivery-limit'''.split())
_OPERATOR_KEYS_43 = _OPERATOR_KEYS_310 | {"queue-version", "overflow", "target-group-size",
                                          "delayed-retry-type", "delayed-retry-min", "delayed-retry-max"}
_UNSUPPORTED_310 = _table(
    classic="max-age stream-max-segment-size-bytes queue-leader-locator initial-cluster-size delivery-limit "
            "dead-letter-strategy",
    quorum="max-priority queue-mode single-active-consumer ha-mode ha-params ha-sync-mode ha-promote-on-shutdown "
           "ha-promote-on-failure queue-master-locator max-age stream-max-segment-size-bytes initial-cluster-size",
    stream="expires message-ttl dead-letter-exchange dead-letter-routing-key max-length max-in-memory-length "
           "max-in-memory-bytes max-priority overflow queue-mode single-active-consumer delivery-limit ha-mode "
           "ha-params ha-sync-mode ha-promote-on-shutdown ha-promote-on-failure queue-master-locator "
           "dead-letter-strategy")
_UNSUPPORTED_43 = _table(
    classic="max-age stream-max-segment-size-bytes initial-cluster-size delivery-limit dead-letter-strategy "
            "max-in-memory-length max-in-memory-bytes target-group-size selector-fields selector-field-max-bytes",
    quorum="max-priority queue-mode ha-mode ha-params ha-sync-mode ha-promote-on-shutdown ha-promote-on-failure "
           "queue-master-locator max-age stream-max-segment-size-bytes initial-cluster-size selector-fields "
           "selector-field-max-bytes",
    stream="expires message-ttl dead-letter-exchange dead-letter-routing-key max-length max-in-memory-length "
           "max-in-memory-bytes max-priority overflow queue-mode delivery-limit ha-mode ha-params ha-sync-mode "
           "ha-promote-on-shutdown ha-promote-on-failure queue-master-locator dead-letter-strategy "
           "target-group-size selector-fields selector-field-max-bytes")


BEHAVIOURS = {
    "3.10": Behaviour(version="3.10", global_qos=True, max_message_size=128 * 2**20, queue_versions=(1, 2),
                      master_locator_allowed=True, classic_leader_locator=False, local_random_exchange=False,
                      last_death_headers=False, stream_settle=False, declare_names_queue_type=False,
                      declare_validators=_DECLARE_VALIDATORS_310, queue_arguments=_QUEUE_ARGUMENTS_310,
                      consumer_arguments=_CONSUMER_ARGUMENTS_310, max_age_needs_digits=False,
                      leader_locators=("client-local", "balanced", "random", "least-leaders"),
                      headers_exact_match=False, sorted_headers=False, stream_dead_letters=False,
                      stream_max_age_in_ms=False, stream_filtering=False,
                      stream_no_prefetch_text="consumer prefetch count is not set for '{q}'",
                      stream_no_ack_text="automatic acknowledgement not supported by stream queues {q}",
                      delivery_count_annotation=False, quorum_default_delivery_limit=None,
                      quorum_negative_limit_unlimited=False, quorum_acquired_count=False,
                      quorum_get_always_counts=True, quorum_requeue_to_tail_without_limit=True,
                      quorum_priorities=False, quorum_sac_priority=False, quorum_sac_get_name="quorum",
                      quorum_bytes_with_properties=False, unknown_exchange_type_closes_connection=True,
                      quorum_drops_newest_first=True, policy_keys=_POLICY_KEYS_310,
                      operator_policy_keys=_OPERATOR_KEYS_310, policy_apply_to=("all", "exchanges", "queues"),
                      policy_apply_to_text="apply-to '{}' unrecognised; should be 'queues', 'exchanges' or 'all'",
                      operator_policy_wins=frozenset(), policy_unsupported=_UNSUPPORTED_310,
                      policy_negative_delivery_limit=False, quorum_expires_policy_wins=True,
                      vhost_default_queue_type=False, consumer_timeout_on_channel_tick=True,
                      frame_min_size=4096, refuse_with_amqp10_header=False,
                      access_texts_name_permission=False, passive_declare_needs_a_permission=False),
    "4.3": Behaviour(version="4.3", global_qos=False, max_message_size=16 * 2**20, queue_versions=(2,),
                     master_locator_allowed=False, classic_leader_locator=True, local_random_exchange=True,
                     last_death_headers=True, stream_settle=True, declare_names_queue_type=True,
                     declare_validators=_DECLARE_VALIDATORS_43, queue_arguments=_QUEUE_ARGUMENTS_43,
                     consumer_arguments=_CONSUMER_ARGUMENTS_43, max_age_needs_digits=True,
                     leader_locators=("client-local", "balanced", "random", "least-leaders",
                                      "min-masters"),
                     headers_exact_match=True, sorted_headers=True, stream_dead_letters=True,
                     stream_max_age_in_ms=True, stream_filtering=True,
                     stream_no_prefetch_text="consumer prefetch count is not set for stream {q}",
                     stream_no_ack_text="automatic acknowledgement not supported by stream {q}",
                     delivery_count_annotation=True, quorum_default_delivery_limit=20,
                     quorum_negative_limit_unlimited=True, quorum_acquired_count=True,
                     quorum_get_always_counts=False, quorum_requeue_to_tail_without_limit=False,
                     quorum_priorities=True, quorum_sac_priority=True, quorum_sac_get_name='<<"quorum">>',
                     quorum_bytes_with_properties=True, unknown_exchange_type_closes_connection=False,
                     policy_keys=_POLICY_KEYS_43, operator_policy_keys=_OPERATOR_KEYS_43,
                     policy_apply_to=("all", "exchanges", "queues", "classic_queues", "quorum_queues", "streams"),
                     policy_apply_to_text="apply-to '{}' unrecognised; should be one of: 'queues', "
                                          "'classic_queues',  'quorum_queues', 'streams', 'exchanges', or 'all'",
                     operator_policy_wins=frozenset({"overflow", "queue-version"}),
                     policy_unsupported=_UNSUPPORTED_43,
                     frame_min_size=8192, refuse_with_amqp10_header=True,
                     access_texts_name_permission=True, passive_declare_needs_a_permission=True),
}
DEFAULT_VERSION = "4.3"


def behaviour(version: str | None) -> Behaviour:
    """The behaviour of RabbitMQ `version` ("3.10" or "4.3"; None: DEFAULT_VERSION). ValueError names the
    key and the versions there are."""
    key = DEFAULT_VERSION if version is None else str(version).strip()
    if key not in BEHAVIOURS:
        raise ValueError(f"rabbitmq_version must be one of {', '.join(sorted(BEHAVIOURS))}, got {version!r}")
    return BEHAVIOURS[key]
