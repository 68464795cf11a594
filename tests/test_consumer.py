"""The real consumer (broker.consumer.Pipe and its core) against the fake connection of
tests/fake_broker.py: what each broker event turns into, frame by frame, with the real
handlers and a clock the test moves."""

from collections import deque

import structlog.testing

from gateway.broker.run.consumer import Pipe
from gateway.core import carrier, envelope, wire
from gateway.core.carrier import Batcher
from gateway.core.envelope import Inside
from gateway.core.handlers import CheckIn, Distributor
from gateway.core.wire import Properties, Table
from gateway.metrics import Metrics
from topology import ChainSettings

from .fake_broker import FakeConnection

CHAIN = ChainSettings(prefix="fk", max_level=4, resolution_ms=1000)
NAMES = CHAIN.names


def started(queue: str, handler, batcher=None):
    conn, metrics = FakeConnection(), Metrics()
    pipe = Pipe(conn, queue, handler, 10, metrics, NAMES, clock=conn.clock, batcher=batcher)
    pipe.open()
    conn.settle()
    assert pipe.consuming
    return conn, pipe, metrics


def held_gauge(metrics: Metrics, queue: str) -> float:
    return metrics.registry.get_sample_value("delay_gateway_held_messages", {"vhost": "/", "queue": queue})


def in_gateway_format(conn: FakeConnection, due_in_ms: int, key: bytes = b"orders.eu") -> Properties:
    return envelope.inside(Properties.build(message_id="m"), key, conn.clock() + due_in_ms)


def test_a_held_message_goes_to_pick_up_at_its_time_and_is_acknowledged_after_its_confirm():
    conn, pipe, metrics = started(NAMES.distributor, Distributor(CHAIN, 50))
    conn.consuming().deliver(b"hello", in_gateway_format(conn, 300))
    assert conn.published == [] and held_gauge(metrics, NAMES.distributor) == 1
    conn.advance(299)
    assert conn.published == []
    conn.advance(1)
    [pub] = conn.published
    assert (pub.exchange, pub.routing_key, pub.body, pub.mandatory) == (NAMES.pick_up, b"orders.eu", b"hello", True)
    assert held_gauge(metrics, NAMES.distributor) == 0 and conn.consuming().acks == []
    conn.publishing().confirm(pub.seq)
    conn.advance(5)  # acknowledgements wait a little for company
    assert conn.consuming().acks == [(1, True)]


def test_a_carriers_messages_due_together_go_out_in_its_order_and_it_is_acked_after_the_last():
    """Released in one event (one answer from the ledger for them all): those due now as the
    carrier is read, then those held, one cancelled among them, all due at the same tick."""
    handler = Distributor(CHAIN, 50, cancelled=lambda e, where: where == "release" and e.body == b"m3")
    conn, metrics = FakeConnection(), Metrics()
    pipe = Pipe(conn, NAMES.distributor, handler, 10, metrics, NAMES, clock=conn.clock,
                still_wanted=handler.still_wanted)
    pipe.open()
    conn.settle()
    now = conn.clock()
    due = [now, now, now + 300, now + 300, now + 300, now + 300]
    entries = [carrier.Entry(f"k{i}".encode(), Properties.build(message_id=f"m{i}"), f"m{i}".encode(), d)
               for i, d in enumerate(due)]
    conn.consuming().deliver(carrier.pack(entries), carrier.properties(entries))
    assert [p.body for p in conn.published] == [b"m0", b"m1"] and held_gauge(metrics, NAMES.distributor) == 4
    conn.advance(300)
    assert [(p.routing_key, p.body) for p in conn.published] == [(b"k0", b"m0"), (b"k1", b"m1"), (b"k2", b"m2"),
                                                                  (b"k4", b"m4"), (b"k5", b"m5")]
    assert held_gauge(metrics, NAMES.distributor) == 0
    for pub in conn.published[:-1]:
        conn.publishing().confirm(pub.seq)
    conn.advance(5)
    assert conn.consuming().acks == []  # (the last is not confirmed yet)
    conn.publishing().confirm(conn.published[-1].seq)
    conn.advance(5)
    assert conn.consuming().acks == [(1, True)]


