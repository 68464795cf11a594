"""What the two table jobs (schedule, cancel-table) share: their inputs, outputs and start.

Both read a table (CSV with a header line, JSON lines or Parquet), write the rows they
reject in the input's format with `_reason` and `_detail` (and `_line` for a line that could
not be parsed), write a JSON summary, and publish to one exchange of the chain, which they
check is there before Spark starts.
"""

import json
import os
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence

from topology.names import Names

from gateway.settings import Settings, UsageError
from gateway.spark import require
from gateway.spark.publisher import Target

FORMATS = {".csv": "csv", ".json": "json", ".jsonl": "json", ".ndjson": "json", ".parquet": "parquet",
           ".pq": "parquet"}
CORRUPT = "_corrupt_record"
REASON, DETAIL, LINE = "_reason", "_detail", "_line"
# A header line, and quotes escaped by doubling them (RFC 4180: what Python, spreadsheets and
# most databases write), not Spark's default backslash.
CSV = {"header": True, "escape": '"'}


# -- the start of a run ------------------------------------------------------------------------
@dataclass(frozen=True)
class TableOptions:
    """The arguments every table job takes (schedule's and cancel-table's add_arguments)."""

    input: str
    format: Optional[str]
    errors: Optional[str]
    summary: Optional[str]
    confirm_window: int
    rows_per_partition: int
    master: Optional[str]
    spark_conf: List[str]


@dataclass
class Started:
    """A table job ready to work: its Spark session (`owned`: this run stops it), the input's
    format, and where it publishes."""

    spark: Any
    owned: bool
    format: str
    target: Target


def start(settings: Settings, args: TableOptions, job: str, exchange_of: Callable[[Names], str]) -> Started:
    """Usage errors, then the broker (the exchange `exchange_of` names), then Spark: what
    fails fast fails before Spark starts (that takes tens of seconds)."""
    require()
    from gateway.spark import session

    exchange = exchange_of(settings.chain.names)
    urls, tls = settings.one_vhost_urls, settings.tls
    confs = session.conf_pairs(args.spark_conf)
    fmt = input_format(args)
    check_exchange(urls, tls, exchange, job)
    spark, owned = session.start(f"delay-gateway {job}", args.master, confs)
    return Started(spark, owned, fmt, Target(urls, exchange, tls, args.confirm_window))


def check_exchange(urls: Sequence[str], tls, exchange: str, job: str) -> None:
    """Fail before Spark starts if the exchange `job` publishes to is not there (on the first
    node that answers, as the executors connect)."""
    from gateway.broker.plumbing.amqp import blocking_channel
    with blocking_channel(urls, f"delay-gateway {job}", tls) as channel:
        channel.exchange_declare(exchange, passive=True)


# -- inputs ------------------------------------------------------------------------------------
def input_format(args: TableOptions) -> str:
    """INPUT's format: --format, else its extension (or the one extension of a directory's files)."""
    if args.format:
        return args.format
    path = args.input.rstrip("/")
    for suffix in (path.lower(), path.lower()[:-3] if path.lower().endswith(".gz") else ""):
        for ext, fmt in FORMATS.items():
            if suffix.endswith(ext):
                return fmt
    if os.path.isdir(path):
        found = {FORMATS.get(os.path.splitext(n.lower())[1]) for n in os.listdir(path)} - {None}
        if len(found) == 1:
            return str(found.pop())
    raise UsageError(f"cannot tell the format of {args.input} from its name: give --format csv, json or parquet")


def read_input(spark, path: str, fmt: str):
    """INPUT as a DataFrame; a line that does not parse is kept, in CORRUPT."""
    reader = spark.read
    try:
        if fmt == "csv":
            return reader.options(**CSV).option("mode", "PERMISSIVE").csv(path)
        if fmt == "json":
            return reader.option("mode", "PERMISSIVE").option("columnNameOfCorruptRecord", CORRUPT).json(path)
        return reader.parquet(path)
    except Exception as exc:  # AnalysisException: path not found, unreadable
        from gateway.spark.session import one_line
        raise UsageError(f"cannot read {path} as {fmt}: {one_line(exc)}") from None


def quoted(name: str) -> str:
    """A column name as Spark SQL reads it whatever it holds (backticks doubled)."""
    return "`" + name.replace("`", "``") + "`"


# -- outputs -----------------------------------------------------------------------------------
def write_rows(df, fmt: str, path: str) -> None:
    """Rows (the rejected ones) in the input's format: CSV with a header, JSON lines, Parquet."""
    writer = df.write.mode("overwrite")
    if fmt == "csv":
        writer.options(**CSV).csv(path)
    elif fmt == "json":
        writer.json(path)
    else:
        writer.parquet(path)


def write_json(path: str, value: Dict[str, Any]) -> None:
    """`value` as JSON at `path`, replaced at once: a reader never sees half of it."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(value, f, indent=1)
        f.write("\n")
    os.replace(tmp, path)
