"""The sans-I/O AMQP connection: fed bytes, it applies them to the model and queues bytes to send.

Shape (as h11): `receive_data(bytes)` parses frames and acts on them; `data_to_send()` returns what to
write; `tick(now)` runs heartbeats and the handshake timeout; `connection_lost()` releases what the
connection held. The I/O layer reads `closed` (close the socket after writing), `reading_paused`
(memory alarm) and calls `set_paused_writing` when the socket's buffer is full. Nothing here touches
a socket or a clock of its own.
"""

from __future__ import annotations

import logging
import struct

from pamqp import commands as C

from spark_amqp.codec import fields, frames, methods, properties, replies
from spark_amqp.codec.frames import FRAME_BODY, FRAME_HEADER, FRAME_HEARTBEAT, FRAME_METHOD

from . import access, limits, state
from .channel import Channel

log = logging.getLogger("broker.connection")

# What the codec raises on bytes that do not decode (a property list, a field table, a method's arguments
# read lazily): malformed input, answered with 501 FRAME_ERROR, never 541 INTERNAL_ERROR.
# (UnicodeDecodeError is a ValueError, as are PropertyError and FieldError.)
DECODE_ERRORS = (properties.PropertyError, fields.FieldError, struct.error, IndexError, ValueError)

# The header RabbitMQ 4.x answers an unsupported protocol header with: AMQP 1.0 with the SASL layer.
AMQP10_SASL_HEADER = b"AMQP\x03\x01\x00\x00"

SHUTDOWN_TEXT = "broker forced connection closure with reason 'shutdown'"   # RabbitMQ's, code 320

SERVER_CAPABILITIES = {
    "publisher_confirms": True, "exchange_exchange_bindings": True, "basic.nack": True,
    "consumer_cancel_notify": True, "connection.blocked": True, "consumer_priorities": False,
    "authentication_failure_close": True, "per_consumer_qos": True, "direct_reply_to": False,
}


