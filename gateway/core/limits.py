"""What a message to check-in may carry, checked before it is sent.

The broker refuses what AMQP cannot encode (a routing key, message id or header name over
255 bytes, an integer beyond 64 bits) and check-in parks what the contract does not accept
(a delay beyond the gateway's range, an `x-deliver-at` that is epoch seconds). A publisher
that checks first can say so at once, in one line, instead of failing half-way or finding
the message parked later. `publish`, the rows of `schedule` and anything else that sends
to check-in use these rules.

Pure: no I/O, the clock passed in.
"""

import math
from typing import Any, Mapping, Optional, Tuple

from gateway.core.envelope import DELAY, DELIVER_AT, MAX_AHEAD_MS, SMALLEST_DELIVER_AT

SHORTSTR = 255  # bytes: AMQP's short strings (routing keys, message ids, header names)
LONG_MIN, LONG_MAX = -2**63, 2**63 - 1  # AMQP's widest integer, a signed 64-bit long
MAX_DELAY_MS = MAX_AHEAD_MS  # check-in parks longer delays (1000 years)


class Refused(ValueError):
    """A value the broker or check-in would refuse: one line, naming it and the fix."""


def short_string(what: str, value: str) -> str:
    size = len(value.encode("utf-8"))
    if size > SHORTSTR:
        raise Refused(f"{what} is {size} bytes; AMQP allows at most {SHORTSTR} (UTF-8): shorten it")
    return value


def delay_ms(value: int, what: str = DELAY) -> int:
    """A delay as check-in reads it: 0 or less is due now; beyond MAX_DELAY_MS it is parked."""
    if value > MAX_DELAY_MS:
        raise Refused(f"{what} {value} ms is beyond the gateway's range (at most {MAX_DELAY_MS} ms, 1000 years): "
                      "check-in would park it")
    if value < LONG_MIN:
        raise Refused(f"{what} {value} does not fit a 64-bit integer; 0 or less means due now")
    return value


def deliver_at_ms(value: int, now_ms: int, what: str = DELIVER_AT) -> int:
    """An absolute due time in epoch milliseconds; one before 1973 is epoch seconds by mistake."""
    if value < SMALLEST_DELIVER_AT:
        if value * 1000 >= SMALLEST_DELIVER_AT:
            raise Refused(f"{what} {value} looks like epoch seconds: as epoch milliseconds it is before 1973 and "
                          f"check-in would park it; that instant in milliseconds is {value * 1000}")
        raise Refused(f"{what} {value} is before 1973 as epoch milliseconds and check-in would park it: give a "
                      "due time in epoch ms (or a delay in ms as x-delay)")
    if value - now_ms > MAX_AHEAD_MS:
        raise Refused(f"{what} {value} is more than 1000 years ahead: check-in would park it")
    return value


def header(name: str, value: Any) -> None:
    """Raise Refused if AMQP cannot carry this header (its name, or a value JSON can hold and AMQP cannot)."""
    short_string(f"header name {_short(name)}", name)
    _value(name, value)


def headers(table: Optional[Mapping[str, Any]]) -> None:
    for name, value in (table or {}).items():
        header(name, value)


def _value(name: str, value: Any) -> None:
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return
    if isinstance(value, int):
        if not LONG_MIN <= value <= LONG_MAX:
            raise Refused(f"header {name}: {value} does not fit a 64-bit integer (AMQP's widest): "
                          "send it as a string")
        return
    if isinstance(value, float):
        if not math.isfinite(value):
            raise Refused(f"header {name}: {value} is not a finite number")
        return
    if isinstance(value, list):
        for item in value:
            _value(name, item)
        return
    if isinstance(value, dict):
        for key, item in value.items():
            short_string(f"header {name}: field name {_short(key)}", key)
            _value(f"{name}.{key}", item)
        return
    raise Refused(f"header {name}: a {type(value).__name__} cannot be sent")


# How `message` names each part in what it refuses: as a client's fields, or (the CLI) its flags.
FIELDS = ("the routing key", "the message id", DELAY, DELIVER_AT)


def message(routing_key: str, message_id: Optional[str], table: Optional[Mapping[str, Any]],
            delay: Optional[int], deliver_at: Optional[int], now_ms: int,
            names: Tuple[str, str, str, str] = FIELDS) -> None:
    """Everything about one message to check-in that can be known before sending. Raises Refused."""
    short_string(names[0], routing_key)
    if message_id is not None:
        short_string(names[1], message_id)
    headers(table)
    if delay is not None:
        delay_ms(delay, names[2])
    if deliver_at is not None:
        deliver_at_ms(deliver_at, now_ms, names[3])


def _short(text: str, limit: int = 40) -> str:
    return repr(text if len(text) <= limit else text[:limit] + "...")
