"""Python's cyclic garbage collector, tuned for the processes whose job is to hold many messages.

The embedded broker's process holds every queued and unacked message, and the streaming source's driver
process holds up to two batches of deliveries (200,000 by default) until their batch commits. Under the
default thresholds (700, 10, 10) their allocations trigger a young collection every 700 objects, and
promote enough objects for full collections that walk everything held: measured on 1,000,000 x 100 B
messages, that was 1.1-1.3 s of the source process's CPU (1.1-1.3 us of its 4.6 us per message, 11 full
collections) and 1.0-1.2 us of the broker's 3.8 us per message while it served the source's pattern (batches
acked a cycle late). Neither process makes cycles in its steady state, so collecting rarely loses nothing.
With these thresholds bench/read_throughput.py measured the broker at 2.9 us per message (was 3.8) and the
source process at 4.1 (was 4.6) with handoffPath, 157,109 msg/s against 145,830 (1,000,000 x 100 B).

Only these processes are tuned: a broker embedded in a thread of someone else's process (`EmbeddedBroker`)
and executors' Python workers (which run other code too) keep their defaults.
"""

from __future__ import annotations

import gc

# A young collection every 100,000 net allocations of container objects, the middle generation every 50 of
# those, the oldest every 100 of those (and then only when a quarter of it is new, as always).
THRESHOLDS = (100_000, 50, 100)


def for_message_holding_process() -> None:
    """Raise this process's collector thresholds to THRESHOLDS (never lower them)."""
    current = gc.get_threshold()
    gc.set_threshold(*(max(now, tuned) for now, tuned in zip(current, THRESHOLDS)))
