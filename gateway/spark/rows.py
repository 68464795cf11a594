"""One input row of `schedule`: the message it becomes, or why it cannot be scheduled.

Pure: no Spark, no I/O, the clock passed in. The Spark job computes what only Spark can
(column types, timestamps in the session's time zone, payload bytes) and hands each row
here as plain values; the same function runs in the tests.

The rules are the contract's, applied before publishing so that a bad row lands in the
errors output with its reason instead of in the gateway's parked queue: due times are
epoch milliseconds (values that look like epoch seconds are refused, as check-in does),
fractions of a millisecond round up (never early), routing keys and message ids are AMQP
short strings (at most 255 bytes).
"""

import json
import math
import uuid
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from typing import Any, Dict, Optional, Union

from gateway.core import limits
from gateway.core.envelope import DELAY, DELIVER_AT, MAX_AHEAD_MS, MS_PER_YEAR, SMALLEST_DELIVER_AT

SHORTSTR = limits.SHORTSTR
LONG = (limits.LONG_MIN, limits.LONG_MAX)
# Message ids made for rows that have none: uuid5 of the row's JSON in this namespace, so a
# re-run gives every row the id it had (consumers can de-duplicate), whatever the partitioning.
ID_NAMESPACE = uuid.uuid5(uuid.NAMESPACE_URL, "https://github.com/rabbitmq-delay-gateway/schedule")

# Reasons (stable codes: the errors output's `_reason` column, the summary's counts).
UNPARSEABLE = "unparseable_row"
KEY_MISSING = "routing_key_missing"
KEY_TOO_LONG = "routing_key_too_long"
DUE_MISSING = "due_missing"
DUE_UNREADABLE = "due_unreadable"
DUE_AMBIGUOUS = "due_ambiguous"
DUE_SECONDS = "due_epoch_seconds"
DUE_PAST = "due_past"
DUE_TOO_FAR = "due_too_far"
PAYLOAD_TOO_LARGE = "payload_too_large"
HEADERS_INVALID = "headers_invalid"
ID_TOO_LONG = "message_id_too_long"
REASONS = (UNPARSEABLE, KEY_MISSING, KEY_TOO_LONG, DUE_MISSING, DUE_UNREADABLE, DUE_AMBIGUOUS, DUE_SECONDS,
           DUE_PAST, DUE_TOO_FAR, PAYLOAD_TOO_LARGE, HEADERS_INVALID, ID_TOO_LONG)


@dataclass(frozen=True)
class Limits:
    now_ms: int  # the run's start: fixed in the resume record, so a re-run judges rows alike
    max_overdue_ms: int  # a due time further in the past than this is refused
    max_payload_bytes: int


@dataclass(frozen=True)
class Checked:
    """What a row becomes: a message (reason None) or a rejection (reason, detail)."""

    reason: Optional[str] = None
    detail: Optional[str] = None
    message_id: Optional[str] = None
    deliver_at_ms: Optional[int] = None  # an absolute due time, or
    delay_ms: Optional[int] = None  # a delay counted from the publish
    headers: Optional[str] = None  # the row's own headers, checked, as JSON


class Rejected(ValueError):
    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason, self.detail = reason, detail


def check(routing_key: Optional[str], payload_bytes: Optional[int], delay: Optional[str],
          deliver_at: Optional[str], deliver_at_ts_ms: Optional[int], message_id: Optional[str],
          headers: Optional[str], row_json: Optional[str], unparseable: Optional[str],
          limits: Limits, due_expr: bool = False) -> Checked:
    """Check one row. `delay` and `deliver_at` are the raw values as text (None: absent);
    `deliver_at_ts_ms` is Spark's reading of `deliver_at` as a timestamp, if it is one;
    `row_json` is the row as JSON (for the message id when the row has none); `due_expr`:
    `deliver_at` is the value of the user's expression, not a column."""
    try:
        if unparseable is not None:
            raise Rejected(UNPARSEABLE, f"the input line could not be parsed: {_short(unparseable)}")
        if routing_key is None:
            raise Rejected(KEY_MISSING, "no routing key")
        if len(routing_key.encode("utf-8")) > SHORTSTR:
            raise Rejected(KEY_TOO_LONG, f"routing key of {len(routing_key.encode('utf-8'))} bytes "
                                         f"(AMQP allows {SHORTSTR})")
        if due_expr and deliver_at is None:
            raise Rejected(DUE_MISSING, "--due-expr gave no value for this row (a column it reads is empty, or "
                                        "not readable as its type)")
        deliver_at_ms, delay_ms = due(delay, deliver_at, deliver_at_ts_ms, limits)
        if payload_bytes is not None and payload_bytes > limits.max_payload_bytes:
            raise Rejected(PAYLOAD_TOO_LARGE, f"payload of {payload_bytes} bytes "
                                              f"(limit {limits.max_payload_bytes}, --max-payload-bytes)")
        checked_headers = check_headers(headers)
        if message_id is None:
            message_id = str(uuid.uuid5(ID_NAMESPACE, row_json or ""))
        elif len(message_id.encode("utf-8")) > SHORTSTR:
            raise Rejected(ID_TOO_LONG, f"message id of {len(message_id.encode('utf-8'))} bytes "
                                        f"(AMQP allows {SHORTSTR})")
    except Rejected as exc:
        return Checked(exc.reason, exc.detail)
    return Checked(None, None, message_id, deliver_at_ms, delay_ms, checked_headers)


