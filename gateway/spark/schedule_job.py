"""`delay-gateway schedule INPUT`: every row of a table becomes a delayed message.

The job, on the driver:
1. reads INPUT (CSV with a header line, JSON lines, or Parquet) and maps its columns to a
   message: routing key, payload, due time (a delay, a due time, or a Spark SQL
   expression), message id, headers;
2. checks every row (`rows.check`, in a Python UDF) and writes the rejected ones, with
   `_reason` and `_detail`, to the errors output, counting rows as it goes (one pass);
3. hash-partitions the good rows by message id into a number of partitions fixed for the
   run, and publishes each partition from an executor (one connection, windowed
   confirms); each finished partition is recorded (progress.py), so a re-run after a
   failure publishes only the partitions that were not finished;
4. writes the summary (read = published + rejected) as JSON and prints it.
"""

import argparse
import concurrent.futures
import functools
import json
import math
import os
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

import structlog

from gateway.clock import wall_ms
from gateway.settings import UsageError, argument, integer
from gateway.urls import redact
from gateway.spark import progress as progress_mod
from gateway.spark import rows, table_job
from gateway.spark.publisher import Target
from gateway.spark.table_job import CORRUPT, DETAIL, LINE, REASON, input_format, quoted, read_input, write_json, \
    write_rows

log = structlog.get_logger("schedule")

DEFAULTS = dict(routing_key_column="routing_key", payload_column="payload", delay_column="delay_ms",
                deliver_at_column="deliver_at", message_id_column="message_id", headers_column="headers")


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
def run(args: argparse.Namespace) -> int:
    started = table_job.start(args, "schedule", lambda names: names.check_in)
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


def default_paths(args) -> Tuple[str, str, str]:
    base = args.input.rstrip("/")
    if "://" in base and not base.startswith("file://"):
        base = os.path.basename(base)  # summary and state live on the driver
    for ch in "*?[":
        base = base.replace(ch, "_")
    local = base[len("file://"):] if base.startswith("file://") else base
    return (args.errors or args.input.rstrip("/") + ".errors", args.summary or local + ".summary.json",
            args.state or local + ".state")


