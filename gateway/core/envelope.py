"""The gateway's own message format, and reading a publisher's delay headers.

A publisher's message is taken apart once, at check-in, and put back together once, at
pick-up. In between it travels in the gateway's format:

- properties: persistent, and a header table holding only the gateway's own headers
  (the broker adds its dead-letter history beside them, which is dropped at every hop);
- `x-gateway-due-at`: the due time, epoch ms (a long);
- `x-gateway-routing-key`: the routing key the publisher used, as its bytes;
- `x-gateway-properties`: the publisher's content properties, as their exact bytes
  (headers with their wire types, expiration, delivery mode, everything but `user_id`,
  which the broker checks against the publishing connection);
- `x-gateway-error`: on parked messages only, why they were parked;
- `x-gateway-accepted-us`: when the gateway took the message in (microseconds; see
  cancels.py), to tell whether a cancel came after it; absent on messages that entered
  before this header existed;
- `x-gateway-exchange`: where it goes when due, when that is not pick-up: "" (the default
  exchange) for a retry going back to the queue its routing key names (retries.py); on a
  parked cancel, `<prefix>.cancel`, where `parked replay` sends it back;
- the body, unchanged.

Nothing a publisher sends is ever read as one of these: its own headers are inside
`x-gateway-properties`, bytes the gateway carries but does not interpret. Only messages
that came through the gateway's own queues are read in this format (see handlers).

Pure: no I/O, the clock passed in.
"""

import datetime
import math
from decimal import Decimal, InvalidOperation
from typing import Any, Dict, Optional

from gateway.core import wire
from gateway.core.wire import Opaque, Properties, Table

Json = Dict[str, Any]  # a JSON object

DELAY = "x-delay"
DELIVER_AT = "x-deliver-at"
# The same, in the vocabulary of other schedulers (Tanzu RabbitMQ's delayed queue, AMQP 1.0
# clients, Azure Service Bus), so their publishers switch without code changes. RabbitMQ 4
# hands an AMQP 1.0 message's `x-opt-*` annotations (and its application properties) to a
# 0.9.1 consumer as headers, so one rule serves both protocols.
DELAYS = (DELAY, "x-opt-delivery-delay")  # milliseconds from arrival
DUE_TIMES = (DELIVER_AT, "x-opt-delivery-time", "x-opt-scheduled-enqueue-time")  # epoch milliseconds
# Set by the broker when a message arrives (RabbitMQ 3.12+, message interceptor
# set_header_timestamp): x-delay counts from it when present and plausible.
ARRIVED = "timestamp_in_ms"

INTERNAL = "x-gateway-"
DUE_AT = "x-gateway-due-at"
ROUTING_KEY = "x-gateway-routing-key"
PROPERTIES = "x-gateway-properties"
ERROR = "x-gateway-error"
ACCEPTED = "x-gateway-accepted-us"
EXCHANGE = "x-gateway-exchange"

PERSISTENT = 2
MS_PER_YEAR = 31_557_600_000
MAX_AHEAD_MS = 1000 * MS_PER_YEAR
# An x-deliver-at below this (March 1973) is almost certainly epoch seconds, not ms.
SMALLEST_DELIVER_AT = 100_000_000_000
# Both headers given: they agree if they name due times this close (check-in backlog and
# clock skew between publisher and gateway make them differ a little).
AGREEMENT_MS = 60_000
# The broker's arrival stamp is trusted if it is at most this far ahead of the gateway's
# clock (hosts' clocks differ a little) and, like any timestamp, not before 1973. A
# publisher can set the header itself; an earlier stamp grants nothing x-delay 0 does not.
ARRIVAL_SKEW_MS = 60_000


class Unreadable(ValueError):
    """The delay headers cannot be read; the message is parked with this reason."""


