"""Limits the broker enforces, each a named constant whose comment gives its precedent.

A hostile or broken peer meets one of these and gets the specification's error and a closed connection,
never a crashed broker or unbounded memory.
"""

# AMQP 0-9-1 section 4.2.3: "The minimum frame size is 4096 octets"; a peer may not negotiate lower.
FRAME_MIN_SIZE = 4096

# RabbitMQ's default `frame_max` (rabbit.app): 128 KiB. Offered in Connection.Tune.
DEFAULT_FRAME_MAX = 131072

# RabbitMQ 3.10's default `channel_max`: 2047 (errata: 0 would mean "no limit", RabbitMQ never offers it).
DEFAULT_CHANNEL_MAX = 2047

# RabbitMQ's default heartbeat timeout, seconds, offered in Connection.Tune.
DEFAULT_HEARTBEAT = 60

# A client must finish the handshake (protocol header to Connection.Open) within this many seconds, as
# RabbitMQ's `handshake_timeout` (10 s) requires.
HANDSHAKE_TIMEOUT = 10.0

# A TLS client must complete the TLS handshake within this many seconds, as RabbitMQ's
# `ssl_handshake_timeout` (5000 ms) requires; then HANDSHAKE_TIMEOUT applies to the AMQP handshake.
TLS_HANDSHAKE_TIMEOUT = 5.0

# Errata, "Heartbeats": a peer is dead after missing two heartbeat intervals; RabbitMQ closes the socket.
HEARTBEAT_MISSES_ALLOWED = 2

# Bytes the broker buffers for one connection before it stops delivering to that connection's consumers
# until the socket drains. Keeps a slow consumer with prefetch 0 from pulling a whole queue into memory.
CONNECTION_OUTPUT_HIGH_WATER = 1 << 20

# Most deliveries one consumer receives in one dispatch round, so one consumer with a deep queue and no
# prefetch limit cannot starve the event loop (RabbitMQ's queue process likewise delivers in bursts).
DISPATCH_BURST = 2000

# Publisher confirms are deferred while the publisher's next frames are already waiting, but never for more
# than this many messages, so a publisher with a small window of unconfirmed messages is not left waiting
# on a full window (RabbitMQ likewise confirms in batches as its queue processes report).
CONFIRM_DEFER_MAX = 128

# RabbitMQ 3.10's default `vm_memory_high_watermark.relative` (rabbit_memory.hrl,
# DEFAULT_VM_MEMORY_HIGH_WATERMARK): publishers are blocked once the broker holds more than 0.4 of the
# machine's total memory. Here the measure is the bytes of message data held in queues (see BrokerCore).
DEFAULT_MEMORY_HIGH_WATERMARK = 0.4

# Seconds between two memory checks, as RabbitMQ's vm_memory_monitor (DEFAULT_MEMORY_CHECK_INTERVAL,
# 1000 ms). The alarm is set or cleared only then, never per message, so it cannot flap faster than this.
MEMORY_CHECK_INTERVAL = 1.0

# RabbitMQ's default `consumer_timeout` (rabbit.app), milliseconds: 30 minutes. A delivery held unacked longer
# times out (versions.Behaviour.consumer_timeout_on_channel_tick says how).
DEFAULT_CONSUMER_TIMEOUT = 1_800_000

# RabbitMQ's default `channel_tick_interval` (rabbit.app), milliseconds: how often a channel ticks, and so, on
# 3.10, how often it checks its consumer timeout.
DEFAULT_CHANNEL_TICK_INTERVAL = 60_000

# A quorum queue's own tick, seconds: RabbitMQ's Ra ticks every quorum queue every 5 s from its start
# (ra's tick_timeout), and rabbit_fifo checks x-expires only then: an unused queue goes at the first tick past
# its expiry.
QUORUM_TICK = 5.0

# Seconds between two attempts to publish a quorum queue's at-least-once dead letters that no queue took yet,
# as RabbitMQ's `dead_letter_worker_publisher_confirm_timeout` (180,000 ms).
DEAD_LETTER_RETRY_INTERVAL = 180.0

# On shutdown (SIGTERM), seconds the broker waits for clients to answer its connection.close 320
# CONNECTION_FORCED with close-ok before it drops the remaining sockets.
SHUTDOWN_GRACE = 2.0

# `Broker.stop()` (the embedded broker, in-process) does what SIGTERM does, with a shorter wait: seconds
# its clients get to answer connection.close 320 with close-ok. Short because tests stop a broker per test
# and a client that is not reading (a blocking client between calls) never answers.
STOP_GRACE = 0.5
