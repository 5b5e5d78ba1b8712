"""One exception hierarchy for the client, carrying the broker's reply code and text.

Why a hierarchy rather than pamqp's or socket's exceptions: the source and the sink must decide what to do
(reconnect, fail the task, report a bad option) from *which* of channel or connection was closed and with
which reply code (AMQP 0-9-1 section 1.2: channel exceptions close the channel, connection exceptions
close the connection). Messages never contain a password: the client only ever formats redacted URIs
(`uri.redact`), and nothing here formats credentials.

    AMQPError
    ├── ConnectError                 TCP connect failed / handshake did not complete (host unreachable)
    ├── ConnectionClosedError        the connection is closed: by the broker (reply code), by us, or lost
    │   ├── AuthenticationError      403 ACCESS_REFUSED during the handshake (bad user or password)
    │   └── ConnectionLostError      socket closed / missed heartbeats (reply_code is None)
    ├── ChannelClosedError           the broker closed the channel (reply code, and the method at fault)
    ├── AMQPTimeoutError             an RPC or a wait timed out (also a TimeoutError)
    ├── PublishNackedError           wait_for_confirms: the broker nacked n messages
    ├── UnroutableError              wait_for_confirms: mandatory messages came back (basic.return)
    ├── ConsumerCancelledError       the broker cancelled a consumer (queue deleted; consumer_cancel_notify)
    └── ProtocolError                the broker sent something this client cannot accept
"""

from __future__ import annotations

from pamqp import commands



def method_name(class_id: int, method_id: int) -> str:
    """`Queue.Declare` for (50, 10): the broker's close names the method that caused it."""
    cls = commands.INDEX_MAPPING.get((class_id << 16) | method_id)
    return cls.name if cls is not None else ""


class AMQPError(Exception):
    """Base of every error raised by `spark_amqp.client`."""

    reply_code: int | None = None
    reply_text: str = ""

    def fresh(self) -> "AMQPError":
        """A copy to raise. A channel or connection keeps the error that closed it and raises it on every
        later call; raising that one instance again and again would grow its traceback without bound
        and share it between threads."""
        clone = type(self).__new__(type(self))
        clone.__dict__.update(self.__dict__)
        clone.args = self.args
        return clone


class ConnectError(AMQPError):
    """The TCP connection or the protocol handshake could not be established (nothing to retry on yet)."""


class _Closed(AMQPError):
    """Shared shape of connection and channel closes: reply code, reply text, the method at fault."""

    level = "connection"

    def __init__(self, reply_code: int | None, reply_text: str, class_id: int = 0, method_id: int = 0):
        self.reply_code = reply_code
        self.reply_text = reply_text
        self.class_id = class_id
        self.method_id = method_id
        super().__init__(reply_code, reply_text)

    @property
    def method(self) -> str:
        return method_name(self.class_id, self.method_id) if self.class_id else ""

    def __str__(self) -> str:
        where = f" (in reply to {self.method})" if self.method else ""
        code = f"{self.reply_code} " if self.reply_code is not None else ""
        return f"{self.level} closed: {code}{self.reply_text}{where}"

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.reply_code!r}, {self.reply_text!r})"


class ConnectionClosedError(_Closed):
    """The connection is closed; `reply_code`/`reply_text` come from the broker's connection.close."""


class AuthenticationError(ConnectionClosedError):
    """The broker refused the credentials (403 ACCESS_REFUSED during connection.start-ok)."""


class ConnectionLostError(ConnectionClosedError):
    """The connection died without a connection.close: socket closed or reset, or missed heartbeats."""

    def __init__(self, reason: str):
        super().__init__(None, reason)

    def __str__(self) -> str:
        return f"connection lost: {self.reply_text}"


class ChannelClosedError(_Closed):
    """The broker closed the channel (e.g. 404 NOT_FOUND on a passive declare); the connection lives on."""

    level = "channel"


class AMQPTimeoutError(AMQPError, TimeoutError):
    """An RPC or a wait did not complete in time."""


class PublishNackedError(AMQPError):
    """The broker nacked published messages (e.g. a full queue with x-overflow=reject-publish)."""

    def __init__(self, nacked: int, published: int):
        self.nacked = nacked
        self.published = published
        super().__init__(f"the broker nacked {nacked} of {published} published message(s)")


class UnroutableError(AMQPError):
    """Mandatory messages were returned (basic.return), typically 312 NO_ROUTE."""

    def __init__(self, reply_code: int, reply_text: str, exchange: str, routing_key: str, count: int = 1):
        self.reply_code = reply_code
        self.reply_text = reply_text
        self.exchange = exchange
        self.routing_key = routing_key
        self.count = count
        more = f" ({count} message(s) returned in all)" if count > 1 else ""
        super().__init__(f"message returned by the broker: {reply_code} {reply_text}: "
                         f"exchange {exchange!r}, routing key {routing_key!r}{more}")


class ConsumerCancelledError(AMQPError):
    """The broker cancelled consumers (basic.cancel from the server, e.g. the queue was deleted)."""

    def __init__(self, consumer_tags: list[str]):
        self.consumer_tags = consumer_tags
        super().__init__(f"the broker cancelled consumer(s) {', '.join(consumer_tags)}")


class ProtocolError(AMQPError):
    """The broker sent a frame this client cannot accept; the client closes the connection."""
