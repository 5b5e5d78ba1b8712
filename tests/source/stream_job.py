"""Streaming jobs in their own driver process, for tests that kill the driver (test_restart.py, test_faults.py).

    python stream_job.py (stream|availableNow) MAX_PER_TRIGGER SPECS_JSON

SPECS_JSON is a list of queries to run side by side in the one driver, each
`{"url", "queue", "checkpoint", "out", "options": {more source options}}` (one kill -9 then hits all of
them, on one JVM start: several brokers or modes are tested for the price of one driver). Each reads its
queue with `spark.readStream.format("amqp")` -- no `register` call, so it also proves that PySpark
discovers the `pyspark_amqp` module in a fresh process -- and writes each micro-batch's rows to
<out>/<run>-<batch id>.txt (one "body<TAB>redelivered" line per row, written to a temporary name and
renamed, so a file that exists is complete). `stream` runs until killed; `availableNow` drains the
queries one after another and exits 0.
"""

from __future__ import annotations

import json
import os
import sys
import time
import uuid


def main() -> int:
    mode, max_per_trigger, specs = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    os.environ["PYSPARK_PYTHON"] = sys.executable
    from pyspark.sql import SparkSession

    from spark_amqp.pyspark_versions import ADMISSION_CONTROL

    spark = (SparkSession.builder.master("local[2]").appName("stream-job")
             .config("spark.ui.enabled", "false").config("spark.sql.shuffle.partitions", "2")
             # PySpark 4.0 / 4.1: availableNow for a Python source only through Spark's wrapper (docs/source.md).
             .config("spark.sql.streaming.triggerAvailableNowWrapper.enabled", str(not ADMISSION_CONTROL).lower())
             .getOrCreate())
    spark.sparkContext.setLogLevel("ERROR")
    run = uuid.uuid4().hex[:8]

    def writer_for(spec):
        def write(df, batch_id):
            rows = df.collect()
            path = os.path.join(spec["out"], f"{run}-{batch_id}.txt")
            with open(path + ".tmp", "w") as f:
                for r in rows:
                    f.write(f"{bytes(r.body).decode()}\t{r.redelivered}\n")
            os.rename(path + ".tmp", path)
        df = (spark.readStream.format("amqp").option("uri", spec["url"]).option("queue", spec["queue"])
              .option("maxMessagesPerTrigger", max_per_trigger).options(**spec.get("options", {})).load())
        return df.writeStream.foreachBatch(write).option("checkpointLocation", spec["checkpoint"])

    writers = [writer_for(spec) for spec in specs]
    if mode != "availableNow":
        for w in writers:
            query = w.trigger(processingTime="300 milliseconds").start()
            # One after another: each query's source process must connect back to the JVM within Spark's
            # 10 s, and four starting at once on a loaded two-core machine made one miss it (CI, once).
            deadline = time.monotonic() + 20
            while query.isActive and query.lastProgress is None and time.monotonic() < deadline:
                time.sleep(0.1)
        spark.streams.awaitAnyTermination()
        return 1
    # The drains run one query after another: several availableNow queries started at once in one driver
    # failed now and then inside Spark (serializing a task closure), in CI only.
    for w in writers:
        while True:   # one run drains on PySpark >= 4.2; on 4.0/4.1 a run reads one batch: until one is empty
            query = w.trigger(availableNow=True).start()
            if not query.awaitTermination(120):
                print("availableNow run did not end in 120 s", flush=True)
                return 2
            if query.exception() is not None:
                print(f"query failed: {query.exception()}", flush=True)
                return 1
            if ADMISSION_CONTROL or not sum(p["numInputRows"] for p in query.recentProgress):
                break
    spark.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
