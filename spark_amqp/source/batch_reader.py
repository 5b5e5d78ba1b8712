"""`spark.read.format("amqp")`: what the queues hold now, as a DataFrame.

`partitions()` (driver) counts each queue's ready messages; `read()` (executor, one task per queue)
consumes that many, yields them, and only then acks them (option `ack=true`) or, by default, closes its
channel so the broker puts them back (they come back with redelivered=true). Acking after the last row
has been handed to Spark is what "once the read completes" means here: a task that fails midway acks
nothing.
"""

from __future__ import annotations

from pyspark.sql.datasource import DataSourceReader, InputPartition

from ..client import Connection
from ..options import connect_kwargs
from . import arrow_rows
from .bounds import PREFETCH_MAX
from .consumer import QueueConsumer

# Seconds a read waits for the next delivery before it stops short of the count it planned (another
# consumer may have taken some).
IDLE_WAIT = 2.0


class QueueSlice(InputPartition):
    def __init__(self, queue: str, count: int):
        super().__init__(queue)
        self.queue = queue
        self.count = count


class QueueBatchReader(DataSourceReader):
    def __init__(self, options):
        self.options = options

    def partitions(self):
        """Driver. One partition per queue with messages, sized by what the queue holds now."""
        consumer = QueueConsumer(self.options)
        consumer.connect(consume=False)   # credentials, queue existence (declares if asked); no prefetch
        try:
            limit = self.options.get("maxMessages")
            parts = []
            for q in consumer.queues:
                count = q.channel.queue_declare(q.name, passive=True).message_count
                if limit is not None:
                    count = min(count, limit - sum(p.count for p in parts))
                if count > 0:
                    parts.append(QueueSlice(q.name, count))
            return parts
        finally:
            consumer.close()

    def read(self, partition: QueueSlice):
        """Executor. Consume up to `partition.count` messages, yield them, then ack or return them."""
        if not isinstance(partition, QueueSlice):
            return   # no queue had messages: PySpark plans one empty partition of its own
        o = self.options
        conn = Connection.open(o["uri"], **connect_kwargs(o))
        try:
            ch = conn.channel()
            ch.basic_qos(min(partition.count, PREFETCH_MAX))
            ch.basic_consume(partition.queue)
            remaining = partition.count
            last_tag = 0
            while remaining > 0:
                # Record batches of at most about JVM_BATCH_BYTES of bodies: 10,000 messages of 4 KB would
                # hand Spark's JVM 40 MB at once (see arrow_rows.JVM_BATCH_BYTES).
                got = ch.get_deliveries(min(remaining, arrow_rows.ROWS_PER_RECORD_BATCH), timeout=IDLE_WAIT,
                                        max_bytes=arrow_rows.JVM_BATCH_BYTES)
                if not got:
                    break
                remaining -= len(got)
                last_tag = got[-1].delivery_tag
                yield arrow_rows.to_record_batch([(partition.queue, got)])
            if last_tag and o.get("ack"):
                ch.basic_ack(last_tag, multiple=True)
            ch.close()       # without ack=true, closing returns the messages to the queue
        finally:
            conn.close()
