"""The `amqp` data source: `spark.readStream/read.format("amqp")` and `writeStream/write.format("amqp")`.

Thin: it validates options (options.py) and hands out the reader and writer classes, which are thin in turn
over the AMQP client. Everything here is pickled to Python workers, so it holds only plain values.
"""

from __future__ import annotations

from pyspark.sql.datasource import DataSource

from . import options as opts
from .schema import SCHEMA


class AMQPDataSource(DataSource):
    """format("amqp"). Runs on the driver (planning) and is pickled to executors."""

    @classmethod
    def name(cls) -> str:
        return "amqp"

    def schema(self):
        """Driver, at `load()` (PySpark asks a Python source for its schema when the DataFrame is defined,
        and never for a write): the moment to report bad source options, before any query starts.

        Options valid for the sink pass here, in case a PySpark version asks on writes too; the reader
        and writer check their own role again. The error is raised from this frame, so that the
        traceback Spark prints inside its AnalysisException is one line, not a walk through options.py."""
        problem = None
        try:
            opts.parse(self.options, "source")
        except opts.OptionError as exc:
            problem = str(exc)
            try:
                opts.parse(self.options, "sink")
                problem = None
            except opts.OptionError:
                pass
        if problem:
            raise ValueError(f"amqp: {problem}")
        return SCHEMA

    def streamReader(self, schema):
        options = opts.parse(self.options, "source")
        if options["queueType"] == "stream":
            from .pyspark_versions import ADMISSION_CONTROL, VERSION
            from .source.stream_mode import StreamModeReader
            if not ADMISSION_CONTROL:
                raise ValueError(f"amqp: option 'queueType': got 'stream'; reading a stream queue as a stream "
                                 f"needs PySpark 4.2 or newer (this is {VERSION}); "
                                 "spark.read (a batch read of offset ranges) works here")
            return StreamModeReader(options)
        from .source.queue_mode import QueueStreamReader
        return QueueStreamReader(options)

    def reader(self, schema):
        options = opts.parse(self.options, "source")
        if options["queueType"] == "stream":
            from .source.stream_mode import StreamBatchReader
            return StreamBatchReader(options)
        from .source.batch_reader import QueueBatchReader
        return QueueBatchReader(options)

    def writer(self, schema, overwrite: bool):
        from .sink.writer import AMQPWriter
        return AMQPWriter(opts.parse(self.options, "sink"), schema)

    def streamWriter(self, schema, overwrite: bool):
        from .sink.writer import AMQPStreamWriter
        return AMQPStreamWriter(opts.parse(self.options, "sink"), schema)
