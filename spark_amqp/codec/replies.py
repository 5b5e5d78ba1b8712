"""Reply codes and the one error type that carries them.

AMQP 0-9-1 section 1.2 (constants) gives each code a level: a *soft* error closes the channel
(channel.close), a *hard* error closes the whole connection (connection.close). RabbitMQ follows the same
split; where it raises a code at a different level than the spec lists, the call site says so.
"""

from __future__ import annotations

REPLY_SUCCESS = 200
CONTENT_TOO_LARGE = 311       # soft
NO_ROUTE = 312                # soft (basic.return)
NO_CONSUMERS = 313            # soft (basic.return, immediate)
CONNECTION_FORCED = 320       # hard
INVALID_PATH = 402            # hard
ACCESS_REFUSED = 403          # soft
NOT_FOUND = 404               # soft
RESOURCE_LOCKED = 405         # soft
PRECONDITION_FAILED = 406     # soft
FRAME_ERROR = 501             # hard
SYNTAX_ERROR = 502            # hard
COMMAND_INVALID = 503         # hard
CHANNEL_ERROR = 504           # hard
UNEXPECTED_FRAME = 505        # hard
RESOURCE_ERROR = 506          # hard
NOT_ALLOWED = 530             # hard
NOT_IMPLEMENTED = 540         # hard
INTERNAL_ERROR = 541          # hard

REPLY_NAMES = {
    200: "REPLY_SUCCESS", 311: "CONTENT_TOO_LARGE", 312: "NO_ROUTE", 313: "NO_CONSUMERS",
    320: "CONNECTION_FORCED", 402: "INVALID_PATH", 403: "ACCESS_REFUSED", 404: "NOT_FOUND",
    405: "RESOURCE_LOCKED", 406: "PRECONDITION_FAILED", 501: "FRAME_ERROR", 502: "SYNTAX_ERROR",
    503: "COMMAND_INVALID", 504: "CHANNEL_ERROR", 505: "UNEXPECTED_FRAME", 506: "RESOURCE_ERROR",
    530: "NOT_ALLOWED", 540: "NOT_IMPLEMENTED", 541: "INTERNAL_ERROR",
}


class AMQPError(Exception):
    """Something a peer did that the protocol answers with a close.

    `hard` selects connection.close over channel.close. `class_id`/`method_id` name the method that
    failed (0/0 when it was not a method), as channel.close and connection.close carry them.
    The reply text is prefixed with the code's name, as RabbitMQ writes it: "NOT_FOUND - no queue 'q'".
    """

    def __init__(self, code: int, text: str, *, hard: bool, class_id: int = 0, method_id: int = 0):
        super().__init__(f"{REPLY_NAMES.get(code, code)} - {text}")
        self.code = code
        # a reply text is a shortstr: at most 255 bytes (not characters; names quoted may be non-ASCII)
        self.text = f"{REPLY_NAMES.get(code, code)} - {text}".encode()[:255].decode("utf-8", "ignore")
        self.hard = hard
        self.class_id = class_id
        self.method_id = method_id


def channel_error(code: int, text: str) -> AMQPError:
    return AMQPError(code, text, hard=False)


def connection_error(code: int, text: str) -> AMQPError:
    return AMQPError(code, text, hard=True)
