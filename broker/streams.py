"""`python -m spark_amqp_broker.streams`: RabbitMQ's `rabbitmq-streams add_super_stream` and
`delete_super_stream`, as an AMQP 0-9-1 client.

    python -m spark_amqp_broker.streams add_super_stream invoices --partitions 3 [--url amqp://...]
    python -m spark_amqp_broker.streams add_super_stream orders --binding-keys eu,us,ap
    python -m spark_amqp_broker.streams delete_super_stream invoices

Why a client: the broker runs as a server process of its own (`amqp-broker`), and a super stream is nothing
but an exchange, streams and bindings that any client may declare. So this command declares exactly what
RabbitMQ 4.3's stream manager declares (super_streams.plan), over AMQP, with the package's own client. The
same command therefore also makes a super stream on a real RabbitMQ, identical to one made by
`rabbitmq-streams` there. In-process, `Broker.add_super_stream` does the same without a connection.

What AMQP cannot do: list bindings. `delete_super_stream` therefore finds the partitions by their names:
the `--partitions` or `--binding-keys` given, else NAME-0, NAME-1, ... while they exist. RabbitMQ's
command reads them from the exchange's bindings instead.

Exit status: 0, 64 for a usage error, 70 when the broker refuses (RabbitMQ's CLI's EX_SOFTWARE), 69 when it
cannot be reached.
"""

from __future__ import annotations

import argparse
import re
import sys

from spark_amqp.client import Connection
from spark_amqp.client.errors import AMQPError, ChannelClosedError, ConnectError

from . import super_streams
from .super_streams import SuperStreamError

DEFAULT_URL = "amqp://guest:guest@127.0.0.1:5672/%2F"
EX_USAGE, EX_UNAVAILABLE, EX_SOFTWARE = 64, 69, 70
NOT_FOUND = 404

# rabbit_resource_monitor_misc:parse_information_unit: decimal units (k, M, G, T, P, with or without B) and
# binary ones (Ki, Mi, ..., with or without B), as Kubernetes reads them.
_UNIT = re.compile(r"^([0-9]+)([kKmMgGtTpP])?([iI])?[bB]?$")
_ISO_DURATION = re.compile(r"^P(?:(\d+)Y)?(?:(\d+)M)?(?:(\d+)D)?(?:T(?:(\d+)H)?(?:(\d+)M)?(?:(\d+)S)?)?$")


def information_unit(value: str) -> int:
    m = _UNIT.match(value)
    if not m:
        raise ValueError(value)
    power = "kmgtp".index(m.group(2).lower()) + 1 if m.group(2) else 0
    return int(m.group(1)) * (1024 if m.group(3) else 1000) ** power


def duration_seconds(value: str) -> int:
    """An ISO 8601 duration in seconds, as the CLI converts --max-age (a month is 30 days, a year 365)."""
    m = _ISO_DURATION.match(value)
    if not m or value in ("P", "PT") or value.endswith("T"):
        raise ValueError(value)
    y, mo, d, h, mi, s = (int(g or 0) for g in m.groups())
    return ((y * 365 + mo * 30 + d) * 24 + h) * 3600 + mi * 60 + s


def stream_arguments(args: argparse.Namespace) -> dict:
    """The partition streams' arguments from the CLI's options, as rabbit_stream_manager makes them."""
    out = {}
    if args.max_length_bytes is not None:
        out["x-max-length-bytes"] = _checked(information_unit, args.max_length_bytes,
                                             "Invalid value for --max-length-bytes, valid example values: 100gb, 50mb")
    if args.max_age is not None:
        out["x-max-age"] = f"{_checked(duration_seconds, args.max_age, 'Invalid value for --max-age, the value must a ISO 8601 duration, e.g. e.g. PT10M30S for 10 minutes 30 seconds, P5DT8H for 5 days 8 hours.')}s"
    if args.stream_max_segment_size_bytes is not None:
        out["x-stream-max-segment-size-bytes"] = _checked(
            information_unit, args.stream_max_segment_size_bytes,
            "Invalid value for --stream-max-segment-size-bytes, valid example values: 100gb, 50mb")
    if args.initial_cluster_size is not None:
        if args.initial_cluster_size <= 0:
            raise SuperStreamError("Invalid value for --initial-cluster-size, the value must be positive.")
        out["x-initial-cluster-size"] = args.initial_cluster_size
    if args.leader_locator is not None:
        if args.leader_locator not in ("client-local", "balanced", "random", "least-leaders"):
            raise SuperStreamError("Invalid value for --leader-locator, valid values are client-local, balanced.")
        out["x-queue-leader-locator"] = args.leader_locator
    return out


def _checked(parse, value, text):
    try:
        return parse(value)
    except ValueError:
        raise SuperStreamError(text) from None


class _Client:
    """One connection; a channel per call, since a refusal (404 of a passive declare) closes it."""

    def __init__(self, url: str):
        self.conn = Connection.open(url)

    def exists(self, kind: str, name: str) -> bool:
        with self.conn.channel() as ch:
            try:
                if kind == "exchange":
                    ch.exchange_declare(name, passive=True)
                else:
                    ch.queue_declare(name, passive=True)
            except ChannelClosedError as exc:
                if exc.reply_code == NOT_FOUND:
                    return False
                raise
        return True

    def close(self) -> None:
        self.conn.close()


