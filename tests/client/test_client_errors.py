"""The exception hierarchy: what callers branch on (type, reply code, level) and what they print."""

from __future__ import annotations

import pytest

from spark_amqp.client import (AMQPError, AMQPTimeoutError, AuthenticationError, ChannelClosedError,
                               ConnectionClosedError, ConnectionLostError, PublishNackedError,
                               UnroutableError)


def test_hierarchy():
    assert issubclass(AuthenticationError, ConnectionClosedError)
    assert issubclass(ConnectionLostError, ConnectionClosedError)
    assert not issubclass(ChannelClosedError, ConnectionClosedError)
    assert issubclass(AMQPTimeoutError, TimeoutError)
    for cls in (ConnectionClosedError, ChannelClosedError, PublishNackedError, UnroutableError):
        assert issubclass(cls, AMQPError)


def test_messages_name_code_text_and_method():
    err = ChannelClosedError(404, "NOT_FOUND - no queue 'q' in vhost '/'", 50, 10)
    assert (err.reply_code, err.method) == (404, "Queue.Declare")
    assert str(err) == "channel closed: 404 NOT_FOUND - no queue 'q' in vhost '/' (in reply to Queue.Declare)"
    assert str(ConnectionClosedError(320, "CONNECTION_FORCED - shutdown")) == \
        "connection closed: 320 CONNECTION_FORCED - shutdown"
    lost = ConnectionLostError("missed heartbeats")
    assert lost.reply_code is None and str(lost) == "connection lost: missed heartbeats"
    assert str(PublishNackedError(3, 5)) == "the broker nacked 3 of 5 published message(s)"
    assert "exchange 'ex', routing key 'rk'" in str(UnroutableError(312, "NO_ROUTE", "ex", "rk"))


@pytest.mark.parametrize("err", [ChannelClosedError(406, "PRECONDITION_FAILED", 60, 80),
                                 ConnectionLostError("socket closed"),
                                 AuthenticationError(403, "ACCESS_REFUSED"),
                                 PublishNackedError(1, 2), AMQPTimeoutError("late")])
def test_fresh_copies_raise_independently(err):
    """A closed channel raises its stored error on every call: each raise gets its own instance."""
    raised = []
    for _ in range(3):
        with pytest.raises(type(err)) as info:
            raise err.fresh()
        raised.append(info.value)
    assert len({id(e) for e in raised}) == 3 and err.__traceback__ is None
    for e in raised:
        assert (str(e), repr(e), e.reply_code, e.args) == (str(err), repr(err), err.reply_code, err.args)