def test_a_message_nobody_is_bound_for_comes_back_and_is_parked_instead():
    conn, pipe, _ = started(NAMES.distributor, Distributor(CHAIN, 50))
    conn.consuming().deliver(b"lost?", in_gateway_format(conn, 0))
    [pub] = conn.published
    conn.publishing().give_back(pub)
    conn.publishing().confirm(pub.seq)
    [_, parked] = conn.published
    assert parked.exchange == NAMES.parked and parked.body == b"lost?"
    assert "unroutable" in Inside(parked.props).error and conn.consuming().acks == []
    conn.publishing().confirm(parked.seq)
    conn.advance(5)
    assert conn.consuming().acks == [(1, True)]


def test_check_in_sends_a_carrier_when_the_batch_is_full_or_old_enough():
    handler = CheckIn(CHAIN, 50, wait_ms=20)
    conn, pipe, _ = started(NAMES.check_in, handler, Batcher(3, 100_000, 20))
    in_five_s = Properties.build(headers=Table([wire.long("x-delay", 5000)]))
    for i in range(4):
        conn.consuming().deliver(f"m{i}".encode(), in_five_s)
    [full] = conn.published  # three went together at once
    assert [e.body for e in carrier.unpack(full.body)] == [b"m0", b"m1", b"m2"]
    conn.advance(20)  # the fourth, alone, once its batch is old enough
    [_, alone] = conn.published
    assert alone.body == b"m3"
    conn.publishing().confirm(alone.seq, multiple=True)
    conn.advance(5)
    assert conn.consuming().acks == [(4, True)]


def test_a_message_due_within_the_carrier_wait_reaches_the_distributor_by_its_lead():
    handler = CheckIn(CHAIN, 50, wait_ms=200)
    conn, pipe, _ = started(NAMES.check_in, handler, Batcher(1000, 1_000_000, 200))
    conn.consuming().deliver(b"soon", Properties.build(headers=Table([wire.long("x-delay", 120)])))
    conn.advance(69)
    assert conn.published == []
    conn.advance(1)  # due in 120 ms, the distributor's lead is 50: it goes at 70, not at 200
    [pub] = conn.published
    assert pub.exchange == NAMES.distributor and pub.body == b"soon"
    conn.consuming().deliver(b"now", Properties.build(headers=Table([wire.long("x-delay", 0)])))
    conn.advance(0)
    assert [p.body for p in conn.published] == [b"soon", b"now"]


def test_check_in_does_not_wait_for_company_that_cannot_come():
    # Half its prefetch (10) waiting for company: the open batches (two routes here, neither
    # full) go at once instead of after their wait, so that the broker goes on delivering
    # the other half while they wait for confirms (at a full prefetch it would send nothing
    # more until acks).
    handler = CheckIn(CHAIN, 50, wait_ms=200)
    conn, pipe, _ = started(NAMES.check_in, handler, Batcher(1000, 1_000_000, 200))
    for i in range(4):
        delay = 5000 if i % 2 else 9000
        conn.consuming().deliver(b"m", Properties.build(headers=Table([wire.long("x-delay", delay)])))
    assert conn.published == []  # room for more: they wait for company
    conn.consuming().deliver(b"m", Properties.build(headers=Table([wire.long("x-delay", 5000)])))
    assert sorted(len(carrier.unpack(p.body)) for p in conn.published) == [2, 3]
    for _ in range(5):  # the other half: the same again, though none of the first is acknowledged yet
        conn.consuming().deliver(b"m", Properties.build(headers=Table([wire.long("x-delay", 5000)])))
    assert sorted(len(carrier.unpack(p.body)) for p in conn.published) == [2, 3, 5]


