"""The connector over TLS: a stream read and a write through `amqps://` to the embedded broker's TLS listener
(fixtures `amqps_broker`, `amqps_url`, `amqps_ca_file` from our pytest plugin), and a certificate problem
failing the query with an error that names the option to fix."""

from __future__ import annotations

import pytest

from source_helpers import Collector, checkpoint
from spark_amqp.client import Connection
from spark_amqp.client.tls import TLSOptions

pytest.importorskip("trustme")


@pytest.fixture(params=["embedded", "rabbitmq"])
def tls_target(request):
    """(amqps URL, CA file) of the embedded broker's TLS listener, or of a RabbitMQ node with TLS."""
    if request.param == "rabbitmq":
        node = request.getfixturevalue("rabbitmq_tls")
        return node.url, node.ca_file
    return request.getfixturevalue("amqps_url"), request.getfixturevalue("amqps_ca_file")


def test_stream_read_and_write_over_tls(spark, tls_target, tmp_path, unique_name):
    amqps_url, amqps_ca_file = tls_target
    q_in, q_out = unique_name("tls-in"), unique_name("tls-out")
    with Connection.open(amqps_url, tls=TLSOptions(ca=amqps_ca_file)) as conn:
        ch = conn.channel()
        ch.queue_declare(q_in, auto_delete=False, arguments={"x-expires": 600_000})
        ch.queue_declare(q_out, auto_delete=False, arguments={"x-expires": 600_000})
        ch.confirm_select()
        for i in range(20):
            ch.publish("", q_in, f"m{i}".encode())
        ch.wait_for_confirms(timeout=10)

    sink = Collector()
    query = (spark.readStream.format("amqp").option("uri", amqps_url).option("tls.caFile", amqps_ca_file)
             .option("queue", q_in).load()
             .writeStream.foreachBatch(sink).option("checkpointLocation", checkpoint(tmp_path, "read"))
             .trigger(availableNow=True).start())
    assert query.awaitTermination(90) and query.exception() is None
    assert sorted(sink.bodies()) == sorted(f"m{i}".encode() for i in range(20))

    (spark.createDataFrame([(f"r{i}",) for i in range(10)], "body string")
     .write.format("amqp").mode("append").option("uri", amqps_url).option("tls.caFile", amqps_ca_file)
     .option("routingKey", q_out).save())
    with Connection.open(amqps_url, tls=TLSOptions(ca=amqps_ca_file)) as conn:
        assert conn.channel().queue_declare(q_out, passive=True).message_count == 10


def test_an_untrusted_broker_certificate_fails_the_query_naming_the_option(spark, amqps_url, tmp_path):
    # No tls.caFile: the system's CAs do not know the test CA.
    query = (spark.readStream.format("amqp").option("uri", amqps_url).option("queue", "tls-in").load()
             .writeStream.format("noop").option("checkpointLocation", checkpoint(tmp_path))
             .trigger(availableNow=True).start())
    with pytest.raises(Exception) as err:
        query.awaitTermination(60)
    assert "tls.caFile" in str(err.value) and "does not trust" in str(err.value)
