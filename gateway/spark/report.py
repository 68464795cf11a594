"""`delay-gateway report RECORDS`: delivery analytics, on Spark, from `record`'s lines.

Lateness is arrival time minus due time, of each message's first delivery (a message id
delivered again is a duplicate, counted on its own); early deliveries (lateness below 0)
are counted over every delivery. Percentiles are exact (Spark's `percentile`, linear
interpolation between the closest ranks, as numpy's default). Writes, under --out:
summary.json and summary.md, Parquet tables (deliveries, by_delay_bucket,
by_routing_key, per_second) and two charts (lateness.png: the distribution of lateness
per delay bucket; deliveries.png: deliveries per second).
"""

import argparse
import json
import os
import sys
from typing import Any, Dict, List, Optional, Sequence

import structlog

from gateway.settings import Settings, UsageError
from gateway.spark import INSTALL, require

log = structlog.get_logger("report")

# Delay buckets: (label, upper bound in ms, exclusive); the last has none. "overdue": due
# before it was published (a due time in the past, or a late publish).
BUCKETS = (("overdue", 0), ("0-1s", 1_000), ("1-10s", 10_000), ("10s-1m", 60_000), ("1-10m", 600_000),
           ("10m-1h", 3_600_000), ("1h-1d", 86_400_000), ("1d+", None))
UNKNOWN = "unknown"
PERCENTILES = (("p50", 0.5), ("p90", 0.9), ("p99", 0.99), ("p999", 0.999))
SCHEMA = ("message_id string, routing_key string, due_at long, due_source string, arrived_at long, "
          "redelivered boolean, published_at long, delay_ms long, _corrupt_record string")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("records", metavar="RECORDS", help="`record`'s JSON lines: a file, directory or glob")
    p.add_argument("--out", metavar="DIR", help="where the report goes (default: RECORDS.report)")
    p.add_argument("--top-keys", type=int, default=20, metavar="N",
                   help="routing keys listed in summary.md (all are in by_routing_key; default 20)")
    p.add_argument("--master", help="Spark master URL (default: spark-submit's, else local[*])")
    p.add_argument("--spark-conf", action="append", default=[], metavar="KEY=VALUE",
                   help="a Spark setting (repeatable)")


def bucket_of(delay_ms: Optional[int]) -> str:
    """Pure: the delay bucket's label (the same rule as the Spark expression below)."""
    if delay_ms is None:
        return UNKNOWN
    for label, upper in BUCKETS:
        if upper is None or delay_ms < upper:
            return label
    return UNKNOWN  # not reached


def run(settings: Settings, records: str, out: Optional[str], top_keys: int, master: Optional[str],
        spark_conf: Sequence[str]) -> int:
    """`delay-gateway report` (of the settings, only the log's, set up before it runs)."""
    require()
    from gateway.spark import session
    out = out or records.rstrip("/").replace("*", "_") + ".report"
    spark, owned = session.start("delay-gateway report", master, session.conf_pairs(spark_conf))
    try:
        summary = analyse(spark, records, out, top_keys)
    finally:
        if owned:
            spark.stop()
    print(f"report in {out}: {summary['deliveries']} deliveries of {summary['messages']} messages, "
          f"{summary['early']} early, {summary['duplicate_deliveries']} duplicates; lateness "
          + ", ".join(f"{k} {_fmt(summary['lateness_ms'][k])} ms" for k in ("p50", "p99", "max")), file=sys.stderr)
    return 0


def _read(spark, records: str):
    """The records as read (cached), and how many lines there were and how many unreadable."""
    from pyspark.sql import functions as F

    spark.sparkContext.setJobDescription("report: read records")
    try:
        raw = (spark.read.schema(SCHEMA).option("mode", "PERMISSIVE")
               .option("columnNameOfCorruptRecord", "_corrupt_record").json(records)).cache()
        # (Spark refuses a query of raw JSON that reads only the corrupt-record column; cached, it may.)
        lines = raw.agg(F.count(F.lit(1)).alias("lines"), F.count("_corrupt_record").alias("unreadable")).first()
    except Exception as exc:  # AnalysisException: no such path
        raise UsageError(f"cannot read {records}: {session_line(exc)}") from None
    return raw, lines


