"""The errors output of `schedule`: the rejected rows, in INPUT's format, with `_reason` and
`_detail` (and `_line`, the text of a line that could not be parsed), and the counts of the
same pass: rows read, rejected, and rejected for each reason."""

from typing import Any, Dict

from gateway.spark import rows
from gateway.spark.table_job import CORRUPT, DETAIL, LINE, REASON, quoted, write_rows


def write_errors(spark, fmt: str, path: str, checked, m) -> Dict[str, Any]:
    """Write the rows of `checked` that have a reason to `path`; the counts, in the same pass."""
    from pyspark.sql import Observation
    from pyspark.sql import functions as F
    reason = F.col("__c.reason")
    observation = Observation("schedule")
    observed = checked.observe(
        observation, F.count(F.lit(1)).alias("read"), F.count(reason).alias("rejected"),
        *[F.sum(F.when(reason == r, 1).otherwise(0)).alias(r) for r in rows.REASONS])
    # The raw text of an unparseable line, under a name Spark does not itself treat as special
    # when the errors output is read back.
    kept = [F.col(quoted(c)) for c in m["columns"]] + ([F.col(CORRUPT).alias(LINE)] if m["corrupt"] else [])
    errors = observed.filter(reason.isNotNull()).select(
        *kept, reason.alias(REASON), F.col("__c.detail").alias(DETAIL))
    spark.sparkContext.setJobDescription("schedule: check rows, write rejected rows")
    write_rows(errors, fmt, path)
    got = observation.get
    return {"read": int(got["read"]), "rejected": int(got["rejected"]),
            "by_reason": {r: int(got[r] or 0) for r in rows.REASONS}}
