"""The gateway's one wall clock: due times are epoch milliseconds, compared across hosts."""

import time


def wall_ms() -> int:
    return time.time_ns() // 1_000_000
