"""How far `schedule` got publishing: the tally its publishing threads keep, and the line that
says it on stderr (and in the log) every few seconds and once at the end."""

import sys
import threading
import time
from dataclasses import dataclass, field
from typing import List, Tuple

import structlog

log = structlog.get_logger("schedule")


@dataclass
class Tally:
    """What the publishing threads report to the progress printer."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    published: int = 0
    partitions: int = 0
    seconds: float = 0.0  # of the publishing phase
    failures: List[Tuple[int, str]] = field(default_factory=list)


class ProgressLine:
    """Says every `interval` seconds (and once at the end) how far publishing got."""

    def __init__(self, interval: float, tally: Tally, total: int, parts: int) -> None:
        self.interval, self.tally, self.total, self.parts = interval, tally, total, parts
        self.started = time.monotonic()

    def every_interval(self, stop: threading.Event) -> None:
        if self.interval <= 0:
            return
        while not stop.wait(self.interval):
            self.say()

    def say(self) -> None:
        if self.interval <= 0:
            return
        tally, total, parts = self.tally, self.total, self.parts
        with tally.lock:
            published, done, failed = tally.published, tally.partitions, len(tally.failures)
        elapsed = time.monotonic() - self.started
        rate = published / elapsed if elapsed > 0 else 0.0
        left = f", about {int((total - published) / rate)} s left" if rate > 0 and published < total else ""
        share = 100 * published // total if total else 100
        print(f"schedule: published {published:,} of {total:,} rows ({share} %), {done} of {parts} partitions"
              f"{f', {failed} failed' if failed else ''}, {rate:,.0f} rows/s{left}", file=sys.stderr, flush=True)
        log.info("schedule_progress", published=published, total=total, partitions_done=done,
                 partitions=parts, failed=failed, rows_per_second=round(rate))