# -- reading a publisher's delay headers ------------------------------------------------------
def _as_ms(name: str, value: Any) -> int:
    """A header value as whole milliseconds, rounded up (never early)."""
    if isinstance(value, bool):
        raise Unreadable(f"{name} is a boolean, expected milliseconds as an integer")
    if isinstance(value, int):
        return value
    if isinstance(value, bytes):
        try:
            value = value.decode("ascii")
        except UnicodeDecodeError:
            raise Unreadable(f"{name} is binary data, expected milliseconds as an integer") from None
    if isinstance(value, str):
        try:
            value = Decimal(value.strip())
        except InvalidOperation:
            raise Unreadable(f"{name} is {_show(value)}, not a number") from None
    if isinstance(value, (float, Decimal)):
        if not math.isfinite(value):
            raise Unreadable(f"{name} is {value}, not a finite number")
        if not -10**18 <= value <= 10**18:
            raise Unreadable(f"{name} {value} is out of range")
        return math.ceil(value)
    if isinstance(value, Opaque):
        raise Unreadable(f"{name} is a value of AMQP type {value.kind.decode('latin-1')!r} that cannot be read")
    raise Unreadable(f"{name} is a {type(value).__name__}, expected milliseconds as an integer")


def _show(value: str) -> str:
    return repr(value if len(value) <= 40 else value[:40] + "...")


# (the names due_at reads, as they are on the wire: one pass over a message's headers)
_DUE_NAMES = frozenset(n.encode() for n in DELAYS + DUE_TIMES + (ARRIVED,))


def due_at(headers: Table, now_ms: int) -> int:
    """When a publisher's message is due (epoch ms). Raises Unreadable."""
    found = headers.pick(_DUE_NAMES)
    if not found:
        return now_ms
    due = []
    for name in DELAYS:
        field = found.get(name.encode())
        delay = None if field is None else field.value
        if delay is not None:
            delay_ms = _as_ms(name, delay)
            if delay_ms > MAX_AHEAD_MS:
                raise Unreadable(f"{name} {delay_ms} ms is out of range (at most {MAX_AHEAD_MS} ms, 1000 years)")
            stamp = found.get(ARRIVED.encode())
            arrived = _arrival(None if stamp is None else stamp.value, now_ms)
            due.append((name, (now_ms if arrived is None else arrived) + max(delay_ms, 0)))
    for name in DUE_TIMES:
        field = found.get(name.encode())
        at = None if field is None else field.value
        if at is not None:
            due.append((name, _absolute(name, at, now_ms)))
    if len(due) == 1:
        return due[0][1]
    if due:
        (first, earliest), (last, latest) = min(due, key=lambda d: d[1]), max(due, key=lambda d: d[1])
        if latest - earliest > AGREEMENT_MS:
            raise Unreadable(f"{first} and {last} disagree by {latest - earliest} ms (more than {AGREEMENT_MS} ms)")
    return max((at for _, at in due), default=now_ms)


def broker_stamp(headers: Table, now_ms: int) -> Optional[int]:
    """The broker's arrival stamp as it is (the broker's clock), if it is plausible."""
    return _plausible_stamp(headers.get(ARRIVED), now_ms)


def _plausible_stamp(stamp: Any, now_ms: int) -> Optional[int]:
    if isinstance(stamp, int) and not isinstance(stamp, bool) \
            and SMALLEST_DELIVER_AT <= stamp <= now_ms + ARRIVAL_SKEW_MS:
        return stamp
    return None


def arrival_stamp(headers: Table, now_ms: int) -> Optional[int]:
    """When the broker received the message, if it says so plausibly, on our clock: never
    after now (what x-delay counts from)."""
    return _arrival(headers.get(ARRIVED), now_ms)


def _arrival(stamp: Any, now_ms: int) -> Optional[int]:
    plausible = _plausible_stamp(stamp, now_ms)
    return None if plausible is None else min(plausible, now_ms)


