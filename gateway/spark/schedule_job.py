"""The `schedule` job, on the driver: read and map the table, check its rows, write the
rejected ones, publish the good ones partition by partition (resuming a run that failed),
and write the summary."""

import concurrent.futures
import functools
import math
import os
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any, Dict, Optional, Tuple

import structlog

from gateway.clock import wall_ms
from gateway.settings import UsageError
from gateway.spark import progress as progress_mod
from gateway.spark import rows
from gateway.spark.columns import checked_rows, column_mapping
from gateway.spark.errors_output import write_errors
from gateway.spark.publisher import Target
from gateway.spark.schedule_task import publish_partition
from gateway.spark.table_job import TableOptions, input_format, read_input, write_json
from gateway.spark.tally import ProgressLine, Tally

log = structlog.get_logger("schedule")


@dataclass(frozen=True)
class Options(TableOptions):
    """schedule's own arguments (gateway/spark/schedule.py add_arguments), typed."""

    state: Optional[str]
    restart: bool
    routing_key_column: Optional[str]
    routing_key: Optional[str]
    payload_column: Optional[str]
    payload_row: bool
    delay_column: Optional[str]
    deliver_at_column: Optional[str]
    due_expr: Optional[str]
    message_id_column: Optional[str]
    headers_column: Optional[str]
    content_type: Optional[str]
    max_overdue_ms: int
    max_payload_bytes: int
    max_rate: int
    progress_interval: float


def default_paths(args: Options) -> Tuple[str, str, str]:
    """Where the errors output, the summary and the resume record go (beside INPUT, unless given)."""
    base = args.input.rstrip("/")
    if "://" in base and not base.startswith("file://"):
        base = os.path.basename(base)  # summary and state live on the driver
    for ch in "*?[":
        base = base.replace(ch, "_")
    local = base[len("file://"):] if base.startswith("file://") else base
    return (args.errors or args.input.rstrip("/") + ".errors", args.summary or local + ".summary.json",
            args.state or local + ".state")


class Job:
    """One run of `schedule` on a Spark session: `run` returns the summary."""

    def __init__(self, spark, args: Options, target: Target) -> None:
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
        description = progress_mod.run_description(self.args, self.format, self.target, df, mapping)
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

        checked, self.content_type = checked_rows(df, mapping, limits, self.args)
        checked = checked.persist()
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

    def read(self):
        return read_input(self.spark, self.args.input, self.format)

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
