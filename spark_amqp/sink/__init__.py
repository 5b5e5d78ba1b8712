"""The `amqp` sink: `df.write.format("amqp")` and `df.writeStream.format("amqp")` (docs/sink.md; its design: docs/design.md).

Modules: `columns` (which column is which part of a message; schema checks on the driver; property bytes
per row), `publisher` (the per-task publish loop with confirms, and its errors), `writer` (the PySpark
writer classes that `spark_amqp.datasource` hands out).
"""

from .columns import SinkSchemaError
from .publisher import SinkError

__all__ = ["SinkError", "SinkSchemaError"]