def _absolute(name: str, value: Any, now_ms: int) -> int:
    """An epoch-milliseconds header, range-checked. An AMQP timestamp (0.9.1's whole seconds:
    what an AMQP 1.0 timestamp becomes for a 0.9.1 consumer) counts to the end of its second,
    never earlier than it was meant."""
    if isinstance(value, datetime.datetime):
        value = int(value.timestamp()) * 1000 + 999
    at = _as_ms(name, value)
    if at < SMALLEST_DELIVER_AT:
        raise Unreadable(f"{name} {at} is out of range: before 1973 as epoch milliseconds "
                         "(epoch seconds by mistake?)")
    if at - now_ms > MAX_AHEAD_MS:
        raise Unreadable(f"{name} {at} is out of range (more than 1000 years ahead)")
    return at


# -- the publisher's properties ----------------------------------------------------------------
# What the broker adds to a message on its way back through dead-lettering: the history
# (x-death, x-first-death-*, x-last-death-*), a quorum queue's count of returns
# (x-delivery-count, 3.10+) and of acquisitions (x-acquired-count, 4.3+, which counts a
# basic.reject too). Checked on every suite broker by tests/test_retry.py.
BROKER_HEADERS = ("x-death", "x-delivery-count", "x-acquired-count")


def is_broker_header(name: Any) -> bool:
    """Headers the broker adds: dead-letter history, and quorum queues' delivery counts."""
    return isinstance(name, str) and (
        name in BROKER_HEADERS or name.startswith(("x-first-death-", "x-last-death-")))


_BROKER_HEADERS_RAW = frozenset(n.encode() for n in BROKER_HEADERS)


def _is_broker_header_raw(name: bytes) -> bool:
    """is_broker_header of a name's bytes: the same answer, decoding only the few that may
    be one (a name that is not UTF-8 is the publisher's, whatever it starts with)."""
    if name in _BROKER_HEADERS_RAW:
        return True
    if not name.startswith((b"x-first-death-", b"x-last-death-")):
        return False
    try:
        return is_broker_header(name.decode("utf-8"))
    except UnicodeDecodeError:
        return False


def for_pick_up(props: Properties) -> Properties:
    """A publisher's properties as they will arrive at pick-up: without `user_id` (the
    broker checks it against the connection that publishes, which is the gateway's) and
    without the broker's dead-letter history, every other byte as sent."""
    headers = props.values.get("headers")
    cleaned = headers.without_raw(_is_broker_header_raw) if headers is not None else None
    if cleaned is headers and props.values.get("user_id") is None:
        return props
    return props.replace(user_id=None, headers=cleaned if cleaned else None)


# -- the gateway's format ---------------------------------------------------------------------
def inside(user: Properties, routing_key: bytes, due_ms: Optional[int], error: Optional[str] = None,
           accepted_us: Optional[int] = None, exchange: Optional[str] = None) -> Properties:
    """The gateway's properties for a publisher's message (see the module doc)."""
    entries = [wire.binary(ROUTING_KEY, routing_key), wire.binary(PROPERTIES, user.raw)]
    if due_ms is not None:
        entries.insert(0, wire.long(DUE_AT, due_ms))
    if error is not None:
        entries.append(wire.longstr(ERROR, error))
    if accepted_us is not None:
        entries.append(wire.long(ACCEPTED, accepted_us))
    if exchange is not None:
        entries.append(wire.longstr(EXCHANGE, exchange.encode()))
    return Properties.build(delivery_mode=PERSISTENT, headers=Table(entries))


def destination(headers: Table) -> Optional[str]:
    """Where a message in the gateway's format (or a carrier's messages) go when due: None
    for pick-up."""
    exchange = headers.get(EXCHANGE)
    return exchange if isinstance(exchange, str) else exchange.decode("utf-8", "replace") \
        if isinstance(exchange, bytes) else None


