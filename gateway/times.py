"""Times and durations as text (pure): one formatter per format, each with what it prints.
Times are epoch milliseconds, shown in UTC."""

import datetime
from typing import List


def _utc(ms: int) -> datetime.datetime:
    return datetime.datetime.fromtimestamp(ms / 1000, datetime.timezone.utc)


def iso_ms(ms: int) -> str:
    """2026-11-26T09:00:00.123+00:00 (for scripts: JSON and CSV, and in sentences)."""
    return _utc(ms).isoformat(timespec="milliseconds")


def iso_s(ms: int) -> str:
    """2026-11-26T09:00:00+00:00"""
    return _utc(ms).isoformat(timespec="seconds")


def plain_ms(ms: int) -> str:
    """2026-11-26 09:00:00.123 (a table's column, UTC said in its heading)."""
    return _utc(ms).strftime("%Y-%m-%d %H:%M:%S.%f")[:-3]


def plain_utc(ms: int) -> str:
    """2026-11-26 09:00:00 UTC"""
    return _utc(ms).strftime("%Y-%m-%d %H:%M:%S UTC")


def duration(ms: int) -> str:
    """A duration in its largest unit, to three digits: 1.5 h, 12 min, 3.17 years, 250 ms."""
    for unit, size in (("years", 31_557_600_000), ("d", 86_400_000), ("h", 3_600_000), ("min", 60_000), ("s", 1000)):
        if ms >= size:
            value = ms / size
            return f"{value:.3g} {unit}"
    return f"{ms} ms"


def exact_duration(ms: int) -> str:
    """A duration in the largest unit that divides it: 2 days, 1 h, 90 min, 1500 ms."""
    for size, name in ((86_400_000, "day"), (3_600_000, "h"), (60_000, "min"), (1000, "s")):
        if ms >= size and ms % size == 0:
            n = ms // size
            return f"{n} {name}{'s' if name == 'day' and n != 1 else ''}"
    return f"{ms} ms"


def due_in(ms: int) -> str:
    """How far off a due time is, for people (`ms`: due minus now): "in 3 h 2 min", "overdue 4 s"."""
    later, left = ms >= 0, abs(ms)
    parts: List[str] = []
    for unit, size in (("d", 86_400_000), ("h", 3_600_000), ("min", 60_000), ("s", 1000)):
        if parts or left >= size:  # the first unit there is, and the one after it
            parts.append(f"{left // size} {unit}")
            left %= size
        if len(parts) == 2:
            break
    said = " ".join(parts) or f"{left} ms"
    return f"in {said}" if later else f"overdue {said}"
