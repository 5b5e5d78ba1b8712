"""`bounds.bounds()`: the prefetch per queue and the size of the next batch, from the options and what the
broker and the messages said. Pure: no broker here (the consumer's tests in test_large_batches.py check
what the brokers then send)."""

from __future__ import annotations

import pytest

from spark_amqp.options import parse
from spark_amqp.source.bounds import (DEFAULT_PREFETCH, FIRST_PREFETCH, MIN_PREFETCH, PARTS_BATCH, PREFETCH_MAX,
                                      RABBITMQ_DEFAULT_PREFETCH, bounds)

KB = 1024
MiB = 2**20


def opts(**given):
    return parse({"uri": "amqp://localhost", "queue": "q", **{k: str(v) for k, v in given.items()}}, "source")


@pytest.mark.parametrize("given, rabbitmq, ceiling, channels", [
    ({}, False, DEFAULT_PREFETCH, 4),                         # four channels of 50,000
    ({}, True, RABBITMQ_DEFAULT_PREFETCH, 1),
    ({"maxMessagesPerTrigger": 5000}, True, 10_000, 1),         # two batches, whatever the broker
    ({"maxMessagesPerTrigger": 10}, False, MIN_PREFETCH, 1),
    ({"prefetch": 70_000}, True, 70_000, 2),                   # the option, over two channels
    ({"prefetch": 70_000, "maxMessagesPerTrigger": 5000}, False, 70_000, 2),
])
def test_the_ceiling_and_channels_come_from_the_options_and_the_broker(given, rabbitmq, ceiling, channels):
    b = bounds(opts(**given), rabbitmq=rabbitmq, sized_start=False)
    assert (b.ceiling, b.channels, b.prefetch) == (ceiling, channels, ceiling)
    assert b.channels == -(-ceiling // PREFETCH_MAX)


def test_a_sized_start_begins_small_unless_the_prefetch_is_given():
    assert bounds(opts(), rabbitmq=False).prefetch == FIRST_PREFETCH
    assert bounds(opts(maxMessagesPerTrigger=200), rabbitmq=False).prefetch == MIN_PREFETCH   # below FIRST
    assert bounds(opts(prefetch=50_000), rabbitmq=False).prefetch == 50_000


def test_known_sizes_fit_the_prefetch_to_two_batches_of_max_bytes():
    # 4 KB messages, 64 MiB batches: 32,768; 100 B messages: the ceiling
    assert bounds(opts(), rabbitmq=False, mean_size=4 * KB, current=FIRST_PREFETCH).prefetch == 32_768
    assert bounds(opts(), rabbitmq=False, mean_size=100, current=FIRST_PREFETCH).prefetch == DEFAULT_PREFETCH
    assert bounds(opts(), rabbitmq=True, mean_size=100, current=FIRST_PREFETCH).prefetch == 40_000
    # never below MIN_PREFETCH, and a given prefetch is never fitted
    assert bounds(opts(), rabbitmq=False, mean_size=MiB, current=50_000).prefetch == MIN_PREFETCH
    assert bounds(opts(prefetch=5000), rabbitmq=False, mean_size=MiB, current=5000).prefetch == 5000


def test_the_prefetch_moves_only_when_off_by_more_than_a_factor_of_two():
    o = opts(maxBytesPerTrigger=4_000_000)          # 1 KB messages: 7,812 fits
    assert bounds(o, rabbitmq=False, mean_size=KB, current=5000).prefetch == 5000
    assert bounds(o, rabbitmq=False, mean_size=KB, current=15_000).prefetch == 15_000
    assert bounds(o, rabbitmq=False, mean_size=KB, current=3000).prefetch == 7812
    assert bounds(o, rabbitmq=False, mean_size=KB, current=20_000).prefetch == 7812
    # not consuming yet (no current): the sized start's or the fitted value
    assert bounds(o, rabbitmq=False, mean_size=KB).prefetch == 7812


def test_a_batch_takes_half_the_prefetch_the_read_limit_and_max_bytes_at_most():
    assert bounds(opts(), rabbitmq=False, sized_start=False).batch == 100_000
    assert bounds(opts(), rabbitmq=False, sized_start=False, max_rows=300).batch == 300
    assert bounds(opts(), rabbitmq=False, mean_size=100, current=DEFAULT_PREFETCH).batch == 100_000
    # 1 KB messages under 100,000 bytes: 97 a batch, whatever the prefetch
    o = opts(maxBytesPerTrigger=100_000)
    assert bounds(o, rabbitmq=False, mean_size=KB, current=1000).batch == 97
    assert bounds(o, rabbitmq=False, mean_size=KB, current=1000, max_rows=10).batch == 10
    assert bounds(opts(prefetch=1), rabbitmq=False).batch == 1


@pytest.mark.parametrize("given, mean, max_rows, batch", [
    ({}, 100, None, PARTS_BATCH),                                # not half of RabbitMQ's 40,000
    ({"maxBytesPerTrigger": 1 * MiB}, 100, None, 1 * MiB // 100),  # the bytes still bound it
    ({}, 100, 30_000, 30_000),                                   # and the read limit
    ({"prefetch": 1000}, None, None, PARTS_BATCH),               # and not a small prefetch either
])
def test_a_batch_filling_in_parts_is_not_bounded_by_the_prefetch(given, mean, max_rows, batch):
    """Each part of such a batch is acked as it arrives: the prefetch bounds what is unacked, not the batch."""
    b = bounds(opts(**given), rabbitmq=True, mean_size=mean, current=RABBITMQ_DEFAULT_PREFETCH, max_rows=max_rows,
               in_parts=True)
    assert b.batch == batch
    assert bounds(opts(**given), rabbitmq=True, mean_size=mean, current=RABBITMQ_DEFAULT_PREFETCH,
                  max_rows=max_rows).batch <= min(batch, b.prefetch // 2)
