"""What waits, as a Spark DataFrame: `delay-gateway pending export` writes it (CSV or JSON
lines), `waiting(spark, path)` reads it back with its types, the due time as a timestamp.

    from gateway.spark.pending import waiting
    frame = waiting(spark, "waiting.jsonl")
    frame.groupBy("routing_key", F.date_trunc("hour", "due").alias("hour")).count()
"""

from typing import Any

# the columns `pending export` writes (gateway/commands/pending.py: CSV_FIELDS), with their types
SCHEMA = ("message_id STRING, handle STRING, routing_key STRING, due_ms LONG, due STRING, size LONG, "
          "retry_attempt INT, retry_queue STRING, read_us LONG, message_id_base64 STRING, "
          "routing_key_base64 STRING")


def waiting(spark: Any, path: str) -> Any:
    """The export at `path` (.csv, or JSON lines) as a DataFrame; `due` is a UTC timestamp."""
    from pyspark.sql import functions as F

    reader = spark.read.schema(SCHEMA)
    frame = reader.option("header", True).option("multiLine", True).option("escape", '"').csv(path) \
        if path.endswith(".csv") else reader.json(path)
    return frame.withColumn("due", F.timestamp_millis("due_ms"))
