"""Test tables for `schedule`: good rows of every way to give a due time, and bad rows of
every kind the format can hold, each row named by its `case` column."""

import csv
import json
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Dict, List, Optional

from gateway.spark import rows as R

MAX_PAYLOAD = 256  # the tests' --max-payload-bytes
HOUR = 3_600_000


@dataclass
class Table:
    rows: List[dict]
    good: Dict[str, dict] = field(default_factory=dict)  # case -> what must arrive
    bad: Dict[str, str] = field(default_factory=dict)  # case -> reason
    extra_lines: List[str] = field(default_factory=list)  # written as they are (unparseable)


def iso(ms: int) -> str:
    return datetime.fromtimestamp(ms / 1000, timezone.utc).isoformat(timespec="milliseconds").replace(
        "+00:00", "Z")


def table(fmt: str, now_ms: int, copies: int = 2) -> Table:
    """Rows for `fmt` (csv, json or parquet). Good rows: `delay` (ms from the publish) or
    `at` (epoch ms) says when they are due."""
    t = Table([])

    def good(case, key="k.a", payload=None, delay=None, deliver_at=None, message_id=None, headers=None,
             delay_ms=None, at_ms=None):
        payload = f"body of {case}" if payload is None else payload
        t.rows.append(dict(case=case, routing_key=key, payload=payload, delay_ms=delay,
                           deliver_at=deliver_at, message_id=message_id, headers=headers))
        t.good[case] = dict(key=key, payload=payload, delay=delay_ms, at=at_ms,
                            message_id=message_id, headers=json.loads(headers) if headers else None)

    def bad(case, reason, **row):
        base = dict(case=case, routing_key="k.bad", payload="x", delay_ms=None, deliver_at=None, message_id=None,
                    headers=None)
        base.update(row)
        t.rows.append(base)
        t.bad[case] = reason

    text = fmt != "parquet"  # CSV and JSON carry due times as text or numbers; Parquet as typed columns
    for c in range(copies):
        for i, delay in enumerate((0, 300, 900, 1700, 2500)):
            good(f"delay-{c}-{i}", key=f"k.{i % 3}", delay=delay, delay_ms=delay,
                 message_id=f"id-{c}-{i}" if i % 2 else None,
                 headers=json.dumps({"n": i, "f": 1.5, "s": "x", "list": [1, "two"]}) if i % 2 == 0 else None)
        for i, ahead in enumerate((400, 1200, 2200)):
            at = now_ms + ahead
            good(f"at-{c}-{i}", key="k.at.deep.key", deliver_at=at if text else _ts(at), at_ms=at)
        good(f"overdue-{c}", deliver_at=(now_ms - 10_000) if text else _ts(now_ms - 10_000), at_ms=now_ms - 10_000)
        if text:
            good(f"iso-{c}", deliver_at=iso(now_ms + 1500), at_ms=now_ms + 1500)
            good(f"fraction-{c}", delay="250.4", delay_ms=251)  # rounded up: never early
        good(f"empty-payload-{c}", key="k.empty", payload="", delay=100, delay_ms=100, message_id=f"empty-{c}")

        bad(f"no-key-{c}", R.KEY_MISSING, routing_key=None, delay_ms=100)
        bad(f"long-key-{c}", R.KEY_TOO_LONG, routing_key="k" * 300, delay_ms=100)
        bad(f"no-due-{c}", R.DUE_MISSING)
        bad(f"both-{c}", R.DUE_AMBIGUOUS, delay_ms=100, deliver_at=now_ms + 100 if text else _ts(now_ms + 100))
        bad(f"past-{c}", R.DUE_PAST, deliver_at=(now_ms - 2 * HOUR) if text else _ts(now_ms - 2 * HOUR))
        bad(f"far-{c}", R.DUE_TOO_FAR, delay_ms=1001 * R.MS_PER_YEAR)
        bad(f"big-{c}", R.PAYLOAD_TOO_LARGE, payload="p" * (MAX_PAYLOAD + 1), delay_ms=100)
        bad(f"headers-{c}", R.HEADERS_INVALID, delay_ms=100, headers="[1, 2]")
        bad(f"headers-delay-{c}", R.HEADERS_INVALID, delay_ms=100, headers='{"x-delay": 5}')
        bad(f"long-id-{c}", R.ID_TOO_LONG, delay_ms=100, message_id="m" * 300)
        if text:
            bad(f"unreadable-{c}", R.DUE_UNREADABLE, delay_ms="soon")
            bad(f"seconds-{c}", R.DUE_SECONDS, deliver_at=now_ms // 1000)
    if fmt == "json":
        t.extra_lines.append('{"case": "broken line", "routing_key": ')
    return t


def _ts(ms: int) -> datetime:
    return datetime.fromtimestamp(ms / 1000, timezone.utc)


def write(t: Table, fmt: str, path: str, spark=None) -> None:
    columns = ["case", "routing_key", "payload", "delay_ms", "deliver_at", "message_id", "headers"]
    if fmt == "csv":
        with open(path, "w", newline="", encoding="utf-8") as f:
            w = csv.DictWriter(f, fieldnames=columns)
            w.writeheader()
            w.writerows({k: "" if v is None else v for k, v in row.items()} for row in t.rows)
    elif fmt == "json":
        with open(path, "w", encoding="utf-8") as f:
            for row in t.rows:
                f.write(json.dumps({k: v for k, v in row.items() if v is not None}) + "\n")
            for line in t.extra_lines:
                f.write(line + "\n")
    else:
        from pyspark.sql import types as T
        schema = T.StructType([T.StructField("case", T.StringType()), T.StructField("routing_key", T.StringType()),
                               T.StructField("payload", T.StringType()), T.StructField("delay_ms", T.LongType()),
                               T.StructField("deliver_at", T.TimestampType()),
                               T.StructField("message_id", T.StringType()), T.StructField("headers", T.StringType())])
        spark.createDataFrame([tuple(row[c] for c in columns) for row in t.rows], schema) \
            .coalesce(1).write.mode("overwrite").parquet(path)


def expected_reasons(t: Table) -> Dict[str, int]:
    out: Dict[str, int] = {}
    for reason in t.bad.values():
        out[reason] = out.get(reason, 0) + 1
    if t.extra_lines:
        out[R.UNPARSEABLE] = out.get(R.UNPARSEABLE, 0) + len(t.extra_lines)
    return out


def row_count(t: Table) -> int:
    return len(t.rows) + len(t.extra_lines)


def message_id_of(case: str, t: Table) -> Optional[str]:
    return t.good[case]["message_id"]
