"""The connection's legal states and which methods each accepts (AMQP 0-9-1 section 4.9, "Connection
class": the handshake is protocol header, start/start-ok, tune/tune-ok, open/open-ok, in that order).

Kept apart from the code that acts on methods so the whole lifecycle reads as one table, as h11 does.
"""

AWAIT_HEADER = "await-protocol-header"
AWAIT_START_OK = "await-start-ok"
AWAIT_TUNE_OK = "await-tune-ok"
AWAIT_OPEN = "await-open"
OPEN = "open"
CLOSING = "closing"          # we sent connection.close, waiting for close-ok
CLOSED = "closed"            # nothing more is read; the socket closes once output is flushed

# Methods (pamqp names) accepted on channel 0 in each state; anything else there is a protocol error.
CHANNEL0_METHODS = {
    AWAIT_START_OK: {"Connection.StartOk"},
    AWAIT_TUNE_OK: {"Connection.TuneOk"},
    AWAIT_OPEN: {"Connection.Open", "Connection.Close"},
    OPEN: {"Connection.Close", "Connection.CloseOk", "Connection.Blocked", "Connection.Unblocked",
           "Connection.UpdateSecret"},
    CLOSING: {"Connection.Close", "Connection.CloseOk"},
}

HANDSHAKE_STATES = (AWAIT_HEADER, AWAIT_START_OK, AWAIT_TUNE_OK, AWAIT_OPEN)