def test_a_message_the_broker_refuses_is_found_and_parked_without_touching_the_others():
    conn, pipe, _ = started(NAMES.distributor, Distributor(CHAIN, 50))
    for body in (b"a", b"poison", b"c"):
        conn.consuming().deliver(body, in_gateway_format(conn, 0))
    first = conn.publishing()
    with structlog.testing.capture_logs() as logs:
        first.close_by_broker(406, "PRECONDITION_FAILED - message too large")
        conn.settle()  # a new publishing channel: the three again, one at a time
    assert any(e["event"] == "publish_refused_by_broker" for e in logs)
    second = conn.publishing()
    assert second is not first
    [a] = [p for p in conn.published if p.channel is second]
    second.confirm(a.seq)
    poison = conn.published[-1]
    assert poison.body == b"poison"
    second.close_by_broker(406, "PRECONDITION_FAILED - message too large")  # alone on it: that one
    conn.settle()
    third = conn.publishing()
    [c] = [p for p in conn.published if p.channel is third]  # the last suspect, alone
    assert c.body == b"c"
    third.confirm(c.seq)
    parked = conn.published[-1]  # then what waited: the refused one's parked copy
    assert parked.exchange == NAMES.parked and "message too large" in Inside(parked.props).error
    third.confirm(parked.seq)
    conn.advance(5)
    # (a's at once, with nothing else awaiting a confirm: or all three together)
    assert conn.consuming().acks in ([(3, True)], [(1, True), (3, True)]) and conn.consuming().nacks == []


def test_stopping_hands_held_messages_back_to_the_distributor_queue():
    conn, pipe, metrics = started(NAMES.distributor, Distributor(CHAIN, 50))
    conn.consuming().deliver(b"later", in_gateway_format(conn, 10_000))
    stopped = []
    pipe.stop(lambda: stopped.append(True))
    conn.settle()
    [back] = conn.published
    assert back.exchange == NAMES.distributor and Inside(back.props).due_ms == conn.clock() + 10_000
    assert held_gauge(metrics, NAMES.distributor) == 0 and not stopped
    conn.publishing().confirm(back.seq)
    assert stopped == [True] and conn.consuming().acks == [(1, True)]


def test_a_refused_publish_is_retried_a_second_later_and_then_the_connection_starts_over():
    conn, pipe, _ = started(NAMES.distributor, Distributor(CHAIN, 50))
    conn.consuming().deliver(b"x", in_gateway_format(conn, 0))
    for attempt in range(3):
        conn.publishing().confirm(conn.published[-1].seq, ack=False)
        conn.advance(999)
        assert len(conn.published) == attempt + 1
        conn.advance(1)
        assert len(conn.published) == attempt + 2
    assert conn.is_open
    conn.publishing().confirm(conn.published[-1].seq, ack=False)  # the fourth refusal
    assert not conn.is_open  # (and the broker hands the delivery to the next connection)


def test_handler_failures_park_the_delivery_whole():
    def broken(_d, _now):
        raise RuntimeError("a bug")
    conn, pipe, _ = started(NAMES.check_in, broken)
    conn.consuming().deliver(b"body", Properties.build(message_id="m"), routing_key="k.1")
    [parked] = conn.published
    assert parked.exchange == NAMES.parked and parked.routing_key == b"k.1" and "a bug" in Inside(parked.props).error


