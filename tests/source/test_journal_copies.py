"""The journal's key of a message (journalPath, `spark_amqp.source.journal`) is the same for each of its
deliveries, as each broker sends them: a quorum queue adds delivery counts to the headers (RabbitMQ 3.10
`x-delivery-count` from the first delivery on, 4.x `x-delivery-count` and `x-acquired-count` on a
redelivery), and a copy whose key differed from its first delivery's would be read twice after a crash.
No Spark here: the deliveries' property bytes as the brokers send them, through the source's own client."""

from __future__ import annotations


import pika
import pytest

from brokers import ALL_BROKERS
from spark_amqp.client import Connection
from spark_amqp.source.journal import delivery_key
from waiting import wait_until

pytestmark = pytest.mark.parametrize("broker_url", ALL_BROKERS, indirect=True)

MESSAGES = [  # (body, properties): no message_id, so the key is the fingerprint of the property bytes
    (b"with-headers", pika.BasicProperties(content_type="text/plain", delivery_mode=2,
                                           headers={"a": 1, "b": "x", "z-last": True})),
    (b"no-headers", pika.BasicProperties(delivery_mode=2)),
    (b"empty-headers", pika.BasicProperties(delivery_mode=2, headers={})),
]


@pytest.mark.parametrize("queue_type", ["quorum", "classic"])
def test_every_delivery_of_a_message_has_the_journal_key_of_the_first(env, queue_type):
    q = env.quorum_queue("keys") if queue_type == "quorum" else env.queue("keys")
    ch = env.channel()
    for body, props in MESSAGES:
        ch.basic_publish("", q, body, props)
    keys: dict[bytes, list[bytes]] = {}
    raws: dict[bytes, set] = {}
    for attempt in range(3):       # taken unacked, and back to the queue as the connection closes
        wait_until(lambda: env.state(q) == (len(MESSAGES), 0), 15, interval=0.1,
                   message=f"the messages back in {q} before delivery {attempt + 1}")
        conn = Connection.open(env.url)
        try:
            got = [conn.channel().basic_get(q, timeout=5) for _ in MESSAGES]
        finally:
            conn.close()
        for d in got:
            assert d.redelivered == (attempt > 0)
            keys.setdefault(d.body, []).append(delivery_key(q, d, None))
            raws.setdefault(d.body, set()).add(d.properties_raw)
    if queue_type == "quorum":     # what is tested: the brokers change the property bytes between deliveries
        assert all(len(r) == 3 for r in raws.values()), raws
    assert {body: len(set(k)) for body, k in keys.items()} == {body: 1 for body, _ in MESSAGES}
    assert len({k[0] for k in keys.values()}) == len(MESSAGES)