def analyse(spark, records: str, out: str, top_keys: int = 20) -> Dict[str, Any]:
    from pyspark.sql import Window
    from pyspark.sql import functions as F

    sc = spark.sparkContext
    raw, lines = _read(spark, records)
    # Blank lines read as all-null rows; lines with no arrival time are not deliveries.
    d = raw.filter(F.col("_corrupt_record").isNull() & F.col("arrived_at").isNotNull()).drop("_corrupt_record")
    bucket = F.when(F.col("delay_ms").isNull(), F.lit(UNKNOWN))
    for label, upper in BUCKETS:  # the first that matches, as bucket_of
        bucket = bucket.when(F.lit(True) if upper is None else F.col("delay_ms") < upper, F.lit(label))
    first = F.row_number().over(Window.partitionBy("message_id").orderBy("arrived_at"))
    d = (d.withColumn("lateness_ms", F.col("arrived_at") - F.col("due_at"))
          .withColumn("delay_bucket", bucket)
          .withColumn("first", F.col("message_id").isNull() | (first == 1))).cache()

    sc.setJobDescription("report: totals")
    t = d.agg(F.count(F.lit(1)).alias("deliveries"),
              F.sum(F.col("first").cast("int")).alias("messages"),
              F.count_distinct(F.when(~F.col("first"), F.col("message_id"))).alias("duplicated"),
              F.sum(F.col("redelivered").cast("int")).alias("redelivered"),
              F.sum(F.col("due_at").isNull().cast("int")).alias("without_due"),
              F.sum((F.col("lateness_ms") < 0).cast("int")).alias("early"),
              F.min("arrived_at").alias("first_arrival"), F.max("arrived_at").alias("last_arrival")).first()
    deliveries = int(t["deliveries"])
    messages = int(t["messages"] or 0)

    firsts = d.filter(F.col("first") & F.col("lateness_ms").isNotNull())
    stats = _lateness_columns()
    sc.setJobDescription("report: lateness")
    overall = _row(firsts.agg(*stats).first())
    # The chart's distribution (201 exact quantiles) comes with the bucket's figures.
    probabilities = [i / 200 for i in range(201)]
    by_bucket = firsts.groupBy("delay_bucket").agg(
        *stats, F.percentile("lateness_ms", probabilities).alias("quantiles")).cache()
    by_key = firsts.groupBy("routing_key").agg(*stats).cache()
    per_second = d.groupBy((F.col("arrived_at") / 1000).cast("long").alias("second")).count() \
        .orderBy("second").cache()

    sc.setJobDescription("report: write tables")
    d.write.mode("overwrite").parquet(os.path.join(out, "deliveries"))
    by_bucket.drop("quantiles").write.mode("overwrite").parquet(os.path.join(out, "by_delay_bucket"))
    by_key.write.mode("overwrite").parquet(os.path.join(out, "by_routing_key"))
    per_second.write.mode("overwrite").parquet(os.path.join(out, "per_second"))

    order = {label: i for i, (label, _) in enumerate(BUCKETS)}
    bucket_rows = sorted(by_bucket.collect(), key=lambda r: order.get(r["delay_bucket"], 99))
    cdf = {r["delay_bucket"]: list(r["quantiles"]) for r in bucket_rows if r["quantiles"] is not None}
    buckets = [{k: v for k, v in _row(r).items() if k != "quantiles"} for r in bucket_rows]
    keys = sorted((_row(r) for r in by_key.collect()), key=lambda r: (-r["messages"], str(r["routing_key"])))
    seconds = [(int(r["second"]), int(r["count"])) for r in per_second.collect()]
    for df in (raw, d, by_bucket, by_key, per_second):
        df.unpersist()

    span = (t["last_arrival"] - t["first_arrival"]) / 1000 if deliveries else 0.0
    summary = {
        "records": records, "lines": int(lines["lines"]), "unreadable_lines": int(lines["unreadable"]),
        "deliveries": deliveries, "messages": messages,
        "duplicate_deliveries": deliveries - messages, "duplicated_messages": int(t["duplicated"]),
        "redelivered": int(t["redelivered"] or 0), "without_due": int(t["without_due"] or 0),
        "early": int(t["early"] or 0),
        "lateness_ms": {k: overall[k] for k in ("messages", "min", "mean") + tuple(p for p, _ in PERCENTILES)
                        + ("max",)},
        "by_delay_bucket": buckets, "by_routing_key": keys,
        "throughput": {"first_arrival": t["first_arrival"], "last_arrival": t["last_arrival"],
                       "seconds": round(span, 3),
                       "peak_per_second": max((c for _, c in seconds), default=0),
                       "mean_per_second": round(deliveries / max(len(seconds), 1), 1)},
    }
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "summary.json"), "w", encoding="utf-8") as f:
        json.dump(summary, f, indent=1)
        f.write("\n")
    charts = draw(out, cdf, seconds)
    with open(os.path.join(out, "summary.md"), "w", encoding="utf-8") as f:
        f.write(markdown(summary, top_keys, charts))
    log.info("report_written", out=out, deliveries=deliveries, messages=messages, early=summary["early"])
    return summary


