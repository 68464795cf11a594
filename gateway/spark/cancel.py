"""`delay-gateway cancel-table INPUT`: cancel the message of every id in a table, on Spark.

The counterpart of `schedule` (e.g. every reminder of the orders cancelled today): the same
inputs (CSV with a header line, JSON lines, Parquet), the same errors output (rejected rows
with `_reason` and `_detail`, in INPUT's format) and the same counts (read = published +
rejected + not_published). Each good row becomes one cancel published, with confirms, to
`<prefix>.cancel`, as any AMQP client cancels (docs/cancelling.md).

No resume record: a cancel is harmless to repeat, but it applies to every message with its
id published before it, so re-run a failed run before you reschedule any of its ids, not after.
"""

import argparse
import concurrent.futures
import functools
import json
import sys
import time
from dataclasses import dataclass
from typing import Any, Dict, List, Tuple

import structlog

from gateway.settings import Settings, UsageError, argument, integer
from gateway.spark import rows, table_job
from gateway.spark.publisher import Target
from gateway.spark.table_job import CORRUPT, DETAIL, LINE, REASON, TableOptions, quoted, read_input, write_json
from gateway.spark.table_job import write_rows

log = structlog.get_logger("cancel-table")

ID_MISSING = "message_id_missing"
REASONS = (rows.UNPARSEABLE, ID_MISSING, rows.ID_TOO_LONG)


@dataclass(frozen=True)
class Options(TableOptions):
    """cancel-table's own arguments (add_arguments below), typed."""

    message_id_column: str


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("input", metavar="INPUT", help="a CSV (with a header line), JSON lines or Parquet file, "
                   "directory or glob; any path Spark reads")
    p.add_argument("--format", choices=("csv", "json", "parquet"),
                   help="default: from INPUT's extension (.csv, .json/.jsonl/.ndjson, .parquet)")
    p.add_argument("--message-id-column", default="message_id", metavar="NAME",
                   help="the column of ids to cancel (default message_id)")
    p.add_argument("--errors", metavar="PATH", help="rejected rows, in INPUT's format, with _reason and _detail "
                   "(default: INPUT.errors)")
    p.add_argument("--summary", metavar="PATH", help="the summary as JSON (default: INPUT.summary.json)")
    p.add_argument("--confirm-window", type=argument(integer(1)), default=1000, metavar="N",
                   help="unconfirmed publishes per connection (default 1000)")
    p.add_argument("--rows-per-partition", type=argument(integer(1)), default=10_000, metavar="N",
                   help="rows per published partition (default 10000)")
    p.add_argument("--master", help="Spark master URL (default: spark-submit's, else local[*])")
    p.add_argument("--spark-conf", action="append", default=[], metavar="KEY=VALUE",
                   help="a Spark setting (repeatable)")


def run(settings: Settings, **own: Any) -> int:
    """`delay-gateway cancel-table`: `own` is its options."""
    args = Options(**own)
    started = table_job.start(settings, args, "cancel-table", lambda names: names.cancel)
    from gateway.spark import session

    spark, owned = started.spark, started.owned
    try:
        summary = cancel_table(spark, args, started.format, started.target)
    except UsageError:
        raise
    except Exception as exc:
        if session.said_spark_failed("cancel-table", exc):
            return 1
        raise
    finally:
        if owned:
            spark.stop()
    print(json.dumps(summary, indent=1))
    return 0 if summary["complete"] else 1


