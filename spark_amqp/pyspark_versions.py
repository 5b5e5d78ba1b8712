"""What the installed PySpark offers a Python data source: the one place that probes its version.

Imported on the driver and on executors alike. The connector supports PySpark 4.0 and newer; what differs:

- 4.2 added `pyspark.sql.streaming.datasource` (read limits and `Trigger.AvailableNow` for Python
  streaming sources, `ADMISSION_CONTROL`). Queue mode runs on older versions with a reader of its own
  (`LegacyQueueStreamReader`); stream mode as a stream needs it.
- 4.1 added `DataSourceStreamArrowWriter` (streaming writes in Arrow batches); 4.0's streaming writes get
  Rows.
"""

from __future__ import annotations

import pyspark

VERSION = pyspark.__version__

try:
    from pyspark.sql.streaming.datasource import ReadAllAvailable, ReadMaxRows, SupportsTriggerAvailableNow
    ADMISSION_CONTROL = True
except ImportError:   # PySpark 4.0 / 4.1
    ReadAllAvailable = ReadMaxRows = SupportsTriggerAvailableNow = None
    ADMISSION_CONTROL = False

try:
    from pyspark.sql.datasource import DataSourceStreamArrowWriter
except ImportError:   # PySpark 4.0
    DataSourceStreamArrowWriter = None


def default_read_limit(options):
    """Driver (PySpark >= 4.2): a streaming reader's `getDefaultReadLimit`: `maxMessagesPerTrigger` bounds
    each batch, else no limit."""
    n = options.get("maxMessagesPerTrigger")
    return ReadMaxRows(n) if n else ReadAllAvailable()


def max_rows(limit) -> int | None:
    """Driver (PySpark >= 4.2): the rows a `latestOffset(start, limit)` may plan, None for no limit."""
    return limit.max_rows if ReadMaxRows is not None and isinstance(limit, ReadMaxRows) else None


__all__ = ["default_read_limit", "max_rows", "VERSION", "ADMISSION_CONTROL", "ReadAllAvailable", "ReadMaxRows", "SupportsTriggerAvailableNow",
           "DataSourceStreamArrowWriter"]
