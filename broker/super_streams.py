"""Super streams: what RabbitMQ 4.3's `rabbitmq-streams add_super_stream` declares, and declaring it.

A super stream is no entity of its own: it is a durable direct exchange with the argument
`x-super-stream = true`, one stream per partition, and one binding per partition from the exchange to the
stream, keyed by the partition's binding key and carrying `x-stream-partition-order` (long) = the partition's
index (rabbit_stream_manager:create_super_stream). Publishing to the exchange with a binding key as routing key
appends to that partition. `plan()` computes exactly those declarations, so the embedded broker's API
(`apply`, run in the broker's own thread) and the command line (broker/streams.py, an AMQP client that also
works against RabbitMQ) make the same thing RabbitMQ makes:

- `--partitions N` (3 by default): streams NAME-0 .. NAME-(N-1), binding keys "0" .. "N-1";
- `--binding-keys eu,us`: streams NAME-eu, NAME-us, keyed eu, us (keys trimmed, empty ones dropped);
- every stream durable with `x-queue-type = stream` and `x-queue-leader-locator = balanced` unless another
  locator is given, plus the stream arguments given.

Refusals carry the texts of RabbitMQ's CLI and stream manager (`Specify --partitions or --binding-keys, not
both.`, `there is already an exchange named NAME`, `there is already a queue named NAME-0`); `delete` removes
the exchange, then the streams its bindings name, in partition order, as delete_super_stream does.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from spark_amqp.codec import replies

SUPER_STREAM_ARG = "x-super-stream"
PARTITION_ORDER_ARG = "x-stream-partition-order"
DEFAULT_PARTITIONS = 3


class SuperStreamError(ValueError):
    """A super stream RabbitMQ would refuse to create or delete, with its text."""


@dataclass(frozen=True)
class SuperStream:
    name: str
    partitions: tuple            # the partition streams' names, in partition order
    binding_keys: tuple          # the binding key of each partition
    stream_arguments: dict = field(default_factory=dict)   # every partition stream's declare arguments

    exchange_type = "direct"
    exchange_arguments = {SUPER_STREAM_ARG: True}

    def bindings(self) -> list:
        """(stream, binding key, binding arguments) in partition order."""
        return [(stream, key, {PARTITION_ORDER_ARG: order})
                for order, (stream, key) in enumerate(zip(self.partitions, self.binding_keys))]


def plan(name: str, partitions: int | None = None, binding_keys=None, arguments: dict | None = None) -> SuperStream:
    """The super stream `add_super_stream NAME [--partitions N | --binding-keys k1,k2]` makes. `binding_keys`
    is a list or a comma-separated string; `arguments` are extra x- arguments of the partition streams
    (`x-max-length-bytes`, `x-max-age`, `x-stream-max-segment-size-bytes`, `x-stream-filter-size-bytes`,
    `x-initial-cluster-size`, `x-queue-leader-locator`)."""
    if not name:
        raise SuperStreamError(f"{name!r} is not a correct name for a super stream")
    if partitions is not None and binding_keys is not None:
        raise SuperStreamError("Specify --partitions or --binding-keys, not both.")
    if binding_keys is None:
        n = DEFAULT_PARTITIONS if partitions is None else partitions
        if n < 1:
            raise SuperStreamError("The partition number must be greater than 0")
        keys = [str(i) for i in range(n)]
    else:
        if isinstance(binding_keys, str):
            binding_keys = binding_keys.split(",")
        keys = [k.strip() for k in binding_keys if k.strip()]
        if not keys:
            raise SuperStreamError("The partition number must be greater than 0")
    streams = [f"{name}-{k}" for k in keys]
    if len(set(streams)) != len(streams):
        raise SuperStreamError(f"Duplicate partition names found {''.join(streams)}")
    args = {"x-queue-type": "stream", "x-queue-leader-locator": "balanced", **(arguments or {})}
    return SuperStream(name, tuple(streams), tuple(keys), args)


# --- the embedded broker: declared in its own thread (Broker.add_super_stream) -------------------------------

def apply(vhost, ss: SuperStream) -> None:
    """Declare super stream `ss` in `vhost` (a VirtualHost) as rabbit_stream_manager does: refused when the
    exchange or one of the streams exists; the exchange, the streams, then the bindings; what was declared is
    removed again when a stream is refused (its arguments)."""
    if ss.name in vhost.exchanges:
        raise SuperStreamError(f"there is already an exchange named {ss.name}")
    for stream in ss.partitions:
        if stream in vhost.queues:
            raise SuperStreamError(f"there is already a queue named {stream}")
    vhost.declare_exchange(ss.name, ss.exchange_type, False, True, False, False, dict(ss.exchange_arguments))
    declared = []
    try:
        for stream in ss.partitions:
            declared.append(vhost.declare_queue(stream, False, True, False, False, dict(ss.stream_arguments), None))
        for stream, key, args in ss.bindings():
            vhost.bind_queue(vhost.queues[stream], ss.name, key, args)
    except replies.AMQPError as exc:
        for q in declared:
            vhost.delete_queue(q)
        vhost.delete_exchange(ss.name, False)
        raise SuperStreamError(exc.text) from None


def partitions(vhost, name: str) -> list:
    """The partition streams of super stream `name`: the streams its exchange is bound to, by their
    x-stream-partition-order (rabbit_stream_manager:super_stream_partitions)."""
    x = vhost.exchanges.get(name)
    if x is None:
        raise SuperStreamError("stream_not_found")
    bound = [(args.get(PARTITION_ORDER_ARG, -1), dest.name) for (dest, _key, _frozen), args in x.bindings.items()
             if getattr(dest, "is_stream", False)]
    return [n for _order, n in sorted(set(bound))]


def delete(vhost, name: str) -> None:
    """Delete super stream `name`: its exchange, then its partition streams (consumers get basic.cancel)."""
    streams = partitions(vhost, name)
    vhost.delete_exchange(name, False)
    for stream in streams:
        q = vhost.queues.get(stream)
        if q is not None:
            vhost.delete_queue(q)

