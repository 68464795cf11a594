"""When what waits falls due, as gauges (`--due-gauges-every`): a thread of the `run` process
reads the index of what waits for its virtual host as `delay-gateway pending count` does
(broker/tools/index_reader.py, judged by the cancels and rules held: core/listing.py), and
sets `delay_gateway_waiting_messages` and `_bytes` by when they fall due (the ranges `pending
count` prints), the next due time and how long the most overdue message has been due.

A reading costs CPU in proportion to what waits (about a second per million: BENCHMARKS.md),
so the next one waits 99 times as long as the last took on this thread's CPU clock (times the
vhosts the process serves: one such thread each), and at least --due-gauges-every seconds:
the readings take at most 1 % of a core however much waits (at ten million, about one every
half hour), and `delay_gateway_waiting_read_timestamp_seconds`
says when the figures are from. It has its own connection, like the upkeep; a reading that
fails is logged and tried again at the next turn, and never touches the consumers.
"""

import threading
import time
from typing import Dict, List, Optional

import structlog

from gateway.broker.plumbing.amqp import blocking_channel
from gateway.broker.run import launch
from gateway.broker.tools import cancellations, index_reader
from gateway.clock import wall_ms
from gateway.core import listing
from gateway.core.selection import Selection
from gateway.metrics import Metrics
from gateway.settings import Settings

FIRST_AFTER_S = 10.0  # the first reading, at most this long after the start
BUDGET = 0.01  # of a core: a reading taking t s of CPU is followed by (1 / BUDGET - 1) x t s of rest
# The due ranges of `pending count` (listing.RANGES), as label values
DUE = {"overdue": "overdue", "within 1 minute": "1m", "within 1 hour": "1h", "within 1 day": "1d",
       "within 1 week": "7d", "within 30 days": "30d", "within 1 year": "1y", "later": "later"}


class DueGauges:
    def __init__(self, settings: Settings, stop: threading.Event, metrics: Metrics) -> None:
        self.settings, self.stop, self.metrics = settings, stop, metrics
        self.log = structlog.get_logger("gateway")
        self.last_cpu_s = 0.0

    def run(self) -> None:
        self.stop.wait(min(FIRST_AFTER_S, self.settings.due_gauges_every))  # (the consumers start first)
        while not self.stop.is_set():
            started = time.thread_time()
            try:
                self.read()
            except Exception as exc:  # (the gauges keep their last figures; their timestamp says how old)
                self.log.warning("due_gauges_unread", error=f"{type(exc).__name__}: {exc}")
            self.last_cpu_s = time.thread_time() - started
            self.metrics.waiting_read_cpu.set(self.last_cpu_s)
            self.log.debug("due_gauges_read", cpu_s=round(self.last_cpu_s, 3))
            self.stop.wait(rest_s(self.settings.due_gauges_every, self.last_cpu_s, len(READERS)))

    def read(self) -> None:
        s, now = self.settings, wall_ms()
        with blocking_channel(s.urls, "delay-gateway due gauges", s.tls) as channel:
            connection = channel.connection
            recorded = cancellations.read(connection, s.chain.names, s.cancel_window_ms, s.trusted_user)
            judge = listing.cancelled_by(recorded.store(s.cancel_window_ms, now), recorded.rules, now)
            view, found = index_reader.read(connection, s.chain, s.trusted_user, now,
                                            lambda at: listing.View(now, at, judge, Selection()))
        self.show(figures(view, now), found.exact and not recorded.gaps(), now)

    def show(self, found: Dict[str, float], exact: bool, now_ms: int) -> None:
        m = self.metrics
        for label in DUE.values():
            m.waiting.labels(label).set(found[f"messages {label}"])
            m.waiting_bytes.labels(label).set(found[f"bytes {label}"])
        m.next_due.set(found["next due"])
        m.oldest_overdue.set(found["oldest overdue"])
        m.waiting_exact.set(1 if exact else 0)
        m.waiting_read.set(now_ms / 1000)


def figures(view: listing.View, now_ms: int) -> Dict[str, float]:
    """A reading's gauges: messages and bytes by due range, the next due time (epoch s; 0:
    none) and the age of the most overdue (s; 0: none)."""
    out: Dict[str, float] = {}
    for (label, _), n, size in zip(view.counts.ranges, view.counts.counts, view.counts.bytes, strict=True):
        out[f"messages {DUE[label]}"] = n
        out[f"bytes {DUE[label]}"] = size
    out["next due"] = view.next_due_ms / 1000 if view.next_due_ms is not None else 0.0
    earliest: Optional[int] = view.earliest_due_ms
    out["oldest overdue"] = max(0, now_ms - earliest) / 1000 if earliest is not None and earliest <= now_ms else 0.0
    return out


def rest_s(every_s: float, cpu_s: float, readers: int = 1) -> float:
    """How long to wait before the next reading: at least `every_s`, and long enough that the
    last one's CPU is at most its share of BUDGET (one of `readers`) of the time between two."""
    return max(every_s, cpu_s * (max(1, readers) / BUDGET - 1))


READERS: List[DueGauges] = []  # one per vhost the process serves: they share the budget


def start(settings: Settings, stop: threading.Event, metrics: Metrics) -> Optional[DueGauges]:
    """In a daemon thread until `stop` is set (None with --due-gauges-every 0)."""
    if settings.due_gauges_every <= 0:
        return None
    gauges = DueGauges(settings, stop, metrics)
    READERS.append(gauges)
    launch.daemon("due-gauges", gauges.run)
    return gauges