# -- the job ----------------------------------------------------------------------------------
@dataclass
class Tally:
    """What the publishing threads report to the progress printer."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    published: int = 0
    partitions: int = 0
    seconds: float = 0.0  # of the publishing phase
    failures: List[Tuple[int, str]] = field(default_factory=list)


def column_mapping(a, df) -> Dict[str, Any]:
    """Which column is what; a named column that is not there is a usage error."""
    columns = [c for c in df.columns if c != CORRUPT]

    def pick(flag: str, required: bool = False) -> Optional[str]:
        given = getattr(a, flag)
        name = given or DEFAULTS[flag]
        if name in columns:
            return name
        if given or required:
            option = "--" + flag.replace("_", "-")
            raise UsageError(f"{a.input} has no column {name!r} (columns: {', '.join(columns)}): "
                             f"name it with {option}" + (", or give --routing-key" if flag.startswith(
                                 "routing") else ", or send whole rows with --payload-row" if flag.startswith(
                                 "payload") else ""))
        return None

    m: Dict[str, Any] = {"columns": columns, "corrupt": CORRUPT in df.columns}
    m["routing_key"] = None if a.routing_key is not None else pick("routing_key_column", True)
    m["payload"] = None if a.payload_row else pick("payload_column", True)
    m["message_id"] = pick("message_id_column")
    m["headers"] = pick("headers_column")
    if a.due_expr:
        if a.delay_column or a.deliver_at_column:
            raise UsageError("--due-expr replaces --delay-column and --deliver-at-column: give one")
        m["delay"] = m["deliver_at"] = None
    else:
        m["delay"], m["deliver_at"] = pick("delay_column"), pick("deliver_at_column")
        if m["delay"] is None and m["deliver_at"] is None:
            raise UsageError(f"{a.input} has neither a delay_ms nor a deliver_at column (columns: "
                             f"{', '.join(columns)}): name one with --delay-column or --deliver-at-column, "
                             "or give --due-expr")
    return m


def run_description(a, fmt: str, target: Target, df, m) -> Dict[str, Any]:
    """What decides which rows become which messages: a change means another run."""
    files = []
    for path in sorted(df.inputFiles()):
        local = path[len("file:"):] if path.startswith("file:") else path
        try:
            st = os.stat(local)
            files.append([path, st.st_size, st.st_mtime_ns])
        except OSError:
            files.append([path])
    options = {k: getattr(a, k) for k in ("routing_key", "payload_row", "due_expr", "content_type",
                                            "max_overdue_ms", "max_payload_bytes", "rows_per_partition")}
    hosts = sorted(redact(u) for u in target.urls)
    return {"format": fmt, "files": files, "mapping": m, "options": options,
            "exchange": target.exchange, "brokers": hosts}


# -- errors ------------------------------------------------------------------------------------
def write_errors(spark, fmt: str, path: str, checked, m) -> Dict[str, Any]:
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


class ProgressLine:
    """Says every `interval` seconds (and once at the end) how far publishing got."""

    def __init__(self, interval: float, tally: Tally, total: int, parts: int) -> None:
        self.interval, self.tally, self.total, self.parts = interval, tally, total, parts
        self.started = time.monotonic()

    def every_interval(self, stop: threading.Event) -> None:
        if self.interval <= 0:
            return
        while not stop.wait(self.interval):
            self.say()

    def say(self) -> None:
        if self.interval <= 0:
            return
        tally, total, parts = self.tally, self.total, self.parts
        with tally.lock:
            published, done, failed = tally.published, tally.partitions, len(tally.failures)
        elapsed = time.monotonic() - self.started
        rate = published / elapsed if elapsed > 0 else 0.0
        left = f", about {int((total - published) / rate)} s left" if rate > 0 and published < total else ""
        share = 100 * published // total if total else 100
        print(f"schedule: published {published:,} of {total:,} rows ({share} %), {done} of {parts} partitions"
              f"{f', {failed} failed' if failed else ''}, {rate:,.0f} rows/s{left}", file=sys.stderr, flush=True)
        log.info("schedule_progress", published=published, total=total, partitions_done=done,
                 partitions=parts, failed=failed, rows_per_second=round(rate))


class Job:
    def __init__(self, spark, args, target: Target) -> None:
        self.spark, self.args, self.target = spark, args, target
        self.errors_path, self.summary_path, self.state_dir = default_paths(args)
        self.format = input_format(args)
        self.content_type = args.content_type

    def run(self) -> Dict[str, Any]:
        from pyspark.sql import functions as F
        started = time.monotonic()
        df = self.read()
        mapping = column_mapping(self.args, df)
        state = progress_mod.Progress(self.state_dir)
        description = run_description(self.args, self.format, self.target, df, mapping)
        fp = progress_mod.fingerprint(description)
        previous = None if self.args.restart else state.run()
        if previous is not None and previous.get("fingerprint") != fp:
            raise UsageError(f"--state {self.state_dir} holds the progress of another run (the input or the "
                             "options differ): pass --restart to publish everything again, or another --state")
        resuming = previous is not None
        now_ms = previous["started_at_ms"] if previous is not None else wall_ms()
        if not resuming:
            state.begin({"fingerprint": fp, "started_at_ms": now_ms, "run": description})
        limits = rows.Limits(now_ms, self.args.max_overdue_ms, self.args.max_payload_bytes)
        log.info("schedule_started", input=self.args.input, format=self.format, exchange=self.target.exchange,
                 resuming=resuming, state=self.state_dir, spark_ui=self.spark.sparkContext.uiWebUrl)

        checked = self.check(df, mapping, limits).persist()
        try:
            counts = write_errors(self.spark, self.format, self.errors_path, checked, mapping)
            log.info("schedule_checked", read=counts["read"], rejected=counts["rejected"], errors=self.errors_path,
                     seconds=round(time.monotonic() - started, 3))
            good = counts["read"] - counts["rejected"]
            partitions = (previous or {}).get("partitions") or max(
                1, math.ceil(good / self.args.rows_per_partition), self.parallelism() if good else 1)
            state.update(partitions=partitions, read=counts["read"], rejected=counts["rejected"])
            done_before = state.done()
            resumed = sum(done_before.values())
            tally = Tally()
            if good and len(done_before) < partitions:
                publish_df = checked.filter(F.col("__c.reason").isNull()).select(
                    # in the order `outgoing` unpacks
                    F.col("__rk").alias("routing_key"), F.col("__body").alias("body"),
                    F.col("__c.message_id").alias("message_id"), F.col("__c.deliver_at_ms").alias("deliver_at_ms"),
                    F.col("__c.delay_ms").alias("delay_ms"), F.col("__c.headers").alias("headers")
                ).repartition(partitions, "message_id")
                self.publish(publish_df.rdd, partitions, done_before, good - resumed, state, tally)
        finally:
            checked.unpersist()
        published = resumed + tally.published
        not_published = good - published
        summary = {
            "input": self.args.input, "format": self.format, "exchange": self.target.exchange,
            "read": counts["read"], "published": published, "rejected": counts["rejected"],
            "not_published": not_published,
            "resumed": resumed, "published_this_run": tally.published,
            "rejected_by_reason": {k: v for k, v in counts["by_reason"].items() if v},
            "partitions": partitions, "partitions_resumed": len(done_before),
            "partitions_failed": len(tally.failures),
            "errors": self.errors_path, "state": self.state_dir,
            "started_at_ms": now_ms, "seconds": round(time.monotonic() - started, 3),
            # confirmed rows per second while publishing (reading and checking come before)
            "publish_seconds": round(tally.seconds, 3),
            "rows_per_second": round(tally.published / tally.seconds) if tally.seconds else 0,
            "complete": not_published == 0,
        }
        if tally.failures:
            summary["failure"] = (f"{len(tally.failures)} of {partitions} partitions failed; first: "
                                  f"{tally.failures[0][1]}. Re-run the same command to publish them: finished "
                                  "partitions are not published again")
        state.update(complete=summary["complete"], summary=summary)
        write_json(self.summary_path, summary)
        summary["summary"] = self.summary_path
        log.info("schedule_finished", **{k: summary[k] for k in ("read", "published", "rejected", "resumed",
                                                                  "not_published", "seconds")})
        if tally.failures:
            print(f"delay-gateway schedule: {summary['failure']}", file=sys.stderr)
        return summary

    def parallelism(self) -> int:
        return max(1, self.spark.sparkContext.defaultParallelism)

    # -- reading and mapping --------------------------------------------------------------------
    def read(self):
        return read_input(self.spark, self.args.input, self.format)

    def check(self, df, m, limits: rows.Limits):
        from pyspark.sql import functions as F
        from pyspark.sql import types as T
        cols = m["columns"]
        row_json = F.to_json(F.struct(*[F.col(quoted(c)) for c in cols]))
        content_type = self.content_type

        if m["routing_key"]:
            rk = F.col(quoted(m["routing_key"])).cast("string")
        else:
            rk = F.lit(self.args.routing_key)
        is_json = False
        if m["payload"] is None:
            body, is_json = row_json.cast("binary"), True
        else:
            kind = df.schema[m["payload"]].dataType
            col = F.col(quoted(m["payload"]))
            if isinstance(kind, T.BinaryType):
                body = col
            elif isinstance(kind, (T.StructType, T.MapType, T.ArrayType)):
                body, is_json = F.to_json(col).cast("binary"), True
            else:
                body = col.cast("string").cast("binary")
        body = F.coalesce(body, F.lit(bytearray()))  # no payload: an empty body
        self.content_type = content_type or ("application/json" if is_json else None)

        if self.args.due_expr:
            try:
                expr = F.expr(self.args.due_expr)
                kind = df.select(expr.alias("x")).schema["x"].dataType
            except Exception as exc:  # a parse or analysis error
                from gateway.spark.session import one_line
                raise UsageError(f"--due-expr {self.args.due_expr!r}: {one_line(exc)}") from None
            at_raw, at_ts = _as_due(expr, kind)
            delay_raw = F.lit(None).cast("string")
        else:
            delay_raw = F.col(quoted(m["delay"])).cast("string") if m["delay"] else F.lit(None).cast("string")
            if m["deliver_at"]:
                at_raw, at_ts = _as_due(F.col(quoted(m["deliver_at"])), df.schema[m["deliver_at"]].dataType)
            else:
                at_raw, at_ts = F.lit(None).cast("string"), F.lit(None).cast("long")
        mid = F.col(quoted(m["message_id"])).cast("string") if m["message_id"] else F.lit(None).cast("string")
        if m["headers"]:
            hk = df.schema[m["headers"]].dataType
            hcol = F.col(quoted(m["headers"]))
            headers = F.to_json(hcol) if isinstance(hk, (T.StructType, T.MapType)) else hcol.cast("string")
        else:
            headers = F.lit(None).cast("string")
        corrupt = F.col(CORRUPT) if m["corrupt"] else F.lit(None).cast("string")

        result = T.StructType([
            T.StructField("reason", T.StringType()), T.StructField("detail", T.StringType()),
            T.StructField("message_id", T.StringType()), T.StructField("deliver_at_ms", T.LongType()),
            T.StructField("delay_ms", T.LongType()), T.StructField("headers", T.StringType())])
        udf = F.udf(functools.partial(_check_row, limits, bool(self.args.due_expr)), result, useArrow=False)
        checked = df.select(
            "*", rk.alias("__rk"), body.alias("__body"),
            udf(rk, F.octet_length(body), delay_raw, at_raw, at_ts, mid, headers,
                F.when(mid.isNull(), row_json), corrupt).alias("__c"))
        return checked

    # -- publishing --------------------------------------------------------------------------------
    def publish(self, rdd, partitions: int, done_before: Dict[int, int], to_publish: int,
                state: progress_mod.Progress, tally: Tally) -> None:
        sc = self.spark.sparkContext
        todo = [p for p in range(partitions) if p not in done_before]
        workers = min(self.parallelism(), len(todo))
        rate = self.args.max_rate / workers if self.args.max_rate else 0.0
        target = Target(self.target.urls, self.target.exchange, self.target.tls, self.target.window, rate)
        func = functools.partial(publish_partition, target, self.content_type)
        started = time.monotonic()
        stop = threading.Event()
        progress = ProgressLine(self.args.progress_interval, tally, to_publish, len(todo))
        printer = threading.Thread(target=progress.every_interval, args=(stop,), daemon=True)
        printer.start()

        def one(p: int) -> None:
            sc.setJobDescription(f"schedule: publish partition {p + 1} of {partitions}")
            try:
                result = sc.runJob(rdd, func, [p])
            except Exception as exc:  # a failed task: keep going with the others, report at the end
                from gateway.spark.session import one_line
                message = one_line(exc)
                log.error("schedule_partition_failed", partition=p, error=message)
                with tally.lock:
                    tally.failures.append((p, message))
                return
            count = sum(r[0] for r in result)
            seconds = max((r[1] for r in result), default=0.0)
            state.mark(p, count, seconds)
            with tally.lock:
                tally.published += count
                tally.partitions += 1
            log.debug("schedule_partition_done", partition=p, rows=count, seconds=round(seconds, 3))

        try:
            with concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="publish") as pool:
                list(pool.map(one, todo))
        finally:
            tally.seconds = time.monotonic() - started
            stop.set()
            printer.join()
            progress.say()

def _check_row(limits, due_expr, rk, size, delay, at, at_ts, mid, headers, row_json, corrupt):
    c = rows.check(rk, size, delay, at, at_ts, mid, headers, row_json, corrupt, limits, due_expr)
    return (c.reason, c.detail, c.message_id, c.deliver_at_ms, c.delay_ms, c.headers)


def _as_due(col, kind):
    """(raw text, epoch ms if it reads as a timestamp) of a due-time column or expression."""
    from pyspark.sql import functions as F
    from pyspark.sql import types as T
    raw = col.cast("string")
    if isinstance(kind, (T.TimestampType, T.TimestampNTZType, T.DateType)):
        return raw, F.unix_millis(col.cast("timestamp"))
    if isinstance(kind, T.StringType):
        return raw, F.unix_millis(F.try_to_timestamp(col))
    if isinstance(kind, T.NumericType):
        return raw, F.lit(None).cast("long")
    raise UsageError(f"the due time is of type {kind.simpleString()}: expected epoch ms or a timestamp")


# -- on the executors ------------------------------------------------------------------------------
def publish_partition(target: Target, content_type: Optional[str], items):
    """One Spark task: publish a partition's rows, return [(rows confirmed, seconds)]."""
    from gateway.spark.publisher import PartitionPublisher
    make = functools.partial(outgoing, content_type)
    result = PartitionPublisher(target, iter(items), make).run()
    return [(result.rows, result.seconds)]


def outgoing(content_type: Optional[str], row):
    """A row of the publishing DataFrame as (routing key, body, properties), due time fixed now."""
    import pika
    # Unpacked by position: a Row's by-name access costs more than the rest of this function.
    routing_key, body, message_id, deliver_at_ms, delay_ms, headers = row
    now = wall_ms()
    due = deliver_at_ms if deliver_at_ms is not None else now + max(delay_ms, 0)  # rows.due_at
    properties = pika.BasicProperties(
        delivery_mode=2, message_id=message_id, timestamp=now // 1000,
        headers=rows.message_headers(headers, due), content_type=content_type)
    return routing_key, bytes(body), properties