def test_a_cancel_is_a_fence_its_record_waits_for_every_ack_before_it_and_holds_back_those_after():
    """Check-in's fence (flow.Flow): the cancel closes the open carriers at once, its record
    goes out only after the acks of every delivery before it and a basic.qos round trip,
    and nothing read after it is acknowledged before it."""
    handler = CheckIn(CHAIN, 50, wait_ms=200)
    conn, pipe, _ = started(NAMES.check_in, handler, Batcher(100, 100_000, 200))
    in_five_s = Properties.build(message_id="m", headers=Table([wire.long("x-delay", 5000)]))
    conn.consuming().deliver(b"m1", in_five_s)
    conn.consuming().deliver(b"m2", in_five_s)
    assert conn.published == []  # waiting for company
    conn.frames.clear()
    conn.consuming().deliver(b"", Properties.build(message_id="m"), exchange=NAMES.cancel)  # tag 3
    [carried] = conn.published  # the open carrier went at once; the record waits
    assert carried.exchange != NAMES.cancellations and len(carrier.unpack(carried.body)) == 2
    conn.consuming().deliver(b"m4", in_five_s)  # read after the cancel: a reschedule
    conn.advance(200)
    [_, after] = conn.published
    conn.publishing().confirm(after.seq)  # m4 done first: still not acknowledged
    assert conn.consuming().acks == []
    conn.publishing().confirm(carried.seq)  # m1, m2 done: acknowledged now, then the sync
    assert conn.consuming().acks == [(2, True)] and conn.frames[-1] == ("qos", conn.consuming().number)
    assert all(p.exchange != NAMES.cancellations for p in conn.published)
    conn.settle()  # basic.qos-ok: the broker has the acks; the record goes out
    record = conn.published[-1]
    assert record.exchange == NAMES.cancellations and record.mandatory
    assert conn.frames.index(("ack", 2, True)) < conn.frames.index(("qos", conn.consuming().number)) \
        < conn.frames.index(("publish", NAMES.cancellations))
    conn.advance(5)
    assert conn.consuming().acks == [(2, True)]  # m4 still waits for the cancel
    conn.publishing().confirm(record.seq)
    conn.advance(5)
    assert conn.consuming().acks == [(2, True), (4, True)]


def test_consecutive_cancels_are_recorded_together_and_a_lost_connection_forgets_the_fences():
    handler = CheckIn(CHAIN, 50, wait_ms=200)
    conn, pipe, _ = started(NAMES.check_in, handler, Batcher(100, 100_000, 200))
    for mid in ("a", "b", "c"):
        conn.consuming().deliver(b"", Properties.build(message_id=mid), exchange=NAMES.cancel)
    conn.settle()  # nothing before them: one sync opens all three
    assert [p.exchange for p in conn.published] == [NAMES.cancellations] * 3
    assert conn.frames.count(("qos", conn.consuming().number)) == 2  # the consumer's own, and one sync
    conn.consuming().deliver(b"x", Properties.build(message_id="x", headers=Table([wire.long("x-delay", 5000)])))
    conn.consuming().deliver(b"", Properties.build(message_id="x"), exchange=NAMES.cancel)
    conn.close()  # everything unacknowledged goes back to the queue; nothing is left waiting
    assert pipe.flow._fenced == deque() and not pipe.flow._syncing


def test_check_in_says_it_caught_up_once_it_read_its_backlog_and_recorded_the_cancels_in_it():
    """worker.Session starts the other consumers then, once the gateway follows those records
    too (a cancel a dead process read but did not record must be in place before a message
    it cancels is released)."""
    told = []
    conn = FakeConnection(backlog=2)
    handler = CheckIn(CHAIN, 50, wait_ms=200)
    pipe = Pipe(conn, NAMES.check_in, handler, 10, Metrics(), NAMES, clock=conn.clock,
                batcher=Batcher(100, 100_000, 200), on_caught_up=lambda: told.append(conn.clock()))
    pipe.open()
    conn.settle()
    assert pipe.consuming and told == []
    in_five_s = Properties.build(message_id="m", headers=Table([wire.long("x-delay", 5000)]))
    conn.consuming().deliver(b"m1", in_five_s)
    conn.consuming().deliver(b"", Properties.build(message_id="m"), exchange=NAMES.cancel)
    assert told == []  # the backlog is read, but its cancel not recorded yet
    conn.publishing().confirm(conn.published[0].seq)
    conn.settle()  # the sync answered: the record goes out
    record = conn.published[-1]
    assert record.exchange == NAMES.cancellations and told == []
    conn.publishing().confirm(record.seq)  # confirmed, and the cancel acknowledged
    conn.advance(5)
    assert conn.consuming().acks[-1] == (2, True) and len(told) == 1
    conn.consuming().deliver(b"m3", in_five_s)
    assert len(told) == 1  # once

    empty = FakeConnection()
    told.clear()
    Pipe(empty, NAMES.check_in, CheckIn(CHAIN, 50), 10, Metrics(), NAMES,
         clock=empty.clock, on_caught_up=lambda: told.append(0)).open()
    empty.settle()
    assert told == [0]
