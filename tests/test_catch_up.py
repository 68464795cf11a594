"""The catch-up after an outage (--catch-up-rate): the pace itself, then the distributor's
consumer with it against the fake connection of tests/fake_broker.py, a clock the test moves."""

import random

from hypothesis import given, strategies as st

from gateway.broker.run.consumer import Pipe
from gateway.core import carrier
from gateway.core.catch_up import OVERDUE_AFTER_MS, CatchUp
from gateway.core.envelope import Inside
from gateway.core.flow import Flow
from gateway.core.inputs import Delivery
from gateway.core.handlers import Distributor
from gateway.core.wire import Properties
from gateway.metrics import Metrics
from topology import ChainSettings

from .fake_broker import FakeConnection
from .test_shorter_path import _Quiet

CHAIN = ChainSettings(prefix="cu", max_level=4, resolution_ms=1000)
NAMES = CHAIN.names


@given(st.floats(0.5, 5000), st.lists(st.integers(0, 3000), max_size=60))
def test_the_pace_never_allows_more_than_its_rate_and_a_tenth_of_a_second_at_once(rate, steps):
    pace, now, released = CatchUp(rate), 1_000_000, 0
    start = now
    for step in steps:
        now += step
        allowed = pace.allowance(now)
        assert allowed >= 0
        pace.spent(allowed)
        released += allowed
        assert released <= max(1, rate / 10) + rate * (now - start) / 1000
        assert pace.next_at() > now  # (spent all: the next release is later)


def test_the_pace_allows_its_rate_over_time():
    pace, now, released = CatchUp(100), 0, 0
    while now < 10_000:
        now = max(now + 1, pace.next_at())
        n = pace.allowance(now)
        pace.spent(n)
        released += n
    assert 995 <= released <= 1011  # 100 a second over ten, and the first tenth at once


def distributor(rate: float, cancelled=None):
    handler = Distributor(CHAIN, 50, cancelled=cancelled)
    conn, metrics = FakeConnection(), Metrics()
    pipe = Pipe(conn, NAMES.distributor, handler, 100, metrics, NAMES, clock=conn.clock,
                still_wanted=handler.still_wanted if cancelled else None, catch_up=CatchUp(rate))
    pipe.open()
    conn.settle()
    return conn, pipe, metrics


def overdue_gauge(metrics: Metrics) -> float:
    return metrics.registry.get_sample_value("delay_gateway_overdue_messages", {"vhost": "/",
                                                                                 "queue": NAMES.distributor})


def carried(dues, prefix="m", accepted_us=None):
    entries = [carrier.Entry(b"k", Properties.build(message_id=f"{prefix}{i}"), f"{prefix}{i}".encode(), d,
                             accepted_us) for i, d in enumerate(dues)]
    return carrier.pack(entries), carrier.properties(entries)


def test_overdue_messages_go_at_the_pace_most_overdue_first_while_one_due_later_goes_on_time():
    conn, pipe, metrics = distributor(rate=10)  # one at a time, every 100 ms
    now = conn.clock()
    dues = [now - 60_000 + 1000 * i for i in range(20)]
    random.Random(7).shuffle(dues)
    conn.consuming().deliver(*carried(dues))
    assert len(conn.published) == 1 and overdue_gauge(metrics) == 19
    conn.consuming().deliver(*carried([now + 500], "t"))  # on time: due in half a second
    conn.consuming().deliver(*carried([now - OVERDUE_AFTER_MS], "late"))  # a second late: not overdue
    assert [p.body for p in conn.published] == [b"m%d" % dues.index(min(dues)), b"late0"]
    for _ in range(4):
        conn.advance(100)
    assert len(conn.published) == 2 + 4 and b"t0" not in [p.body for p in conn.published]
    conn.advance(100)  # its time: released then, before that tick's overdue one
    assert [p.body for p in conn.published[-2:]][0] == b"t0" and len(conn.published) == 2 + 5 + 1
    in_order = [b"m%d" % dues.index(d) for d in sorted(dues)]  # most overdue first
    assert [p.body for p in conn.published if p.body.startswith(b"m")] == in_order[:6]
    while overdue_gauge(metrics):
        conn.advance(100)
    assert [p.body for p in conn.published if p.body.startswith(b"m")] == in_order
    assert conn.clock() - now == 1900  # twenty at ten a second, the first at once
    for pub in conn.published:
        conn.publishing().confirm(pub.seq)
    conn.advance(5)
    assert sorted(tag for tag, _ in conn.consuming().acks)[-1] == 3 and conn.consuming().nacks == []


