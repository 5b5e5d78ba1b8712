"""What the broker sends, as the client's events: frames in, `Delivery`/`Returned`/`Confirm`/methods out.

Sans-I/O (`EventParser.feed(bytes)` returns the events those bytes complete, in wire order); the reader
thread of `connection.py` feeds it. Frames come from the codec's `FrameReader`, which hands over a
basic.deliver together with its header and body when all three are already buffered (the consume hot
path); content that arrives in pieces is assembled here per channel (spec 4.2.6: a content's frames are
contiguous on its channel but may interleave across channels).
"""

from __future__ import annotations

from pamqp import commands

from ..codec import methods, properties, replies
from ..codec.frames import (FRAME_BODY, FRAME_HEADER, FRAME_HEARTBEAT, FRAME_METHOD, WHOLE_CONTENT,
                            FrameReader, decode_content_header)
from .errors import ProtocolError

EMPTY_PROPERTIES = properties.EMPTY


class Delivery:
    """A message from basic.deliver or basic.get-ok (then `consumer_tag` is None, `message_count` set).

    `properties_raw` is the content header's property bytes exactly as the broker sent them;
    `properties` decodes them with pamqp on first access (most consumers never look at most properties).
    """

    __slots__ = ("channel", "consumer_tag", "delivery_tag", "redelivered", "exchange", "routing_key",
                 "message_count", "properties_raw", "body", "_properties")

    def __init__(self, channel, consumer_tag, delivery_tag, redelivered, exchange, routing_key,
                 message_count=None):
        self.channel = channel
        self.consumer_tag = consumer_tag
        self.delivery_tag = delivery_tag
        self.redelivered = redelivered
        self.exchange = exchange
        self.routing_key = routing_key
        self.message_count = message_count
        self.properties_raw = EMPTY_PROPERTIES
        self.body = b""
        self._properties = None

    @property
    def properties(self) -> commands.Basic.Properties:
        if self._properties is None:
            self._properties = properties.to_pamqp(self.properties_raw)
        return self._properties

    def __repr__(self) -> str:
        return (f"<{type(self).__name__} tag={self.delivery_tag} exchange={self.exchange!r} "
                f"routing_key={self.routing_key!r} redelivered={self.redelivered} "
                f"body={len(self.body)} bytes>")


class Returned(Delivery):
    """A mandatory message the broker could not route (basic.return), with its reply code and text."""

    __slots__ = ("reply_code", "reply_text")


class Confirm:
    """basic.ack / basic.nack from the broker in confirm mode (publisher confirms)."""

    __slots__ = ("channel", "delivery_tag", "multiple", "ack")

    def __init__(self, channel, delivery_tag, multiple, ack):
        self.channel = channel
        self.delivery_tag = delivery_tag
        self.multiple = multiple
        self.ack = ack


def _message(channel: int, payload: bytes) -> Delivery | None:
    """The message a content-bearing method starts, or None for any other method."""
    prefix = payload[:4]
    if prefix == methods.DELIVER:
        return Delivery(channel, *methods.decode_deliver(payload))
    if prefix == methods.GET_OK:
        tag, redelivered, exchange, routing_key, count = methods.decode_get_ok(payload)
        return Delivery(channel, None, tag, redelivered, exchange, routing_key, count)
    if prefix == methods.RETURN:
        code, text, exchange, routing_key = methods.decode_return(payload)
        msg = Returned(channel, None, None, False, exchange, routing_key)
        msg.reply_code = code
        msg.reply_text = text
        return msg
    return None


class _Content:
    __slots__ = ("message", "remaining", "chunks")

    def __init__(self, message):
        self.message = message
        self.remaining = -1  # -1 until the content header arrives
        self.chunks = None


class EventParser:
    """Sans-I/O: `feed(bytes)` returns the events those bytes complete, in wire order.

    Events are `Delivery` (deliver or get-ok with its content), `Returned`, `Confirm`, pamqp method
    objects as ``(channel, method)`` tuples, and `HEARTBEAT`. A frame the client cannot accept raises
    `ProtocolError`.
    """

    HEARTBEAT = "heartbeat"

    def __init__(self, frame_max: int = 131072):
        self._reader = FrameReader(frame_max, whole_content=frozenset((methods.DELIVER,)))
        self._content: dict[int, _Content] = {}

    @property
    def frame_max(self) -> int:
        return self._reader.frame_max

    @frame_max.setter
    def frame_max(self, value: int) -> None:
        self._reader.frame_max = value

    def feed(self, data: bytes) -> list:
        try:
            return self._feed(data)
        except replies.AMQPError as exc:
            raise ProtocolError(exc.text) from None

    def _feed(self, data: bytes) -> list:
        events: list = []
        append = events.append
        content = self._content
        decode_deliver = methods.decode_deliver
        self._reader.feed(data)
        for ftype, ch, payload in self._reader.frames():
            if ftype == WHOLE_CONTENT:
                if content and ch in content:
                    raise ProtocolError(f"new content on channel {ch} before the previous one completed")
                method, header, body = payload
                ctag, tag, redelivered, exchange, routing_key = decode_deliver(method)
                msg = Delivery(ch, ctag, tag, redelivered, exchange, routing_key)
                props = header[12:]
                msg.properties_raw = EMPTY_PROPERTIES if props == EMPTY_PROPERTIES else props
                msg.body = body
                append(msg)
            elif ftype == FRAME_METHOD:
                prefix = payload[:4]
                if prefix == methods.ACK or prefix == methods.NACK:
                    append(Confirm(ch, *methods.decode_ack(payload), prefix == methods.ACK))
                    continue
                if ch in content:
                    raise ProtocolError(f"method frame on channel {ch} while content was expected "
                                        "(spec 4.2.6)")
                msg = _message(ch, payload)
                if msg is not None:
                    content[ch] = _Content(msg)
                else:
                    append((ch, methods.unmarshal_method(payload)))
            elif ftype == FRAME_HEADER:
                pending = content.get(ch)
                if pending is None or pending.remaining != -1:
                    raise ProtocolError(f"unexpected content header on channel {ch}")
                body_size = decode_content_header(payload)[1]
                msg = pending.message
                msg.properties_raw = payload[12:]
                if body_size == 0:
                    del content[ch]
                    append(msg)
                else:
                    pending.remaining = body_size
            elif ftype == FRAME_BODY:
                pending = content.get(ch)
                if pending is None or pending.remaining <= 0:
                    raise ProtocolError(f"unexpected content body on channel {ch}")
                remaining = pending.remaining - len(payload)
                if remaining < 0:
                    raise ProtocolError(f"content body on channel {ch} exceeds its declared size")
                if remaining == 0 and pending.chunks is None:
                    pending.message.body = payload  # the common case: one body frame
                else:
                    if pending.chunks is None:
                        pending.chunks = []
                    pending.chunks.append(payload)
                    if remaining == 0:
                        pending.message.body = b"".join(pending.chunks)
                if remaining == 0:
                    del content[ch]
                    append(pending.message)
                else:
                    pending.remaining = remaining
            elif ftype == FRAME_HEARTBEAT:
                append(self.HEARTBEAT)
            else:
                raise ProtocolError(f"unknown frame type {ftype} (spec 4.2.3)")
        return events

    def forget_channel(self, ch: int) -> None:
        self._content.pop(ch, None)
