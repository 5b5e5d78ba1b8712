"""A message as a queue holds it.

One `Message` per queue it sits in: routing to several queues copies this small object, never the header
or body bytes, so per-queue state (redelivered, expiry, sequence) lives on it without a second object
per entry. `header` is the content header payload exactly as the publisher sent it; `body` the joined
body frames. With 1,000,000 queued 100-byte messages this object is most of the broker's memory, hence
__slots__ and nothing optional.
"""

from __future__ import annotations

from spark_amqp.codec import properties

# How a delivery was settled, as RabbitMQ's channel tells the queue (rabbit_channel, rabbit_queue_type:settle):
ACK = "ack"            # basic.ack
RETURN = "return"      # basic.nack(requeue=true), basic.recover: back to the queue
REJECT = "reject"      # basic.reject(requeue=true): back to the queue, the delivery failed
DOWN = "down"          # the channel closed or the connection went with the delivery unacked: back, failed
DROP = "drop"          # basic.nack(requeue=false): removed, dead-lettered as rejected
DISCARD = "discard"    # basic.reject(requeue=false): removed, dead-lettered as rejected, the delivery failed
TIMEOUT = "timeout"    # 4.x: a quorum queue took the delivery back at its consumer timeout: back, not failed
RETURNED = frozenset((RETURN, REJECT, DOWN, TIMEOUT))
FAILED = frozenset((REJECT, DOWN, DISCARD))     # what 4.x counts in a message's delivery count

# Properties the broker itself acts on; a header whose flags carry none of them is not parsed.
BROKER_READS = (properties.FLAG["headers"] | properties.FLAG["priority"] | properties.FLAG["expiration"]
                | properties.FLAG["user_id"])


class Message:
    __slots__ = ("exchange", "routing_key", "header", "body", "seq", "redelivered", "expires_at",
                 "priority", "ttl", "pid", "delivery_count", "acquired_count")

    def __init__(self, exchange: str, routing_key: str, header: bytes, body: bytes):
        self.exchange = exchange
        self.routing_key = routing_key
        self.header = header
        self.body = body
        self.seq = 0              # position in its queue's arrival order (requeue restores it)
        self.redelivered = False
        self.expires_at = None    # monotonic ms after which the queue drops it, or None
        self.priority = 0
        self.ttl = None           # per-message TTL from the expiration property, ms, or None
        self.pid = 0              # its record in the data_dir journal (store.py), 0 = not journaled
        # Failed deliveries (versions.Behaviour.delivery_count_annotation: 4.x counts them in every queue
        # type and a dead letter carries the count along; quorum.py's delivery limit reads it).
        self.delivery_count = 0
        self.acquired_count = 0   # times a quorum queue took it back (x-acquired-count, 4.x)

    @property
    def size(self) -> int:
        return len(self.body)

    def copy(self) -> "Message":
        m = Message(self.exchange, self.routing_key, self.header, self.body)
        m.priority = self.priority
        m.ttl = self.ttl
        m.delivery_count = self.delivery_count
        return m

    def read_properties(self) -> dict:
        """The properties the broker acts on: priority, expiration (as ttl ms), headers, user_id.

        Returns {} for the common case of a header carrying none of them, without parsing anything.
        """
        if not properties.flags_of(self.header, 12) & BROKER_READS:
            return {}
        raw = properties.split(self.header[12:])
        out = {}
        if "priority" in raw:
            out["priority"] = properties.decode_octet(raw["priority"])
        if "expiration" in raw:
            out["expiration"] = properties.decode_shortstr(raw["expiration"])
        if "headers" in raw:
            out["headers_raw"] = raw["headers"]
        if "user_id" in raw:
            out["user_id"] = properties.decode_shortstr(raw["user_id"])
        return out
