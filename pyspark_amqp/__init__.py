"""Shim so PySpark's discovery of top-level `pyspark_*` modules finds the `amqp` data source:
`format("amqp")` then works with no `register` call."""

from spark_amqp.datasource import AMQPDataSource as DefaultSource

__all__ = ["DefaultSource"]