def _lateness_columns():
    from pyspark.sql import functions as F
    lat = F.col("lateness_ms")
    return [F.count(F.lit(1)).alias("messages"), F.min(lat).alias("min"), F.avg(lat).alias("mean"),
            *[F.percentile(lat, p).alias(name) for name, p in PERCENTILES], F.max(lat).alias("max")]


def _row(row) -> Dict[str, Any]:
    out = row.asDict()
    for k, v in out.items():
        if isinstance(v, float):
            out[k] = round(v, 3)
    out["messages"] = int(out.get("messages") or 0)
    return out


def session_line(exc: BaseException) -> str:
    from gateway.spark.session import one_line
    return one_line(exc)


def _fmt(value: Any) -> str:
    return "-" if value is None else f"{value:g}" if isinstance(value, float) else str(value)


def markdown(s: Dict[str, Any], top_keys: int, charts: Sequence[str]) -> str:
    """Pure: summary.md from the summary."""
    lat = s["lateness_ms"]
    head = ["messages", "min", "mean", "p50", "p90", "p99", "p999", "max"]
    lines = [f"# Delivery report: {s['records']}", "",
             f"- deliveries: **{s['deliveries']}** of **{s['messages']}** messages"
             f" ({s['duplicate_deliveries']} duplicate deliveries of {s['duplicated_messages']} messages;"
             f" {s['redelivered']} flagged redelivered by the broker)",
             f"- early (delivered before due): **{s['early']}**",
             f"- without a due time: {s['without_due']} (run the gateway with --stamp-due-at)",
             f"- unreadable lines: {s['unreadable_lines']}",
             f"- throughput: {s['throughput']['mean_per_second']} deliveries/s on average over the seconds that "
             f"had any, peak {s['throughput']['peak_per_second']}/s, over {s['throughput']['seconds']} s",
             "", "## Lateness (ms, first delivery of each message)", "",
             "| | " + " | ".join(head) + " |", "|---" * (len(head) + 1) + "|",
             "| all | " + " | ".join(_fmt(lat.get(h)) for h in head) + " |", "",
             "## By delay bucket", "", "| delay | " + " | ".join(head) + " |", "|---" * (len(head) + 1) + "|"]
    lines += ["| " + r["delay_bucket"] + " | " + " | ".join(_fmt(r.get(h)) for h in head) + " |"
              for r in s["by_delay_bucket"]]
    keys = s["by_routing_key"]
    lines += ["", f"## By routing key (top {min(top_keys, len(keys))} of {len(keys)} by messages)", "",
              "| routing key | " + " | ".join(head) + " |", "|---" * (len(head) + 1) + "|"]
    lines += ["| `" + str(r["routing_key"]) + "` | " + " | ".join(_fmt(r.get(h)) for h in head) + " |"
              for r in keys[:top_keys]]
    if charts:
        lines += ["", "## Charts", ""] + [f"![{c}]({c})" for c in charts]
    return "\n".join(lines) + "\n"


def draw(out: str, cdf: Dict[str, List[float]], seconds: List[tuple]) -> List[str]:
    """lateness.png and deliveries.png; nothing if matplotlib is missing (said once)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"report: no charts: matplotlib is not installed ({INSTALL})", file=sys.stderr)
        return []
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for label, values in cdf.items():
        ax.plot(values, [100 * i / (len(values) - 1) for i in range(len(values))], label=label)
    ax.set_xlabel("lateness (ms): arrival - due")
    ax.set_ylabel("% of messages")
    ax.set_title("Lateness by delay bucket (cumulative)")
    ax.grid(True, alpha=0.3)
    if cdf:
        ax.legend(title="delay")
    fig.tight_layout()
    fig.savefig(os.path.join(out, "lateness.png"), dpi=100)
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(8, 3.5))
    if seconds:
        t0 = seconds[0][0]
        ax.bar([s - t0 for s, _ in seconds], [c for _, c in seconds], width=1.0)
    ax.set_xlabel("seconds since the first delivery")
    ax.set_ylabel("deliveries per second")
    ax.set_title("Deliveries per second")
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(os.path.join(out, "deliveries.png"), dpi=100)
    plt.close(fig)
    return ["lateness.png", "deliveries.png"]
