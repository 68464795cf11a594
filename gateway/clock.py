"""The gateway's clocks: the wall clock (due times are epoch milliseconds, compared across
hosts) and a steady one that no step of the wall clock moves (what holds are timed by)."""

import time
from typing import Optional, Tuple


def wall_ms() -> int:
    return time.time_ns() // 1_000_000


_anchor: Optional[Tuple[int, int]] = None  # (wall ms, monotonic ms) when first asked


def steady_ms() -> int:
    """Epoch milliseconds as the wall clock said when this process first asked, advanced by the
    monotonic clock since: steps of the wall clock (forward or back) do not move it."""
    global _anchor
    mono = time.monotonic_ns() // 1_000_000
    if _anchor is None:
        _anchor = (wall_ms(), mono)
    return _anchor[0] + mono - _anchor[1]
