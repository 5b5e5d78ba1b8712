"""How much queue mode lets the broker push ahead, and how much one micro-batch takes: one pure function.

`bounds(...)` decides, from the source's options and what the broker and the messages so far said, the
prefetch per queue (spread over channels of at most PREFETCH_MAX each, basic.qos's limit) and how many
deliveries the next batch takes. The driver's `QueueConsumer` calls it when it connects and after every
batch it takes; it does no I/O, so every rule is unit-tested (tests/source/test_bounds.py).

The rules:

- The ceiling per queue: the `prefetch` option; else 2 x `maxMessagesPerTrigger` (at least 1,000); else
  DEFAULT_PREFETCH (RABBITMQ_DEFAULT_PREFETCH when the broker says it is RabbitMQ).
- Without the `prefetch` option the prefetch follows the messages' size: FIRST_PREFETCH until the first
  batch shows it (a sized start, so that 4 KB messages never arrive 200,000 at once), then two batches of
  `maxBytesPerTrigger` (at least 1,000, at most the ceiling). It moves only when it is off by more than a
  factor of two: each move restarts the consumers.
- A batch takes at most half the prefetch (while batch N waits for its commit, N+1's deliveries arrive),
  at most the read limit, and at most `maxBytesPerTrigger` of bodies by the mean size so far. A batch that
  fills part by part, each part acked as it arrives (`in_parts`: journalPath, availableNow), holds no more
  than a part unacked, so the prefetch does not bound it: PARTS_BATCH of rows does.
"""

from __future__ import annotations

from dataclasses import dataclass

# The most a basic.qos prefetch-count can say (a 16-bit field, spec 1.8.3.1). A larger prefetch is spread
# over several consuming channels on the same queue.
PREFETCH_MAX = 65535
# Default prefetch per queue: four channels of 50,000. A micro-batch takes at most half of it, so batches
# of up to 100,000 rows amortize Spark's fixed cost per micro-batch (about 0.35 s on local[2]), while the
# driver holds at most 200,000 deliveries (about 60 MB of 100-byte messages), whatever the backlog.
DEFAULT_PREFETCH = 200_000
# Default prefetch per queue on RabbitMQ (its `product` at connection.start): batches of up to 20,000.
# RabbitMQ's queue process does more work for every delivery held unacked, and the source holds each batch
# until its commit. Measured alternating, 1,000,000 x 100 B, availableNow, a classic queue: RabbitMQ 4.3
# read 29,245-30,838 msg/s with 40,000 and 23,772-26,049 with 200,000 (1.21x); RabbitMQ 3.10
# 29,944-30,144 against 30,965-32,390 (0.95x, within noise), a lazy queue on 3.10 a third faster.
RABBITMQ_DEFAULT_PREFETCH = 40_000
# Prefetch per queue until the first batch tells the messages' size (a sized start).
FIRST_PREFETCH = 2_000
# The least prefetch a fitted one goes down to, and the least the maxMessagesPerTrigger rule gives.
MIN_PREFETCH = 1_000
# The most rows of a batch that fills part by part: the batch the default prefetch gives elsewhere.
PARTS_BATCH = DEFAULT_PREFETCH // 2


@dataclass(frozen=True)
class Bounds:
    """What `bounds()` decided. `prefetch` is per queue, `ceiling` what it may rise to, `channels` how many
    consuming channels a queue gets (fixed for the connection: they are sized by the ceiling), `batch` the
    most deliveries the next batch takes."""
    prefetch: int
    ceiling: int
    channels: int
    batch: int


def ceiling(options, rabbitmq: bool) -> int:
    """The most prefetch per queue the options allow (see the module's rules)."""
    if options.get("prefetch"):
        return int(options["prefetch"])
    per_trigger = options.get("maxMessagesPerTrigger")
    if per_trigger:
        return max(2 * int(per_trigger), MIN_PREFETCH)
    return RABBITMQ_DEFAULT_PREFETCH if rabbitmq else DEFAULT_PREFETCH


def bounds(options, *, rabbitmq: bool, mean_size: float | None = None, current: int | None = None,
           sized_start: bool = True, max_rows: int | None = None, in_parts: bool = False) -> Bounds:
    """Driver. The prefetch per queue and the next batch's size.

    `options`: the parsed source options (`prefetch`, `maxMessagesPerTrigger`, `maxBytesPerTrigger`);
    `rabbitmq`: the broker said it is RabbitMQ; `mean_size`: the mean body size taken so far (None before
    the first delivery); `current`: the prefetch the consumers run with now (None before they start);
    `sized_start`: start at FIRST_PREFETCH until sizes are known (not for a reader whose first batch is the
    whole run: PySpark 4.0/4.1 under availableNow); `max_rows`: the read limit of this batch, if any;
    `in_parts`: the batch fills part by part, each part acked as it arrives."""
    top = ceiling(options, rabbitmq)
    batch_bytes = int(options.get("maxBytesPerTrigger") or 0) or None
    if options.get("prefetch"):
        prefetch = top
    elif mean_size is None or batch_bytes is None:
        prefetch = current or (min(top, FIRST_PREFETCH) if sized_start else top)
    else:
        fitted = max(MIN_PREFETCH, min(top, int(2 * batch_bytes // mean_size)))
        prefetch = current if current and current / 2 <= fitted <= current * 2 else fitted
    batch = PARTS_BATCH if in_parts else max(1, prefetch // 2)
    if max_rows:
        batch = min(batch, int(max_rows))
    if mean_size and batch_bytes:
        batch = max(1, min(batch, int(batch_bytes // mean_size)))
    return Bounds(prefetch=prefetch, ceiling=top, channels=-(-top // PREFETCH_MAX), batch=batch)