class Inside:
    """A message in the gateway's format, read back. Missing or damaged parts read as None."""

    def __init__(self, props: Properties) -> None:
        headers = props.headers
        self.headers = headers
        due = headers.get(DUE_AT)
        self.due_ms: Optional[int] = due if isinstance(due, int) and not isinstance(due, bool) else None
        key = headers.find(ROUTING_KEY)
        self.routing_key: Optional[bytes] = key.raw[4:] if key is not None and key.kind == b"x" else None
        user = headers.find(PROPERTIES)
        self.user: Optional[Properties] = Properties.parse(user.raw[4:]) if user is not None \
            and user.kind == b"x" else None
        error = headers.get(ERROR)
        self.error: Optional[str] = error if isinstance(error, str) else None
        accepted = headers.get(ACCEPTED)
        self.accepted_us: Optional[int] = accepted if isinstance(accepted, int) \
            and not isinstance(accepted, bool) else None
        self.exchange = destination(headers)

    @property
    def complete(self) -> bool:
        return self.routing_key is not None and self.user is not None

    def next_hop(self, due_ms: Optional[int] = None, error: Optional[str] = None) -> Properties:
        """Its properties for the next hop: only the gateway's own headers (the broker's
        dead-letter history would make RabbitMQ up to 3.12 and from 3.13.3 drop the message
        when it re-enters a queue named in it, on its second meditation lap)."""
        if self.user is None or self.routing_key is None:
            raise ValueError("not in the gateway's format")
        return inside(self.user, self.routing_key, self.due_ms if due_ms is None else due_ms, error,
                      self.accepted_us, self.exchange)


# -- the first format (2026-11-21, 0a9c351..223100e) --------------------------------------------
# It kept the gateway's headers in the publisher's own header table, and set aside the
# publisher's expiration and delivery mode in headers of their own (the message travelled
# persistent, without an expiration).
FIRST_EXPIRATION = "x-gateway-expiration"  # the publisher's expiration (a long string)
FIRST_DELIVERY_MODE = "x-gateway-delivery-mode"  # the publisher's delivery mode (an int; 0: not set)


def first_format(props: Properties) -> Optional[Inside]:
    """A message in the gateway's first format (2026-11-21, 0a9c351..223100e), read as today's
    Inside; None if it is not one. Only that format has `x-gateway-routing-key` as a long
    string and no `x-gateway-properties`. The publisher's properties are restored as that
    version restored them at pick-up: the table without the gateway's headers and the broker's
    (none left: no headers), the expiration and delivery mode (1 or 2, else none) from the
    headers they were set aside in, every other property as it is."""
    headers = props.headers
    key = headers.find(ROUTING_KEY)
    if key is None or key.kind != b"S" or PROPERTIES in headers:
        return None
    expiration = headers.find(FIRST_EXPIRATION)
    mode = headers.get(FIRST_DELIVERY_MODE)
    table = headers.without(lambda name: (isinstance(name, str) and name.startswith(INTERNAL))
                            or is_broker_header(name))
    restored = props.replace(
        headers=table if len(table) else None, user_id=None,
        expiration=expiration.raw[4:] if expiration is not None and expiration.kind == b"S" else None,
        delivery_mode=mode if mode in (1, 2) and not isinstance(mode, bool) else None)
    found = Inside(props)
    found.routing_key, found.user, found.exchange = key.raw[4:], restored, None
    return found


def stamped(user: Properties, due_ms: int) -> Properties:
    """The publisher's properties with the header x-gateway-due-at (the opt-in stamp)."""
    headers = user.values.get("headers") or Table()
    return user.replace(headers=headers.with_entry(wire.long(DUE_AT, due_ms)))


def as_bytes(key: Any) -> bytes:
    """A routing key as pika gave it (str, or bytes when it is not UTF-8) as its bytes."""
    return key if isinstance(key, bytes) else key.encode("utf-8")


def readable_key(key: Optional[bytes]) -> str:
    """A routing key for people to read."""
    return "" if key is None else key.decode("utf-8", "backslashreplace")


def last_death(headers: Table) -> Optional[Json]:
    """The broker's most recent dead-lettering of this message (x-death's first entry)."""
    deaths = headers.get("x-death")
    if isinstance(deaths, list) and deaths and isinstance(deaths[0], dict):
        return deaths[0]
    return None

