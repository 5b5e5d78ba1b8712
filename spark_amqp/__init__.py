"""spark-amqp: the PySpark Structured Streaming connector for AMQP 0-9-1 (RabbitMQ).

    spark.readStream.format("amqp").option("uri", ...).option("queue", "events").load()
    df.writeStream.format("amqp").option("uri", ...).option("exchange", "results").start()

`format("amqp")` works without registration (PySpark discovers the `pyspark_amqp` module);
`spark_amqp.register(spark)` registers the data source explicitly.
"""

__version__ = "0.1.0"


def register(spark) -> None:
    """Register the `amqp` data source with a SparkSession (needed only where discovery is off), and make
    Spark redact the `uri` option in query plans as it already redacts `url` and `password`."""
    from .datasource import AMQPDataSource
    try:
        spark.dataSource.register(AMQPDataSource)
    except Exception as exc:
        # PySpark 4.0 refuses to register a name it discovered already (4.1+ replaces it): it is there.
        if "DATA_SOURCE_ALREADY_EXISTS" not in str(exc):
            raise
    regex = spark.conf.get("spark.sql.redaction.options.regex", "(?i)url")
    if "uri" not in regex.lower():
        spark.conf.set("spark.sql.redaction.options.regex", f"{regex}|(?i)uri")
