"""`format("amqp")` from a Spark Connect session (how Databricks and current Spark clusters run Python): a
local Connect server started with `SparkSession.builder.remote("local[2]")`, a batch read, and a streaming
read -> write, in a process of its own."""

import subprocess
import sys
from pathlib import Path

import pytest

JOB = Path(__file__).with_name("connect_job.py")


@pytest.mark.own_spark
def test_read_and_write_through_spark_connect_discovered_and_registered(tmp_path):
    pytest.importorskip("grpc", reason="Spark Connect needs pyspark[connect] (in the test extra)")
    proc = subprocess.run([sys.executable, str(JOB)], cwd=tmp_path, capture_output=True, text=True,
                          timeout=420)
    assert proc.returncode == 0 and "CONNECT OK" in proc.stdout, (proc.stdout[-2000:], proc.stderr[-4000:])
    for tag in ("discovered", "registered"):
        assert f"{tag}: stream read and write: 5 messages" in proc.stdout, proc.stdout[-2000:]
