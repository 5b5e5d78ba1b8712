"""spark-amqp: the PySpark Structured Streaming connector for AMQP 0-9-1.

The source and sink arrive with issues 3 and 4; this package holds their shared pieces as they land.
"""

__version__ = "0.1.0"
