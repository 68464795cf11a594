"""What the gateway reads from and writes to a message's headers and properties.

Pure functions: no I/O, the clock passed in.
"""

import math
from decimal import Decimal, InvalidOperation
from typing import Optional, Tuple

from pika import BasicProperties

DELAY = "x-delay"
DELIVER_AT = "x-deliver-at"

# Internal headers: set at check-in, removed before pick-up.
INTERNAL = "x-gateway-"
DUE_AT = "x-gateway-due-at"
ROUTING_KEY = "x-gateway-routing-key"
EXPIRATION = "x-gateway-expiration"
DELIVERY_MODE = "x-gateway-delivery-mode"
ERROR = "x-gateway-error"  # on parked messages only: why they were parked

PERSISTENT = 2
MS_PER_YEAR = 31_557_600_000
MAX_AHEAD_MS = 1000 * MS_PER_YEAR
# An x-deliver-at below this (March 1973) is almost certainly epoch seconds, not ms.
SMALLEST_DELIVER_AT = 100_000_000_000
# Both headers given: they agree if they name due times this close (check-in backlog and
# clock skew between publisher and gateway make them differ a little).
AGREEMENT_MS = 60_000


class Unreadable(ValueError):
    """The delay headers cannot be read; the message is parked with this reason."""


def _as_ms(name: str, value) -> int:
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
        if abs(value) > 10**18:
            raise Unreadable(f"{name} {value} is out of range")
        return math.ceil(value)
    raise Unreadable(f"{name} is a {type(value).__name__}, expected milliseconds as an integer")


def _show(value: str) -> str:
    return repr(value if len(value) <= 40 else value[:40] + "...")


def due_at(headers: Optional[dict], now_ms: int) -> int:
    """When the message is due (epoch ms). Raises Unreadable."""
    headers = headers or {}
    if DUE_AT in headers:  # checked in before (or forged: so it gets the same range checks)
        return _absolute(DUE_AT, headers[DUE_AT], now_ms)
    due = []
    if headers.get(DELAY) is not None:
        delay = _as_ms(DELAY, headers[DELAY])
        if delay > MAX_AHEAD_MS:
            raise Unreadable(f"{DELAY} {delay} ms is out of range (at most {MAX_AHEAD_MS} ms, 1000 years)")
        due.append(now_ms + max(delay, 0))
    if headers.get(DELIVER_AT) is not None:
        due.append(_absolute(DELIVER_AT, headers[DELIVER_AT], now_ms))
    if len(due) == 2 and abs(due[0] - due[1]) > AGREEMENT_MS:
        raise Unreadable(
            f"{DELAY} and {DELIVER_AT} disagree by {abs(due[0] - due[1])} ms (more than {AGREEMENT_MS} ms)")
    return max(due, default=now_ms)


def _absolute(name: str, value, now_ms: int) -> int:
    """An epoch-milliseconds header, range-checked."""
    at = _as_ms(name, value)
    if at < SMALLEST_DELIVER_AT:
        raise Unreadable(f"{name} {at} is out of range: before 1973 as epoch milliseconds "
                         "(epoch seconds by mistake?)")
    if at - now_ms > MAX_AHEAD_MS:
        raise Unreadable(f"{name} {at} is out of range (more than 1000 years ahead)")
    return at


def fixed_due_at(headers: Optional[dict], now_ms: int) -> int:
    """The due time check-in fixed; now if there is none (published past check-in by hand)."""
    headers = headers or {}
    return _as_ms(DUE_AT, headers[DUE_AT]) if DUE_AT in headers else now_ms


def user_routing_key(headers: Optional[dict], routing_key: str) -> str:
    """The routing key the user published with (check-in keeps it in a header), else `routing_key`."""
    key = (headers or {}).get(ROUTING_KEY, routing_key)
    return key if isinstance(key, str) else routing_key


def is_broker_header(name: str) -> bool:
    """Headers the broker adds: dead-letter history, and quorum queues' delivery count."""
    return name in ("x-death", "x-delivery-count") or name.startswith(("x-first-death-", "x-last-death-"))


def internal(properties: BasicProperties, routing_key: str, due_ms: Optional[int] = None,
             error: Optional[str] = None) -> BasicProperties:
    """Properties for a message inside the gateway (chain, meditation, parking).

    The user's expiration and delivery mode are set aside so a short expiration cannot cut
    the delay short; the broker's dead-letter history is dropped, because RabbitMQ <= 3.12
    and 3.13.3+ discard a message that re-enters a queue named in its x-death.
    """
    headers = {k: v for k, v in (properties.headers or {}).items() if not is_broker_header(k)}
    if ROUTING_KEY not in headers:  # first time in: what the user sent is still there
        headers[ROUTING_KEY] = routing_key
        headers[DELIVERY_MODE] = int(properties.delivery_mode or 0)  # 0: not set
    if properties.expiration is not None:
        headers[EXPIRATION] = properties.expiration
    if due_ms is not None:
        headers[DUE_AT] = due_ms
    if error is not None:
        headers[ERROR] = error
    # user_id is checked by the broker against the publishing connection's user, so it can
    # only travel with the gateway's own identity: it is not carried.
    return replace_properties(properties, headers=headers, expiration=None,
                              delivery_mode=PERSISTENT, user_id=None)


def external(properties: BasicProperties, routing_key: str) -> Tuple[str, BasicProperties]:
    """The user's routing key and properties, as they were published (for pick-up)."""
    headers = properties.headers or {}
    mode = headers.get(DELIVERY_MODE)
    restored = replace_properties(
        properties,
        headers={k: v for k, v in headers.items()
                 if not (k.startswith(INTERNAL) or is_broker_header(k))} or None,
        expiration=headers.get(EXPIRATION),
        delivery_mode=mode if mode in (1, 2) else None,
    )
    return user_routing_key(headers, routing_key), restored


def unencodable(properties: BasicProperties) -> Optional[str]:
    """Why these properties cannot be written to the wire again, or None if they can."""
    try:
        properties.encode()
        return None
    except Exception as exc:  # pika raises struct.error, ValueError, its own exceptions...
        bad = [k for k, v in (properties.headers or {}).items() if not _encodes({k: v})]
        return f"header(s) {', '.join(map(repr, bad)) or '?'} cannot be encoded again ({type(exc).__name__}: {exc})"


def printable_headers(properties: BasicProperties) -> BasicProperties:
    """The properties with every header value that cannot be encoded replaced by its repr."""
    headers = {k: (v if _encodes({k: v}) else repr(v)[:200]) for k, v in (properties.headers or {}).items()}
    return replace_properties(properties, headers=headers)


def _encodes(table: dict) -> bool:
    try:
        BasicProperties(headers=table).encode()
        return True
    except Exception:
        return False


_FIELDS = ("content_type", "content_encoding", "headers", "delivery_mode", "priority",
           "correlation_id", "reply_to", "expiration", "message_id", "timestamp", "type",
           "user_id", "app_id", "cluster_id")


def replace_properties(properties: BasicProperties, **changes) -> BasicProperties:
    values = {f: getattr(properties, f) for f in _FIELDS}
    values.update(changes)
    return BasicProperties(**values)
