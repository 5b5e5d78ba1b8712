"""A small blocking AMQP 0-9-1 client on pamqp, for the connector's source (driver) and sink (executors).

    from spark_amqp.client import Connection

    with Connection.open("amqp://guest:guest@localhost:5672/%2F") as conn:
        ch = conn.channel()
        ch.confirm_select(window=1000)
        ch.publish("", "events", b"hello", {"content_type": "text/plain"})
        ch.wait_for_confirms(timeout=30)

        ch.basic_qos(prefetch_count=1000)
        ch.basic_consume("events")
        for d in ch.get_deliveries(max_count=500, timeout=1.0):
            ...
        ch.basic_ack(d.delivery_tag, multiple=True)

Modules: `uri` (amqp:// URIs, `redact`), `errors` (the exception hierarchy), `events` (frames from the
broker into `Delivery`, `Returned`, `Confirm` and methods, on the shared codec `spark_amqp.codec`),
`connection` (socket, handshake, reader thread, heartbeats), `channel` (RPCs, deliveries, publishing with
confirms).
"""

from .channel import Channel, QueueInfo
from .connection import Connection
from .errors import (AMQPError, AMQPTimeoutError, AuthenticationError, ChannelClosedError, ConnectError,
                     ConnectionClosedError, ConnectionLostError, ConsumerCancelledError, ProtocolError,
                     PublishNackedError, UnroutableError)
from ..codec.properties import encode as encode_properties
from .events import Delivery, Returned
from .uri import ConnectionParameters, parse_uri, redact

__all__ = [
    "AMQPError", "AMQPTimeoutError", "AuthenticationError", "Channel", "ChannelClosedError", "ConnectError",
    "Connection", "ConnectionClosedError", "ConnectionLostError", "ConnectionParameters",
    "ConsumerCancelledError", "Delivery", "ProtocolError", "PublishNackedError", "QueueInfo", "Returned",
    "UnroutableError", "encode_properties", "parse_uri", "redact",
]
