"""`delay-gateway schedule INPUT`: every row of a table becomes a delayed message.

The verb: its arguments, and its run in a Spark session. The job, on the driver
(schedule_job.py):
1. reads INPUT (CSV with a header line, JSON lines, or Parquet) and maps its columns to a
   message: routing key, payload, due time (a delay, a due time, or a Spark SQL
   expression), message id, headers (columns.py);
2. checks every row (`rows.check`, in a Python UDF) and writes the rejected ones, with
   `_reason` and `_detail`, to the errors output, counting rows as it goes (one pass;
   errors_output.py);
3. hash-partitions the good rows by message id into a number of partitions fixed for the
   run, and publishes each partition from an executor (schedule_task.py: one connection,
   windowed confirms), saying how far it got every few seconds (tally.py); each finished
   partition is recorded (progress.py), so a re-run after a failure publishes only the
   partitions that were not finished;
4. writes the summary (read = published + rejected) as JSON and prints it.
"""

import argparse
import json
from typing import Any

from gateway.settings import Settings, UsageError, argument, integer
from gateway.spark import table_job
from gateway.spark.schedule_job import Job, Options


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("input", metavar="INPUT", help="a CSV (with a header line), JSON lines or Parquet file, "
                   "directory or glob; any path Spark reads (hdfs://, s3a://, ...)")
    p.add_argument("--format", choices=("csv", "json", "parquet"),
                   help="default: from INPUT's extension (.csv, .json/.jsonl/.ndjson, .parquet)")
    out = p.add_argument_group("outputs")
    out.add_argument("--errors", metavar="PATH", help="rejected rows, in INPUT's format, with columns "
                     "_reason and _detail, and _line for lines that could not be parsed (a Spark output "
                     "directory; default: INPUT.errors)")
    out.add_argument("--summary", metavar="PATH", help="the summary as JSON (default: INPUT.summary.json)")
    out.add_argument("--state", metavar="DIR", help="the resume record: a re-run with the same input and "
                     "options publishes only what the last run did not finish (default: INPUT.state)")
    out.add_argument("--restart", action="store_true",
                     help="forget the resume record and publish every row again")
    cols = p.add_argument_group("columns (defaults: routing_key, payload, delay_ms or deliver_at, "
                                "message_id, headers)")
    cols.add_argument("--routing-key-column", metavar="NAME")
    cols.add_argument("--routing-key", metavar="KEY", help="one routing key for every row, instead of a column")
    cols.add_argument("--payload-column", metavar="NAME", help="the message body: text is sent as UTF-8, "
                      "binary as is, a struct, map or array as JSON")
    cols.add_argument("--payload-row", action="store_true", help="send the whole row as a JSON object")
    cols.add_argument("--delay-column", metavar="NAME", help="delay in ms, counted from the publish")
    cols.add_argument("--deliver-at-column", metavar="NAME",
                      help="due time: epoch ms, or a timestamp (or text Spark reads as one)")
    cols.add_argument("--due-expr", metavar="SQL", help="due time as a Spark SQL expression over the columns, "
                      "e.g. \"delivered_at + INTERVAL 7 DAYS\" (a timestamp, or epoch ms)")
    cols.add_argument("--message-id-column", metavar="NAME", help="default: message_id if there is one; "
                      "else a UUID made from the row's content (the same in every run)")
    cols.add_argument("--headers-column", metavar="NAME", help="extra headers, a JSON object per row")
    cols.add_argument("--content-type", metavar="TYPE", help="content type of every message (default: "
                      "application/json for JSON payloads, else none)")
    lim = p.add_argument_group("limits")
    lim.add_argument("--max-overdue-ms", type=argument(integer(0)), default=3_600_000, metavar="MS",
                     help="refuse rows due further in the past than this when the run started "
                          "(default 3600000: one hour; 0: none in the past)")
    lim.add_argument("--max-payload-bytes", type=argument(integer(0)), default=1_048_576, metavar="N",
                     help="refuse larger payloads (default 1048576)")
    pub = p.add_argument_group("publishing")
    pub.add_argument("--confirm-window", type=argument(integer(1)), default=1000, metavar="N",
                     help="unconfirmed publishes per connection (default 1000)")
    pub.add_argument("--max-rate", type=argument(integer(0)), default=0, metavar="ROWS_PER_S",
                     help="publish at most this many rows a second in all (default 0: no limit)")
    pub.add_argument("--rows-per-partition", type=argument(integer(1)), default=10_000, metavar="N",
                     help="rows per published partition, the unit of resuming and of progress (default 10000)")
    spark = p.add_argument_group("spark")
    spark.add_argument("--master", help="Spark master URL (default: spark-submit's, else local[*])")
    spark.add_argument("--spark-conf", action="append", default=[], metavar="KEY=VALUE",
                       help="a Spark setting (repeatable)")
    spark.add_argument("--progress-interval", type=float, default=5.0, metavar="SECONDS",
                       help="print progress this often (default 5; 0: off)")


# -- the command -------------------------------------------------------------------------------
def run(settings: Settings, **own: Any) -> int:
    """`delay-gateway schedule`: `own` is its options."""
    args = Options(**own)
    started = table_job.start(settings, args, "schedule", lambda names: names.check_in)
    from gateway.spark import session

    spark, owned = started.spark, started.owned
    # Without ANSI mode a value that does not convert (to_timestamp('soon') in --due-expr, a
    # cast) is null, and that row is rejected with its reason; with it, one bad row would
    # fail the whole job. Restored afterwards for a session that is not ours.
    ansi = spark.conf.get("spark.sql.ansi.enabled", None)
    spark.conf.set("spark.sql.ansi.enabled", "false")
    try:
        job = Job(spark, args, started.target)
        summary = job.run()
    except UsageError:
        raise
    except Exception as exc:
        if session.said_spark_failed("schedule", exc):
            return 1
        raise
    finally:
        if ansi is not None:
            spark.conf.set("spark.sql.ansi.enabled", ansi)
        if owned:
            spark.stop()
    print(json.dumps(summary, indent=1))
    return 0 if summary["complete"] else 1