def cancel_table(spark, args: Options, fmt: str, target: Target) -> Dict[str, Any]:
    from pyspark.sql import Observation
    from pyspark.sql import functions as F
    started = time.monotonic()
    base = args.input.rstrip("/")
    errors_path, summary_path = args.errors or base + ".errors", args.summary or base + ".summary.json"
    df = read_input(spark, args.input, fmt)
    columns = [c for c in df.columns if c != CORRUPT]
    if args.message_id_column not in columns:
        raise UsageError(f"{args.input} has no column {args.message_id_column!r} (columns: {', '.join(columns)}): "
                         "name it with --message-id-column")
    mid = F.col(quoted(args.message_id_column)).cast("string")
    corrupt = F.col(CORRUPT) if CORRUPT in df.columns else F.lit(None).cast("string")
    reason = (F.when(corrupt.isNotNull(), F.lit(rows.UNPARSEABLE))
              .when(mid.isNull() | (mid == ""), F.lit(ID_MISSING))
              .when(F.octet_length(mid) > 255, F.lit(rows.ID_TOO_LONG)))
    detail = (F.when(corrupt.isNotNull(), F.concat(F.lit("the input line could not be parsed: "), F.substring(
                  corrupt, 1, 80)))
              .when(mid.isNull() | (mid == ""), F.lit(f"no id to cancel in column {args.message_id_column}"))
              .when(F.octet_length(mid) > 255, F.concat(F.lit("message id of "), F.octet_length(mid).cast("string"),
                                                        F.lit(" bytes: at most 255 (AMQP's message_id)"))))
    checked = df.select("*", mid.alias("__id"), reason.alias("__reason"), detail.alias("__detail")).persist()
    try:
        observation = Observation("cancel-table")
        observed = checked.observe(
            observation, F.count(F.lit(1)).alias("read"), F.count("__reason").alias("rejected"),
            *[F.sum(F.when(F.col("__reason") == r, 1).otherwise(0)).alias(r) for r in REASONS])
        kept = [F.col(quoted(c)) for c in columns] + ([F.col(CORRUPT).alias(LINE)] if CORRUPT in df.columns else [])
        errors = observed.filter(F.col("__reason").isNotNull()).select(
            *kept, F.col("__reason").alias(REASON), F.col("__detail").alias(DETAIL))
        spark.sparkContext.setJobDescription("cancel-table: check rows, write rejected rows")
        write_rows(errors, fmt, errors_path)
        got = observation.get
        read_n, rejected = int(got["read"]), int(got["rejected"])
        by_reason = {r: int(got[r] or 0) for r in REASONS}
        good = read_n - rejected
        partitions = max(1, -(-good // args.rows_per_partition))
        published, failures = 0, []  # type: Tuple[int, List[Tuple[int, str]]]
        if good:
            ids = checked.filter(F.col("__reason").isNull()).select("__id").repartition(partitions, "__id").rdd
            published, failures = publish(spark, ids, partitions, target)
    finally:
        checked.unpersist()
    summary: Dict[str, Any] = {
        "input": args.input, "format": fmt, "exchange": target.exchange, "read": read_n, "published": published,
        "rejected": rejected, "not_published": good - published,
        "rejected_by_reason": {k: v for k, v in by_reason.items() if v}, "partitions": partitions,
        "partitions_failed": len(failures), "errors": errors_path, "seconds": round(time.monotonic() - started, 3),
        "complete": good == published}
    if failures:
        summary["failure"] = f"{len(failures)} of {partitions} partitions failed; first: {failures[0][1]}"
        print(f"delay-gateway cancel-table: {summary['failure']}", file=sys.stderr)
    write_json(summary_path, summary)
    summary["summary"] = summary_path
    log.info("cancel_table_finished", **{k: summary[k] for k in ("read", "published", "rejected", "not_published")})
    return summary


def publish(spark, rdd, partitions: int, target: Target) -> Tuple[int, List[Tuple[int, str]]]:
    """Publish each partition's cancels (confirmed); (published, failed partitions)."""
    sc = spark.sparkContext
    func = functools.partial(publish_partition, target)
    failures: List[Tuple[int, str]] = []

    def one(p: int) -> int:
        sc.setJobDescription(f"cancel-table: publish partition {p + 1} of {partitions}")
        try:
            return sum(sc.runJob(rdd, func, [p]))
        except Exception as exc:  # a failed task: keep going with the others, report at the end
            from gateway.spark.session import one_line
            failures.append((p, one_line(exc)))
            return 0

    workers = max(1, min(partitions, sc.defaultParallelism))
    with concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="cancel") as pool:
        published = sum(pool.map(one, range(partitions)))
    return published, failures


def publish_partition(target: Target, items) -> List[int]:
    from gateway.spark.publisher import PartitionPublisher
    result = PartitionPublisher(target, iter(items), outgoing, "delay-gateway cancel-table").run()
    return [result.rows]


def outgoing(row) -> Tuple[str, bytes, Any]:
    import pika
    (message_id,) = row
    return "", b"", pika.BasicProperties(message_id=message_id, delivery_mode=2)