class Connection:
    """`peer_cert_subject`: the I/O layer's word that this is a TLS connection whose client certificate was
    verified against tls_ca, as the certificate's subject (Python's ssl form: a tuple of RDNs); None on
    plain TCP or without a verified certificate. It is what SASL EXTERNAL logs in with."""

    def __init__(self, core, peer: str = "", peer_cert_subject=None):
        self.core = core
        self.peer = peer
        self.peer_cert_subject = peer_cert_subject
        self.state = state.AWAIT_HEADER
        self._header_buf = b""
        self.reader = frames.FrameReader(core.config.frame_max)
        self.out: list[bytes] = []
        self.later: list[bytes] = []
        self.out_bytes = 0
        self.channels: dict[int, Channel] = {}
        self.closing_channels: set[int] = set()     # we sent channel.close, awaiting close-ok
        self.confirm_channels: set[Channel] = set()
        self.confirms_waiting = 0                   # confirms recorded, not yet flushed
        self.exclusive_queues: set = set()
        self.user: str | None = None
        self.vhost = None
        self.client_properties: dict = {}
        self.capabilities: dict = {}
        self.frame_max = core.config.frame_max
        self.channel_max = core.config.channel_max
        self.heartbeat = 0
        now = core.now()
        self.created = now
        self.last_recv = now
        self.last_send = now
        self.closing_since = None
        self.closed = False
        self.paused_writing = False
        self.has_published = False
        self.blocked_sent = False
        self.io = None            # opaque handle of the I/O layer (the asyncio protocol)

    # --- output --------------------------------------------------------------------------------

    def _write(self, data: bytes) -> None:
        self.out.append(data)
        self.out_bytes += len(data)
        self.core.dirty.add(self)

    def send_method(self, channel: int, method) -> None:
        self._write(frames.method_frame(channel, method))

    write_raw = _write

    def send_later(self, frame: bytes) -> None:
        """Queue a frame to go after everything written so far in this turn of the loop."""
        self.later.append(frame)
        self.core.dirty.add(self)

    def write_delivery(self, channel: int, ctag: bytes, tag: int, m) -> None:
        parts = methods.deliver_frames(channel, ctag, tag, m.redelivered, methods.name_shortstr(m.exchange),
                                       methods.name_shortstr(m.routing_key), m.header, m.body, self.frame_max)
        self.out += parts
        self.out_bytes += sum(map(len, parts))
        self.core.dirty.add(self)

    def write_content(self, channel: int, m) -> None:
        for part in frames.content_frames(channel, m.header, m.body, self.frame_max):
            self._write(part)

    def data_to_send(self) -> bytes:
        if self.later:
            self.out += self.later
            self.later = []
        if not self.out:
            return b""
        data = b"".join(self.out)
        if self.out_bytes >= limits.CONNECTION_OUTPUT_HIGH_WATER:
            # Deliveries stopped at the high-water mark; now that the socket takes the bytes,
            # let the queues try again (unless the transport pauses us first).
            self._redispatch_consumers()
        self.out = []
        self.out_bytes = 0
        self.last_send = self.core.now()
        return data

    def writable(self) -> bool:
        return (not self.paused_writing and self.out_bytes < limits.CONNECTION_OUTPUT_HIGH_WATER
                and self.state is state.OPEN)

    def set_paused_writing(self, paused: bool) -> None:
        self.paused_writing = paused
        if not paused:
            self._redispatch_consumers()

    def _redispatch_consumers(self) -> None:
        for ch in self.channels.values():
            for c in ch.consumers.values():
                self.core.wants_dispatch(c.queue)

    @property
    def reading_paused(self) -> bool:
        """Memory alarm: stop reading from connections that publish, as RabbitMQ blocks them."""
        return self.core.alarm and self.has_published and not self.closed

    # --- input ---------------------------------------------------------------------------------

    def receive_data(self, data: bytes) -> None:
        if self.closed or not data:
            return
        self.last_recv = self.core.now()
        if self.state is state.AWAIT_HEADER:
            data = self._receive_protocol_header(data)
            if not data:
                return
        self.reader.feed(data)
        try:
            for ftype, channel, payload in self.reader.frames():
                self._frame(ftype, channel, payload)
                if self.closed:
                    break
        except replies.AMQPError as exc:
            self._connection_exception(exc)
        except DECODE_ERRORS as exc:
            # RabbitMQ 3.10 answers a malformed property list or field table with 541 INTERNAL_ERROR
            # (its decoder crashes); it is the peer's bytes that are wrong, so: 501, as for a method
            # whose arguments do not decode.
            self._connection_exception(replies.connection_error(
                replies.FRAME_ERROR, f"cannot decode the peer's frame: {exc}"))
        except Exception as exc:  # never let a peer crash the broker
            log.exception("internal error handling a frame from %s", self.peer)
            self._connection_exception(replies.connection_error(replies.INTERNAL_ERROR, str(exc)))

    def end_of_read(self, more_input_waiting) -> None:
        """The I/O layer has handed over one read's bytes; `more_input_waiting()` says whether the peer's
        next bytes are already waiting on the socket (asked only when it matters).

        The confirm-coalescing policy: publisher confirms recorded during the read go out now, unless the
        peer's next publishes are already waiting and fewer than CONFIRM_DEFER_MAX confirms are held, so
        that one ack with multiple=true covers more messages (a Python publisher's CPU per message
        depends on it; confirming each publish singly cost pika ~35% more CPU per message)."""
        if self.confirm_channels and (self.confirms_waiting >= limits.CONFIRM_DEFER_MAX
                                      or not more_input_waiting()):
            self.flush_confirms()

    def flush_confirms(self) -> None:
        """Send the confirms recorded since the last flush, coalesced per channel."""
        for ch in self.confirm_channels:
            if ch.state == "open":
                ch.flush_confirms()
        self.confirm_channels.clear()
        self.confirms_waiting = 0

    def _receive_protocol_header(self, data: bytes) -> bytes:
        buf = self._header_buf + data
        if len(buf) < 8:
            if frames.PROTOCOL_HEADER.startswith(buf):
                self._header_buf = buf
                return b""
        head, rest = buf[:8], buf[8:]
        self._header_buf = b""
        if head != frames.PROTOCOL_HEADER:
            # Spec 4.2.2: reply with the header we support, then close the socket. 4.x answers anything but
            # an AMQP 0-9-x header with AMQP 1.0's SASL header (rabbit_reader:refuse_connection).
            amqp09 = head[:6] == b"AMQP\x00\x00" and head[6] >= 9
            if self.core.behaviour.refuse_with_amqp10_header and not amqp09:
                self._write(AMQP10_SASL_HEADER)
            else:
                self._write(frames.PROTOCOL_HEADER)
            self.closed = True
            return b""
        self.state = state.AWAIT_START_OK
        self.send_method(0, C.Connection.Start(
            version_major=0, version_minor=9,
            server_properties={
                "product": "spark-amqp embedded broker", "version": "0.1.0", "platform": "Python",
                "copyright": "spark-amqp authors", "information": "https://github.com/spark-amqp",
                "capabilities": SERVER_CAPABILITIES, "cluster_name": "embedded@localhost",
            },
            mechanisms=" ".join(self._mechanisms()), locales="en_US"))
        return rest

    def _mechanisms(self) -> tuple[str, ...]:
        """EXTERNAL only where it can succeed: on a TLS connection with a verified client certificate.
        (RabbitMQ, with rabbitmq_auth_mechanism_ssl enabled and EXTERNAL in auth_mechanisms, offers it on
        every TLS connection and refuses a client without a certificate at login; offering it only here
        keeps clients that pick the first mechanism they know from picking one that must fail.) Last, so
        that a client choosing from the list by order keeps PLAIN."""
        return ("PLAIN", "AMQPLAIN", "EXTERNAL") if self.peer_cert_subject is not None else ("PLAIN", "AMQPLAIN")

    def _frame(self, ftype: int, channel: int, payload: bytes) -> None:
        if ftype == FRAME_METHOD:
            if channel:
                ch = self.channels.get(channel)
                if ch is not None and ch.pending is None and len(payload) >= 4:
                    index = methods.method_index(payload)
                    if index == methods.PUBLISH_ID:
                        try:
                            exchange, rk, mandatory, immediate = methods.decode_publish(payload)
                        except replies.AMQPError as exc:
                            raise _undecodable(exc, *methods.BASIC_PUBLISH) from None
                        try:
                            ch.start_publish(exchange, rk, mandatory, immediate)
                        except replies.AMQPError as exc:
                            self._exception_on(ch, exc)
                        return
                    if index == methods.ACK_ID:
                        try:
                            tag, multiple = methods.decode_ack(payload)
                        except replies.AMQPError as exc:
                            raise _undecodable(exc, *methods.BASIC_ACK) from None
                        try:
                            ch.settle(tag, multiple, "ack")
                        except replies.AMQPError as exc:
                            exc.class_id, exc.method_id = methods.BASIC_ACK
                            self._exception_on(ch, exc)
                        return
            self._method(channel, payload)
        elif ftype == FRAME_HEADER:
            ch = self._content_channel(channel)
            if ch is None:
                return
            if ch.pending is None or ch.pending[3] is not None:
                raise replies.connection_error(
                    replies.UNEXPECTED_FRAME, "expected method frame, got non method frame instead")
            try:
                ch.on_header(payload)
            except replies.AMQPError as exc:
                self._exception_on(ch, exc)
        elif ftype == FRAME_BODY:
            ch = self._content_channel(channel)
            if ch is None:
                return
            if ch.pending is None or ch.pending[3] is None:
                raise replies.connection_error(
                    replies.UNEXPECTED_FRAME, "expected method frame, got non method frame instead")
            try:
                ch.on_body(payload)
            except replies.AMQPError as exc:
                self._exception_on(ch, exc)
        elif ftype == FRAME_HEARTBEAT:
            if channel:
                raise replies.connection_error(replies.UNEXPECTED_FRAME,
                                               f"heartbeat frame on channel {channel}")
        else:
            raise replies.connection_error(replies.FRAME_ERROR, f"unknown frame type {ftype}")

    def _content_channel(self, channel: int):
        if self.state is state.CLOSING:
            return None
        if channel == 0 or self.state is not state.OPEN:
            raise replies.connection_error(replies.UNEXPECTED_FRAME,
                                           f"content frame on channel {channel}")
        ch = self.channels.get(channel)
        if ch is None:
            if channel in self.closing_channels:
                return None
            raise replies.connection_error(replies.CHANNEL_ERROR,
                                           f"expected 'channel.open' on channel {channel}")
        return ch

    def _method(self, channel: int, payload: bytes) -> None:
        if len(payload) < 4:
            raise replies.connection_error(replies.FRAME_ERROR, "method frame too short")
        try:
            method = methods.unmarshal_method(payload)
        except replies.AMQPError as exc:
            raise _undecodable(exc, *divmod(methods.method_index(payload), 0x10000)) from None
        try:
            self._dispatch_method(channel, method)
        except replies.AMQPError as exc:
            # connection.close names the method that caused it, as RabbitMQ's does
            if not exc.class_id:
                exc.class_id, exc.method_id = _ids(method)
            raise

    def _dispatch_method(self, channel: int, method) -> None:
        if channel == 0:
            self._channel0(method)
            return
        if self.state is state.CLOSING:
            return  # spec 4.2.4: after sending connection.close, discard all but close/close-ok
        if self.state is not state.OPEN:
            raise replies.connection_error(replies.CHANNEL_ERROR,
                                           f"unexpected method {method.name} on channel {channel}")
        ch = self.channels.get(channel)
        if channel in self.closing_channels:
            # Spec 1.5.2.5: after channel.close, discard everything but close / close-ok.
            if isinstance(method, C.Channel.CloseOk):
                self.closing_channels.discard(channel)
            elif isinstance(method, C.Channel.Close):
                self.send_method(channel, C.Channel.CloseOk())
            return
        if ch is None:
            if isinstance(method, C.Channel.Open):
                self._open_channel(channel)
                return
            raise replies.connection_error(replies.CHANNEL_ERROR,
                                           f"expected 'channel.open' on channel {channel}")
        if ch.pending is not None:
            raise replies.AMQPError(
                replies.UNEXPECTED_FRAME,
                "expected content header for class 60, got non content header frame instead",
                hard=True, class_id=60, method_id=40)
        if isinstance(method, C.Channel.Close):
            ch.close()
            del self.channels[channel]
            self.send_method(channel, C.Channel.CloseOk())
            return
        if isinstance(method, C.Channel.CloseOk):
            raise replies.connection_error(replies.COMMAND_INVALID, "unexpected channel.close-ok")
        if method.name.startswith("Connection."):
            raise replies.connection_error(replies.COMMAND_INVALID, f"{method.name} on channel {channel}")
        try:
            ch.handle(method)
        except replies.AMQPError as exc:
            if not exc.class_id:
                exc.class_id, exc.method_id = _ids(method)
            self._exception_on(ch, exc)

    def _open_channel(self, number: int) -> None:
        # RabbitMQ limits how many channels are open at once, not the channel number.
        if len(self.channels) >= self.channel_max:
            raise replies.connection_error(
                replies.NOT_ALLOWED,
                f"number of channels opened ({len(self.channels)}) has reached the negotiated "
                f"channel_max ({self.channel_max})")
        self.channels[number] = Channel(self, number)
        self.send_method(number, C.Channel.OpenOk())

    def channel_exception(self, ch: Channel, exc: replies.AMQPError) -> None:
        """A channel exception raised outside a frame's handling (the consumer timeout, on the clock)."""
        self._exception_on(ch, exc)

    def _exception_on(self, ch: Channel, exc: replies.AMQPError) -> None:
        if exc.hard:
            raise exc
        # Spec 1.5.2.5 / 4.2.4: a channel exception closes the channel; the connection lives on.
        ch.close()
        self.channels.pop(ch.number, None)
        self.closing_channels.add(ch.number)
        self.send_method(ch.number, C.Channel.Close(reply_code=exc.code, reply_text=exc.text,
                                                    class_id=exc.class_id, method_id=exc.method_id))

    def _connection_exception(self, exc: replies.AMQPError) -> None:
        if self.state in (state.AWAIT_HEADER,):
            self.closed = True
            return
        if self.state is state.CLOSING:
            self.closed = True
            return
        if not getattr(exc, "logged", False):
            log.warning("closing AMQP connection %s (user '%s', vhost '%s'): %s (class %s, method %s)",
                        self.peer, _shown(self.user or ""), _shown(self.vhost.name if self.vhost else ""),
                        _shown(exc.text), exc.class_id, exc.method_id)
        self._release()
        self.send_method(0, C.Connection.Close(reply_code=exc.code, reply_text=exc.text,
                                               class_id=exc.class_id, method_id=exc.method_id))
        self.state = state.CLOSING
        self.closing_since = self.core.now()

    def force_close(self, text: str) -> None:
        """The broker is going away: an open connection gets connection.close 320 CONNECTION_FORCED (the
        client answers close-ok, or the CLOSING timeout ends it); one still in the handshake is closed."""
        if self.closed or self.state is state.CLOSING:
            return
        if self.state in (state.AWAIT_OPEN, state.OPEN):
            exc = replies.connection_error(replies.CONNECTION_FORCED, text)
            exc.logged = True
            self._connection_exception(exc)
        else:
            self.closed = True
        self.core.dirty.add(self)

    # --- channel 0: the connection class -------------------------------------------------------

    def _channel0(self, method) -> None:
        allowed = state.CHANNEL0_METHODS.get(self.state, ())
        if method.name not in allowed:
            if self.state is state.CLOSING:
                return
            if not method.name.startswith("Connection."):
                raise replies.connection_error(replies.CHANNEL_ERROR,
                                               f"unexpected method {method.name} on channel 0")
            raise replies.connection_error(
                replies.COMMAND_INVALID,
                f"unexpected method {method.name} on channel 0 in state {self.state}")
        getattr(self, "_on_" + method.name.split(".")[1].lower())(method)

    def _on_startok(self, m) -> None:
        self.client_properties = m.client_properties or {}
        caps = self.client_properties.get("capabilities") or {}
        self.capabilities = caps if isinstance(caps, dict) else {}
        if m.mechanism not in self._mechanisms():
            log.warning("login refused on AMQP connection %s: unknown authentication mechanism '%s'",
                        self.peer, _shown(m.mechanism))
            self.closed = True  # RabbitMQ closes the socket on an unknown mechanism, no frame
            return
        if m.mechanism == "EXTERNAL":
            # The response is ignored (RabbitMQ's rabbit_auth_mechanism_ssl): the certificate names the user.
            user = access.cert_login_name(self.peer_cert_subject, self.core.config.ssl_cert_login_from)
            refused = "no name found in the peer certificate" if not user else \
                self.core.access.external_login_refused(user, self.peer)
        else:
            user, password = self._credentials(m.mechanism, m.response)
            refused = "malformed response (no user name)" if user is None else \
                self.core.access.login_refused(user, password, self.peer)
        if refused:
            # As RabbitMQ logs it ("PLAIN login refused: user 'x' - invalid credentials", or "user 'guest'
            # can only connect via localhost"): the peer and the user, never the password.
            log.warning("%s login refused on AMQP connection %s: %s", _shown(m.mechanism), self.peer,
                        _shown(refused))
            if not self.capabilities.get("authentication_failure_close"):
                # Without the capability the spec's only signal is a closed socket (RabbitMQ does so).
                self.closed = True
                return
            exc = replies.connection_error(
                replies.ACCESS_REFUSED,
                f"Login was refused using authentication mechanism {m.mechanism}. "
                "For details see the broker logfile.")
            exc.logged = True
            raise exc
        self.user = user
        self.state = state.AWAIT_TUNE_OK
        cfg = self.core.config
        self.send_method(0, C.Connection.Tune(channel_max=cfg.channel_max, frame_max=cfg.frame_max,
                                              heartbeat=cfg.heartbeat))

    @staticmethod
    def _credentials(mechanism: str, response) -> tuple[str | None, str | None]:
        raw = response.encode("latin-1") if isinstance(response, str) else bytes(response or b"")
        if mechanism == "PLAIN":
            parts = raw.split(b"\x00")
            if len(parts) != 3:
                return None, None
            return parts[1].decode("utf-8", "replace"), parts[2].decode("utf-8", "replace")
        if mechanism == "AMQPLAIN":
            # The response is a field table without its length prefix (RabbitMQ's rabbit_auth_mechanism_amqplain).
            try:
                table = fields.decode_table(len(raw).to_bytes(4, "big") + raw)   # depth-checked
            except Exception:
                return None, None
            login, password = table.get("LOGIN"), table.get("PASSWORD")
            login = login.decode() if isinstance(login, bytes) else login
            password = password.decode() if isinstance(password, bytes) else password
            return login, password
        return None, None

    def _on_tuneok(self, m) -> None:
        cfg = self.core.config
        # A tune-ok outside what the server offered (0 means "no limit", which exceeds any offer)
        # ends the connection; RabbitMQ closes the socket without a close frame at this stage.
        if not (self.core.behaviour.frame_min_size <= m.frame_max <= cfg.frame_max
                and 0 < m.channel_max <= cfg.channel_max):
            log.warning("closing AMQP connection %s: tune-ok frame_max=%s channel_max=%s outside the offer",
                     self.peer, m.frame_max, m.channel_max)
            self.closed = True
            return
        self.frame_max = m.frame_max
        self.reader.frame_max = self.frame_max
        self.channel_max = m.channel_max
        self.heartbeat = m.heartbeat
        self.state = state.AWAIT_OPEN

    def _on_open(self, m) -> None:
        vhost = self.core.vhosts.get(m.virtual_host)
        if not self.core.access.vhost_allowed(self.user, m.virtual_host, vhost is not None):
            # RabbitMQ 3.10 (observed): 530 either way, "vhost v not found" for a vhost that does not exist,
            # "access to vhost 'v' refused for user 'u'" for one the user has no permissions on.
            log.warning("access to vhost '%s' refused for user '%s' on AMQP connection %s%s",
                        _shown(m.virtual_host), _shown(self.user), self.peer,
                        "" if vhost is not None else ": no such vhost")
            exc = replies.connection_error(
                replies.NOT_ALLOWED, f"vhost {m.virtual_host} not found" if vhost is None else
                f"access to vhost '{m.virtual_host}' refused for user '{self.user}'")
            exc.logged = True
            raise exc
        limit = self.core.config.max_connections
        if limit is not None and self.core.open_connections() >= limit:
            log.warning("access to vhost '%s' refused for user '%s' on AMQP connection %s: "
                        "connection limit (%s) is reached", _shown(m.virtual_host), _shown(self.user),
                        self.peer, limit)
            exc = replies.connection_error(
                replies.NOT_ALLOWED,
                f"access to vhost '{m.virtual_host}' refused for user '{self.user}': "
                f"connection limit ({limit}) is reached")
            exc.logged = True
            raise exc
        self.vhost = vhost
        self.state = state.OPEN
        self.send_method(0, C.Connection.OpenOk())

    def _on_close(self, m) -> None:
        self._release()
        self.send_method(0, C.Connection.CloseOk())
        self.state = state.CLOSED
        self.closed = True

    def _on_closeok(self, m) -> None:
        self.state = state.CLOSED
        self.closed = True

    def _on_blocked(self, m) -> None:
        pass

    def _on_unblocked(self, m) -> None:
        pass

    def _on_updatesecret(self, m) -> None:
        self.send_method(0, C.Connection.UpdateSecretOk())

    # --- alarms, timers, teardown ----------------------------------------------------------------

    def on_alarm(self, active: bool) -> None:
        """RabbitMQ (rabbit_reader:maybe_block) blocks only connections that publish: one that has
        published is blocked when the alarm goes off, any other at its first publish during the alarm."""
        if self.state is state.OPEN and self.capabilities.get("connection.blocked") and (
                self.has_published or not active):
            self._send_blocked(active)

    def note_publish(self) -> None:
        if not self.has_published:
            self.has_published = True
            if self.core.alarm:
                self.on_alarm(True)

    def _send_blocked(self, active: bool) -> None:
        if active and not self.blocked_sent:
            self.send_method(0, C.Connection.Blocked(reason="low on memory"))
            self.blocked_sent = True
        elif not active and self.blocked_sent:
            self.send_method(0, C.Connection.Unblocked())
            self.blocked_sent = False

    def tick(self, now: float) -> None:
        """Heartbeats (errata: send when idle for half the interval; a peer silent for two intervals
        is dead), the handshake timeout, and the close-ok wait."""
        if self.closed:
            return
        if self.state in state.HANDSHAKE_STATES:
            if now - self.created > limits.HANDSHAKE_TIMEOUT * 1000:
                self.closed = True
            return
        if self.state is state.CLOSING:
            if now - self.closing_since > 1000:
                self.closed = True
            return
        if self.heartbeat:
            interval = self.heartbeat * 1000
            if now - self.last_recv > interval * limits.HEARTBEAT_MISSES_ALLOWED:
                log.info("closing %s: missed heartbeats from client, timeout: %ss",
                         self.peer, self.heartbeat)
                self._release()
                self.closed = True
                return
            if now - self.last_send >= interval / 2:
                self._write(frames.HEARTBEAT_FRAME)

    def _release(self) -> None:
        """Give back what this connection holds: unacked deliveries, consumers, exclusive queues."""
        for ch in list(self.channels.values()):
            ch.close()
        self.channels.clear()
        self.confirm_channels.clear()
        for q in list(self.exclusive_queues):
            q.vhost.delete_queue(q)
        self.exclusive_queues.clear()

    def connection_lost(self) -> None:
        self._release()
        self.closed = True
        self.state = state.CLOSED
        self.core.connection_closed(self)


def _undecodable(exc: replies.AMQPError, class_id: int, method_id: int) -> replies.AMQPError:
    """Arguments that do not decode (cut short, a field table that runs past its end): RabbitMQ 3.10
    answers 501 FRAME_ERROR "cannot decode <<...>>" naming the method; the codec says 502 SYNTAX_ERROR.
    Names that are not UTF-8 stay 502 (RabbitMQ does not check them)."""
    if exc.code != replies.SYNTAX_ERROR or "UTF-8" in exc.text:
        return exc
    text = exc.text.split(" - ", 1)[-1]
    return replies.AMQPError(replies.FRAME_ERROR, f"cannot decode the method's arguments ({text})",
                             hard=True, class_id=class_id, method_id=method_id)
def _shown(value) -> str:
    """A peer-supplied name fit for a log line: printable (escaped otherwise) and at most 100 characters."""
    text = value if isinstance(value, str) else repr(value)
    text = text[:100]
    return text if text.isprintable() else text.encode("unicode_escape").decode("ascii")


def _ids(method) -> tuple[int, int]:
    return method.index >> 16, method.index & 0xFFFF
