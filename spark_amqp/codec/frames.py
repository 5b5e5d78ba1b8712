"""Frames (spec 4.2.3): splitting a byte stream into frames, and writing method and content frames.

A frame is `type:octet channel:short size:long payload frame-end:octet(0xCE)`. `FrameReader` knows nothing
of what frames mean; it enforces the two rules every frame obeys (a peer MUST NOT send a frame larger than
the negotiated frame_max; the frame-end octet must be 0xCE) and reports a breach as FRAME_ERROR (501).

Content (spec 4.2.6): a content-bearing method (basic.publish, basic.deliver, basic.get-ok, basic.return)
is followed on its channel by one header frame (class-id, weight 0, body-size, property bytes) and body
frames of at most frame_max - 8 octets each; an empty body has no body frame.
"""

from __future__ import annotations

import struct

from pamqp import frame as pamqp_frame

from . import replies

FRAME_METHOD = 1
FRAME_HEADER = 2
FRAME_BODY = 3
FRAME_HEARTBEAT = 8
FRAME_END = 0xCE
FRAME_END_BYTE = b"\xce"
FRAME_OVERHEAD = 8           # 7 bytes of frame header + the frame-end octet
PROTOCOL_HEADER = b"AMQP\x00\x00\x09\x01"

FRAME_HEAD = struct.Struct(">BHI")
CONTENT_HEAD = struct.Struct(">HHQ")        # class-id, weight, body-size
HEARTBEAT_FRAME = FRAME_HEAD.pack(FRAME_HEARTBEAT, 0, 0) + FRAME_END_BYTE
BASIC_CLASS = 60


class FrameReader:
    """Splits a byte stream into frames (sans-I/O: `feed` bytes, then iterate `frames()`).

    `data[pos:]` is what is not yet taken; a caller may take whole frames off its front itself, moving `pos`
    (the client takes whole deliveries there: `spark_amqp.client.events`), before iterating the rest. What is
    taken stays in `data` until the next `feed`, or until `frames()` has taken everything: moving an offset
    instead of cutting the bytes saves a copy of the rest of a received chunk each time the taker changes
    (the client's reader thread spent 6% of its samples in that copy with 4 KB messages, py-spy).
    """

    __slots__ = ("data", "pos", "frame_max")

    def __init__(self, frame_max: int):
        self.data = b""       # bytes, not bytearray: slicing bytes copies a payload once, not twice
        self.pos = 0
        self.frame_max = frame_max

    @property
    def buffer(self) -> bytes:
        """The bytes not yet taken (a copy)."""
        return self.data[self.pos:]

    def feed(self, data: bytes) -> None:
        if self.pos < len(self.data):
            self.data = self.data[self.pos:] + data
        else:
            self.data = bytes(data)
        self.pos = 0

    def frames(self):
        """Yield (type, channel, payload) for each complete frame buffered; keep a partial one."""
        buf = self.data
        size = len(buf)
        pos = self.pos
        unpack = FRAME_HEAD.unpack_from
        frame_max = self.frame_max
        try:
            while size - pos >= 8:
                ftype, channel, length = unpack(buf, pos)
                if frame_max and length + 8 > frame_max:
                    raise replies.connection_error(
                        replies.FRAME_ERROR,
                        f"frame size {length + 8} larger than negotiated maximum {frame_max}")
                end = pos + 7 + length
                if end >= size:
                    break
                if buf[end] != FRAME_END:
                    raise replies.connection_error(
                        replies.FRAME_ERROR, f"invalid frame end byte {buf[end]:#x}")
                start = pos
                pos = end + 1
                yield ftype, channel, buf[start + 7:end]
        finally:
            if pos == size:     # all taken: let the received bytes go (a broker holds a reader per connection)
                self.data, self.pos = b"", 0
            else:
                self.pos = pos


def method_frame(channel: int, method) -> bytes:
    """One method frame from a pamqp method object (the non-hot paths)."""
    return pamqp_frame.marshal(method, channel)


def content_header(body_size: int, properties: bytes) -> bytes:
    """A basic-class content header payload (spec 4.2.6.1) from property bytes (flags + values)."""
    return CONTENT_HEAD.pack(BASIC_CLASS, 0, body_size) + properties


def decode_content_header(payload: bytes) -> tuple[int, int]:
    """(class-id, body-size) of a content header payload; its property bytes are payload[12:]."""
    if len(payload) < 14:
        raise replies.connection_error(replies.FRAME_ERROR, "content header frame is too short")
    class_id, _weight, body_size = CONTENT_HEAD.unpack_from(payload, 0)
    return class_id, body_size


def content_frames(channel: int, header: bytes, body: bytes, frame_max: int) -> list[bytes]:
    """The header frame carrying `header` (a content header payload, passed byte for byte), then the body
    in frames of at most frame_max - 8 octets (spec 4.2.6.2), as a list of parts to join or write."""
    head = FRAME_HEAD.pack
    out = [head(FRAME_HEADER, channel, len(header)), header, FRAME_END_BYTE]
    n = len(body)
    if n:
        chunk = frame_max - FRAME_OVERHEAD if frame_max else n
        if n <= chunk:
            out += (head(FRAME_BODY, channel, n), body, FRAME_END_BYTE)
        else:
            view = memoryview(body)
            for start in range(0, n, chunk):
                part = view[start:start + chunk]
                out += (head(FRAME_BODY, channel, len(part)), bytes(part), FRAME_END_BYTE)
    return out
