"""A streaming job in its own driver process, for tests that kill the driver (test_restart.py).

    python stream_job.py URL QUEUE CHECKPOINT OUTDIR (stream|availableNow) MAX_PER_TRIGGER

Reads QUEUE with `spark.readStream.format("amqp")` -- no `register` call, so it also proves that PySpark
discovers the `pyspark_amqp` module in a fresh process -- and writes each micro-batch's rows to
OUTDIR/<run>-<batch id>.txt (one "body<TAB>redelivered" line per row, written to a temporary name and
renamed, so a file that exists is complete). Prints "BATCH <id> <rows>" after each batch. `stream` runs
until killed; `availableNow` drains and exits 0.
"""

from __future__ import annotations

import os
import sys
import uuid


def main() -> int:
    url, queue, chk, outdir, mode, max_per_trigger = sys.argv[1:7]
    os.environ["PYSPARK_PYTHON"] = sys.executable
    from pyspark.sql import SparkSession

    from spark_amqp.source.stream_reader import ADMISSION_CONTROL

    spark = (SparkSession.builder.master("local[2]").appName("stream-job")
             .config("spark.ui.enabled", "false").config("spark.sql.shuffle.partitions", "2")
             # PySpark 4.0 / 4.1: availableNow for a Python source only through Spark's wrapper (README).
             .config("spark.sql.streaming.triggerAvailableNowWrapper.enabled", str(not ADMISSION_CONTROL).lower())
             .getOrCreate())
    spark.sparkContext.setLogLevel("ERROR")
    run = uuid.uuid4().hex[:8]

    def write(df, batch_id):
        rows = df.collect()
        path = os.path.join(outdir, f"{run}-{batch_id}.txt")
        with open(path + ".tmp", "w") as f:
            for r in rows:
                f.write(f"{bytes(r.body).decode()}\t{r.redelivered}\n")
        os.rename(path + ".tmp", path)
        print(f"BATCH {batch_id} {len(rows)}", flush=True)

    df = (spark.readStream.format("amqp").option("uri", url).option("queue", queue)
          .option("maxMessagesPerTrigger", max_per_trigger).load())
    writer = df.writeStream.foreachBatch(write).option("checkpointLocation", chk)
    if mode == "availableNow":
        while True:   # one run drains on PySpark >= 4.2; on 4.0/4.1 a run reads one batch: until one is empty
            query = writer.trigger(availableNow=True).start()
            if not query.awaitTermination(120):
                print("availableNow run did not end in 120 s", flush=True)
                return 2
            if ADMISSION_CONTROL or query.exception() is not None \
                    or not sum(p["numInputRows"] for p in query.recentProgress):
                break
    else:
        query = writer.trigger(processingTime="300 milliseconds").start()
        query.awaitTermination()
    if query.exception() is not None:
        print(f"query failed: {query.exception()}", flush=True)
        return 1
    spark.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
