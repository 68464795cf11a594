"""Which column of `schedule`'s table is what, and every row checked: the column options
mapped to the table's columns, and the Spark columns of a message (routing key, body, due
time, message id, headers) handed row by row to `rows.check` in a Python UDF."""

import functools
from typing import Any, Dict, Optional, Tuple

from gateway.settings import UsageError
from gateway.spark import rows
from gateway.spark.table_job import CORRUPT, quoted

DEFAULTS = dict(routing_key_column="routing_key", payload_column="payload", delay_column="delay_ms",
                deliver_at_column="deliver_at", message_id_column="message_id", headers_column="headers")


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


def checked_rows(df, m: Dict[str, Any], limits: rows.Limits, a) -> Tuple[Any, Optional[str]]:
    """`df` with each row's routing key (`__rk`), body (`__body`) and check (`__c`: a reason and
    a detail, or the message id, due time or delay, and headers), and the content type of every
    message: --content-type, else application/json for JSON bodies, else none."""
    from pyspark.sql import functions as F
    from pyspark.sql import types as T
    cols = m["columns"]
    row_json = F.to_json(F.struct(*[F.col(quoted(c)) for c in cols]))

    if m["routing_key"]:
        rk = F.col(quoted(m["routing_key"])).cast("string")
    else:
        rk = F.lit(a.routing_key)
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
    content_type = a.content_type or ("application/json" if is_json else None)

    if a.due_expr:
        try:
            expr = F.expr(a.due_expr)
            kind = df.select(expr.alias("x")).schema["x"].dataType
        except Exception as exc:  # a parse or analysis error
            from gateway.spark.session import one_line
            raise UsageError(f"--due-expr {a.due_expr!r}: {one_line(exc)}") from None
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
    udf = F.udf(functools.partial(_check_row, limits, bool(a.due_expr)), result, useArrow=False)
    checked = df.select(
        "*", rk.alias("__rk"), body.alias("__body"),
        udf(rk, F.octet_length(body), delay_raw, at_raw, at_ts, mid, headers,
            F.when(mid.isNull(), row_json), corrupt).alias("__c"))
    return checked, content_type


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
