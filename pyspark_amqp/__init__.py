"""Shim so that PySpark's discovery of top-level `pyspark_*` modules finds the `amqp` data source.

`DefaultSource` is bound here once the connector's DataSource exists (issue 4).
"""