def test_a_publishers_time_in_the_past_neither_jumps_the_catch_up_nor_waits_for_it():
    """Hostile: x-deliver-at a day ago, taken in by check-in just now, is not a backlog: it
    goes at once, ahead of nothing it could starve, and piles up nowhere; a genuine backlog
    (due, then taken in, long ago) keeps its pace and its order."""
    conn, pipe, metrics = distributor(rate=10)
    now = conn.clock()
    conn.consuming().deliver(*carried([now - 60_000 + i for i in range(5)], "m", (now - 61_000) * 1000))
    assert [p.body for p in conn.published] == [b"m0"] and overdue_gauge(metrics) == 4
    forged = [now - 86_400_000] * 50  # due a day ago, accepted 100 ms ago
    conn.consuming().deliver(*carried(forged, "past", (now - 100) * 1000))
    assert [p.body for p in conn.published] == [b"m0"] + [b"past%d" % i for i in range(50)]
    assert overdue_gauge(metrics) == 4  # (the backlog as it was: none of the fifty joined it)
    conn.advance(100)
    assert conn.published[-1].body == b"m1"


def test_a_cancel_wins_over_an_overdue_message_waiting_for_the_pace():
    gone = set()
    conn, pipe, metrics = distributor(rate=10, cancelled=lambda e, where: e.body in gone)
    now = conn.clock()
    conn.consuming().deliver(*carried([now - 10_000, now - 9_000, now - 8_000]))
    gone.add(b"m1")
    while overdue_gauge(metrics):
        conn.advance(100)
    assert [p.body for p in conn.published] == [b"m0", b"m2"]


def test_stopping_hands_overdue_messages_back_to_the_distributor_queue():
    conn, pipe, metrics = distributor(rate=1)
    now = conn.clock()
    conn.consuming().deliver(*carried([now - 5_000, now - 4_000]))
    [first] = conn.published
    pipe.stop(lambda: None)
    conn.settle()
    [back] = conn.published[1:]
    assert back.exchange == NAMES.distributor and Inside(back.props).due_ms == now - 4_000
    assert overdue_gauge(metrics) == 0 and first.body == b"m0"


def test_without_a_rate_overdue_messages_go_at_once():
    handler = Distributor(CHAIN, 50)
    conn, metrics = FakeConnection(), Metrics()
    pipe = Pipe(conn, NAMES.distributor, handler, 100, metrics, NAMES, clock=conn.clock)
    pipe.open()
    conn.settle()
    conn.consuming().deliver(*carried([conn.clock() - 60_000] * 50))
    assert len(conn.published) == 50 and overdue_gauge(metrics) == 0


def test_a_wall_clock_stepped_back_does_not_stop_the_catch_up():
    """The pace counts on the steady clock: the wall clock stepped back an hour in the middle
    of a catch-up, the overdue messages still go at the rate as real time passes."""
    now = 1_700_000_000_000
    flow = Flow(NAMES.distributor, NAMES, Distributor(CHAIN, 50), _Quiet(), catch_up=CatchUp(10))
    flow.publishing_opened(now)
    body, props = carried([now - 60_000 + i for i in range(10)])
    out = flow.delivered(1, Delivery(NAMES.distributor, b"", props, body), now, steady=now)
    assert len(out.publish) == 1 and flow.behind == 9 and flow.next_wake() == now + 100
    hour = 3_600_000
    for k in range(1, 10):  # each 100 ms of real time, the wall clock an hour behind
        out = flow.tick(now + 100 * k - hour, steady=now + 100 * k)
        assert len(out.publish) == 1 and flow.behind == 9 - k, k
        assert flow.behind == 0 or flow.next_wake() == now + 100 * (k + 1) - hour  # (by the wall clock)