def due(delay: Optional[str], deliver_at: Optional[str], deliver_at_ts_ms: Optional[int],
        limits: Limits):
    """(deliver_at_ms, delay_ms): exactly one is set. Raises Rejected."""
    if delay is not None and deliver_at is not None:
        raise Rejected(DUE_AMBIGUOUS, f"both a delay ({_short(delay)}) and a due time ({_short(deliver_at)}): "
                                      "give one")
    if delay is not None:
        ms = milliseconds(delay)
        if ms is None:
            raise Rejected(DUE_UNREADABLE, f"delay {_short(delay)} is not a number of milliseconds")
        _in_range(limits.now_ms + ms, limits)
        return None, ms
    if deliver_at is not None:
        ms = milliseconds(deliver_at)
        if ms is None:
            if deliver_at_ts_ms is None:
                raise Rejected(DUE_UNREADABLE, f"due time {_short(deliver_at)} is neither epoch milliseconds "
                                               "nor a timestamp")
            ms = deliver_at_ts_ms
        elif ms < SMALLEST_DELIVER_AT:
            raise Rejected(DUE_SECONDS, f"due time {ms} is before 1973 as epoch milliseconds "
                                        "(epoch seconds by mistake?)")
        _in_range(ms, limits)
        return ms, None
    raise Rejected(DUE_MISSING, "no due time (neither a delay nor a due time)")


def _in_range(due_ms: int, limits: Limits) -> None:
    if due_ms < limits.now_ms - limits.max_overdue_ms:
        raise Rejected(DUE_PAST, f"due {limits.now_ms - due_ms} ms before the run started "
                                 f"(limit {limits.max_overdue_ms} ms, --max-overdue-ms)")
    if due_ms - limits.now_ms > MAX_AHEAD_MS:
        raise Rejected(DUE_TOO_FAR, f"due more than {MAX_AHEAD_MS // MS_PER_YEAR} years ahead ({due_ms})")


def milliseconds(text: str) -> Optional[int]:
    """A number of milliseconds, fractions rounded up; None if `text` is not a number."""
    try:
        value = Decimal(text.strip())
    except (InvalidOperation, AttributeError):
        return None
    if not value.is_finite() or abs(value) > 10**18:
        return None
    return math.ceil(value)


def check_headers(text: Optional[str]) -> Optional[str]:
    """The row's headers (a JSON object) as JSON again, or Rejected."""
    if text is None:
        return None
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise Rejected(HEADERS_INVALID, f"headers are not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise Rejected(HEADERS_INVALID, f"headers must be a JSON object, not {type(value).__name__}")
    for name in (DELAY, DELIVER_AT):
        if name in value:
            raise Rejected(HEADERS_INVALID, f"headers set {name}; the due time comes from its own column")
    for name, item in value.items():
        if len(name.encode("utf-8")) > SHORTSTR:
            raise Rejected(HEADERS_INVALID, f"header name of {len(name.encode('utf-8'))} bytes "
                                            f"(AMQP allows {SHORTSTR})")
        _carried(name, item)
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def _carried(name: str, value: Any) -> None:
    """Raise Rejected if AMQP cannot carry `value` (JSON has numbers it has no type for)."""
    try:
        limits.header(name, value)
    except limits.Refused as exc:
        raise Rejected(HEADERS_INVALID, str(exc)) from None


def message_headers(checked_headers: Optional[str], deliver_at_ms: int) -> Dict[str, Any]:
    """The AMQP headers of a checked row published at some instant: its own, and the due time."""
    headers: Dict[str, Any] = json.loads(checked_headers) if checked_headers else {}
    headers[DELIVER_AT] = deliver_at_ms
    return headers


def due_at(checked: Union[Checked, Any], published_ms: int) -> int:
    """The absolute due time of a checked row published at `published_ms`: a delay counts
    from the publish (so a check-in backlog does not add to it)."""
    if checked.deliver_at_ms is not None:
        return checked.deliver_at_ms
    return published_ms + max(checked.delay_ms or 0, 0)


def _short(text: str, limit: int = 60) -> str:
    text = str(text)
    return repr(text if len(text) <= limit else text[:limit] + "...")
