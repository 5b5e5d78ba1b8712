"""`spark_amqp.super_stream` without Spark: the partition choice against RabbitMQ's stream clients' own test
vectors, and `find_partitions` against the embedded broker.

The reference values, copied from the clients' tests:

- rabbitmq/rabbitmq-stream-java-client, src/test/java/com/rabbitmq/stream/impl/HashUtilsTest.java (commit
  33f3f5d4): MurmurHash3 x86 32-bit of a string's UTF-8 bytes as an unsigned integer, with the seed of the
  client's HashRoutingMurmurStrategy (104729, `murmur3WithDefaultSeed`) and with seed 42 (`murmur3WithSeed`);
- rabbitmq/rabbitmq-stream-go-client, pkg/stream/super_stream_producer_test.go (commit 541aa9d9), table
  "Partitioning using Murmur3" ("the table is the same for .NET, Python, Java stream clients"; the Java
  client's HashRoutingStrategyTest has the same routes for hello1..hello10): the partition of keys
  hello1..hello10 and hello88 among invoices-01, invoices-02, invoices-03.
"""

from __future__ import annotations

import mmh3
import pytest

from spark_amqp import options as opts
from spark_amqp.client import Connection
from spark_amqp.super_stream import (HASH_SEED, SuperStreamNotFound, find_partitions, partition_index,
                                     partition_streams)

JAVA_HASHES_SEED_104729 = {"hello": 1321743225, "brave": 3825276426, "new": 2970740106, "world": 2453398188}
JAVA_HASHES_SEED_42 = {"hello": 3806057185, "brave": 619588758, "new": 1483300585, "world": 1145629360}
GO_ROUTES = {"hello2": "invoices-01", "hello1": "invoices-02", "hello3": "invoices-02", "hello4": "invoices-03",
             "hello5": "invoices-01", "hello6": "invoices-03", "hello7": "invoices-01", "hello8": "invoices-02",
             "hello9": "invoices-01", "hello10": "invoices-03", "hello88": "invoices-02"}
INVOICES = ["invoices-01", "invoices-02", "invoices-03"]


def test_the_hash_is_the_java_clients_murmur3_with_its_seed():
    assert HASH_SEED == 104729
    for key, expected in JAVA_HASHES_SEED_104729.items():
        assert mmh3.hash(key.encode("utf-8"), HASH_SEED, signed=False) == expected, key
    for key, expected in JAVA_HASHES_SEED_42.items():      # the same function at another seed
        assert mmh3.hash(key.encode("utf-8"), 42, signed=False) == expected, key
    for key, expected in JAVA_HASHES_SEED_104729.items():
        assert partition_index(key, 7) == expected % 7


def test_rows_go_to_the_partitions_the_go_and_java_clients_route_them_to():
    for key, partition in GO_ROUTES.items():
        assert INVOICES[partition_index(key, 3)] == partition, key
    assert partition_streams(list(GO_ROUTES), INVOICES) == list(GO_ROUTES.values())


def test_a_key_is_hashed_as_its_utf8_bytes():
    assert partition_index("Zürich-€", 1000) == mmh3.hash("Zürich-€".encode("utf-8"), 104729, signed=False) % 1000


# ------------------------------------------------------------------------------------ find_partitions


@pytest.fixture
def conn(amqp_broker):
    with Connection.open(amqp_broker.url) as c:
        yield c


def streams(conn, *names):
    ch = conn.channel()
    for name in names:
        ch.queue_declare(name, durable=True, arguments={"x-queue-type": "stream"})
    ch.close()


def options(url, **extra):
    return opts.parse({"uri": url, "superStream": "orders", **extra}, "sink")


def test_partitions_are_found_by_the_naming_convention_up_to_the_first_missing(conn, amqp_broker):
    streams(conn, "orders-0", "orders-1", "orders-2", "orders-4")     # orders-3 missing: orders-4 is not one
    assert find_partitions(conn, options(amqp_broker.url)) == ["orders-0", "orders-1", "orders-2"]
    streams(conn, "orders-3")                                           # added later: found at the next call
    assert find_partitions(conn, options(amqp_broker.url)) == ["orders-0", "orders-1", "orders-2", "orders-3",
                                                               "orders-4"]


def test_listed_partitions_are_taken_in_the_listed_order(conn, amqp_broker):
    streams(conn, "orders-eu", "orders-us", "orders-ap")
    listed = options(amqp_broker.url, superStreamPartitions="orders-us,orders-eu,orders-ap")
    assert find_partitions(conn, listed) == ["orders-us", "orders-eu", "orders-ap"]


def test_a_missing_super_stream_is_an_error_naming_it_and_the_option(conn, amqp_broker):
    with pytest.raises(SuperStreamNotFound) as err:
        find_partitions(conn, options(amqp_broker.url))
    msg = str(err.value)
    assert "super stream 'orders' not found" in msg and "no stream 'orders-0'" in msg
    assert "superStreamPartitions" in msg and "add_super_stream orders" in msg
    assert "guest:guest" not in msg

    streams(conn, "orders-eu")
    with pytest.raises(SuperStreamNotFound) as err:
        find_partitions(conn, options(amqp_broker.url, superStreamPartitions="orders-eu,orders-us"))
    msg = str(err.value)
    assert "super stream 'orders'" in msg and "orders-us listed in superStreamPartitions not found" in msg
    assert conn.channel().is_open                                       # the connection survived the 404s
