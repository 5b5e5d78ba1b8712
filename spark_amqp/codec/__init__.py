"""The sans-I/O AMQP 0-9-1 codec that both the broker and the client use (nothing here opens a socket).

It imports only pamqp and the standard library, so the embedded broker (`spark_amqp_broker`) can use it
without the connector, and the connector without the broker.

| module        | what it holds                                                                        |
|---------------|--------------------------------------------------------------------------------------|
| `replies`     | reply codes (spec 1.2 constants) and `AMQPError`, the one error a codec step raises    |
| `frames`      | frame constants, `FrameReader` (stream -> frames), method and content frame writers    |
| `methods`     | pamqp (un)marshalling, and the hand-written per-message pairs: publish, deliver, ack  |
| `properties`  | the basic-class property table, raw split/join, the property encoder and decoder     |
| `fields`      | field tables kept raw (name, tagged value) and Python values encoded as RabbitMQ does |

Where a path is written by hand instead of through pamqp, `bench/codec_hot_paths.py` measures the gain in
the same run, and `methods`' docstring quotes it.
"""