def add_super_stream(url: str, ss: super_streams.SuperStream) -> None:
    """Declare `ss` as rabbit_stream_manager:create_super_stream does: refused when the exchange or a stream
    exists; the exchange, the streams, the bindings; what was declared is deleted again on a refusal."""
    client = _Client(url)
    try:
        if client.exists("exchange", ss.name):
            raise SuperStreamError(f"there is already an exchange named {ss.name}")
        for stream in ss.partitions:
            if client.exists("queue", stream):
                raise SuperStreamError(f"there is already a queue named {stream}")
        ch = client.conn.channel()
        ch.exchange_declare(ss.name, ss.exchange_type, durable=True, arguments=dict(ss.exchange_arguments))
        declared = []
        try:
            for stream in ss.partitions:
                ch.queue_declare(stream, durable=True, arguments=dict(ss.stream_arguments))
                declared.append(stream)
            for stream, key, args in ss.bindings():
                ch.queue_bind(stream, ss.name, key, args)
        except ChannelClosedError as exc:
            undo = client.conn.channel()
            for stream in declared:
                undo.queue_delete(stream)
            undo.exchange_delete(ss.name)
            raise SuperStreamError(exc.reply_text) from None
        ch.close()
    finally:
        client.close()


def delete_super_stream(url: str, name: str, partitions: list | None) -> None:
    """Delete the exchange `name`, then its partition streams: those named, or NAME-0, NAME-1, ... while they
    exist. SuperStreamError("stream_not_found") when there is no such exchange, as RabbitMQ's CLI."""
    client = _Client(url)
    try:
        if not client.exists("exchange", name):
            raise SuperStreamError("stream_not_found")
        if partitions is None:
            partitions = []
            while client.exists("queue", f"{name}-{len(partitions)}"):
                partitions.append(f"{name}-{len(partitions)}")
        with client.conn.channel() as ch:
            ch.exchange_delete(name)
        for stream in partitions:
            if client.exists("queue", stream):
                with client.conn.channel() as ch:
                    ch.queue_delete(stream)
    finally:
        client.close()


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m spark_amqp_broker.streams",
                                description="Super streams as `rabbitmq-streams` makes them, over AMQP 0-9-1.")
    p.add_argument("--url", default=DEFAULT_URL, help=f"the broker (default {DEFAULT_URL}); its vhost is the URL's")
    sub = p.add_subparsers(dest="command", required=True)
    add = sub.add_parser("add_super_stream", help="add a super stream")
    add.add_argument("name")
    add.add_argument("--partitions", type=int, default=None, help="number of partitions (default 3)")
    add.add_argument("--binding-keys", default=None, help="comma-separated binding keys, one partition each")
    add.add_argument("--max-length-bytes", default=None, help="partition size limit, e.g. 20gb, 500mb")
    add.add_argument("--max-age", default=None, help="segment age limit, ISO 8601, e.g. PT10M30S, P5DT8H")
    add.add_argument("--stream-max-segment-size-bytes", default=None, help="segment size, e.g. 500mb")
    add.add_argument("--leader-locator", default=None, help="client-local, balanced (default), ...")
    add.add_argument("--initial-cluster-size", type=int, default=None)
    delete = sub.add_parser("delete_super_stream", help="delete a super stream")
    delete.add_argument("name")
    delete.add_argument("--partitions", type=int, default=None,
                        help="its streams are NAME-0 .. NAME-(N-1) (default: NAME-0, NAME-1, ... while they exist)")
    delete.add_argument("--binding-keys", default=None, help="its streams are NAME-<key> for these keys")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        if args.command == "add_super_stream":
            ss = super_streams.plan(args.name, args.partitions, args.binding_keys, stream_arguments(args))
        elif args.partitions is not None or args.binding_keys is not None:
            names = list(super_streams.plan(args.name, args.partitions, args.binding_keys).partitions)
        else:
            names = None
    except SuperStreamError as exc:      # what RabbitMQ's CLI refuses before it calls the node
        print(f"Error: {exc}", file=sys.stderr)
        return EX_USAGE
    try:
        if args.command == "add_super_stream":
            print("Adding a super stream...")
            add_super_stream(args.url, ss)
            print(f"Super stream {args.name} has been created")
        else:
            print("Deleting a super stream...")
            delete_super_stream(args.url, args.name, names)
            print(f"Super stream {args.name} has been deleted")
    except (ConnectError, OSError) as exc:
        print(f"Error: cannot reach the broker at {args.url.split('@')[-1]}: {exc}", file=sys.stderr)
        return EX_UNAVAILABLE
    except (SuperStreamError, AMQPError) as exc:
        print(f"Error:\n{exc}", file=sys.stderr)
        return EX_SOFTWARE
    return 0

if __name__ == "__main__":
    sys.exit(main())
