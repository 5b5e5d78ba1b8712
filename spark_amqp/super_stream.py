"""Super streams (RabbitMQ 3.11+): one partitioned stream made of partition streams.

`rabbitmq-streams add_super_stream NAME --partitions N` makes a direct exchange NAME (`x-super-stream:
true`) bound to the streams `NAME-0` .. `NAME-<N-1>` with the keys "0" .. "N-1" and the binding argument
`x-stream-partition-order`; `--binding-keys eu,us` makes `NAME-eu`, `NAME-us` instead. AMQP 0-9-1 cannot
list an exchange's bindings, so the partitions are found by that naming convention (passive declares of
`NAME-0`, `NAME-1`, ... up to the first missing one) or given by the option `superStreamPartitions`.

The partition a message goes to is chosen as RabbitMQ's stream clients (Java, Go, .NET) choose it by
default: MurmurHash3 x86 32-bit of the routing key's UTF-8 bytes, seed 104729, as an unsigned integer,
modulo the partition count, over the partitions in `x-stream-partition-order`. So a stream consumer of a
partition sees exactly the messages a Java producer would have sent there.

Runs on the driver (finding partitions: the source at every trigger) and on executors (the sink: each task
finds the partitions on its own connection when it opens it, then routes its rows with `partition_streams`;
so a partition added between two micro-batches is used from the next one).

A row published with the header `x-stream-filter-value` (`FILTER_VALUE_HEADER`, RabbitMQ 3.13+) carries a
stream filter value: the broker records the values of each chunk, and a consumer with `x-stream-filter`
skips the chunks that hold none of its values.
"""

from __future__ import annotations

import mmh3

from .client import ChannelClosedError
from .client.uri import redact

# The seed of RabbitMQ's stream clients' HashRoutingMurmurStrategy.
HASH_SEED = 104729
# The header a message's stream filter value travels in (AMQP 0-9-1 publishers; RabbitMQ 3.13+).
FILTER_VALUE_HEADER = "x-stream-filter-value"


def partition_index(routing_key: str, partitions: int) -> int:
    """The index (in partition order) of the partition a message with `routing_key` goes to."""
    return mmh3.hash(routing_key.encode("utf-8"), HASH_SEED, signed=False) % partitions


def partition_streams(routing_keys: list, partitions: list[str]) -> list[str]:
    """Executor (the sink): the partition stream of each routing key (none may be None), hashing each
    distinct key once."""
    n = len(partitions)
    chosen: dict[str, str] = {}
    out = []
    for key in routing_keys:
        stream = chosen.get(key)
        if stream is None:
            stream = chosen[key] = partitions[partition_index(key, n)]
        out.append(stream)
    return out


class SuperStreamNotFound(RuntimeError):
    """The super stream's first partition (or a listed one) does not exist."""


def stream_exists(conn, stream: str) -> bool:
    """A passive declare of `stream` on a channel of its own (a 404 closes it)."""
    ch = conn.channel()
    try:
        ch.queue_declare(stream, passive=True)
    except ChannelClosedError as exc:
        if exc.reply_code == 404:
            return False
        raise
    ch.close()
    return True


def find_partitions(conn, options) -> list[str]:
    """Driver (the source) or executor (a sink task, on its publishing connection). The partition streams
    of options['superStream'] in partition order: those listed in `superStreamPartitions` (each must
    exist), else `NAME-0`, `NAME-1`, ... up to the first missing one.
    Raises SuperStreamNotFound naming the super stream, the broker and what to check."""
    name = options["superStream"]
    listed = options.get("superStreamPartitions")
    if listed:
        missing = [s for s in listed if not stream_exists(conn, s)]
        if missing:
            raise SuperStreamNotFound(
                f"super stream '{name}': partition stream(s) {', '.join(missing)} listed in "
                f"superStreamPartitions not found on {redact(options['uri'])}")
        return list(listed)
    found = []
    while stream_exists(conn, f"{name}-{len(found)}"):
        found.append(f"{name}-{len(found)}")
    if not found:
        raise SuperStreamNotFound(
            f"super stream '{name}' not found on {redact(options['uri'])}: no stream '{name}-0'. Create it "
            f"with `rabbitmq-streams add_super_stream {name} --partitions N`; if its partitions have other "
            "names (--binding-keys), list them in the option superStreamPartitions")
    return found
