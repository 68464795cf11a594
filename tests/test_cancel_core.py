"""Cancelling by message id, the pure parts: the store, the decision, and what the
check-in, returning and distributor handlers do with cancels (no broker)."""

import tracemalloc
import uuid
from typing import Dict, List, Optional, Tuple

import pytest
from hypothesis import given, settings, strategies as st

from topology import ChainSettings

from gateway.core import cancels, carrier, envelope, handlers
from gateway.core.actions import Drop, Enqueue, Forward
from gateway.core.inputs import Delivery
from gateway.core.routes import Way
from gateway.core.cancels import BadCancel, Held, Sequencer, Store, Time, after, checked_id
from gateway.core.carrier import Entry
from gateway.core.envelope import Inside
from gateway.core.wire import Properties, Table, long

from .support import examples

CHAIN = ChainSettings(prefix="t", max_level=4, resolution_ms=100)
NAMES = CHAIN.names
NOW = 1_800_000_000_000


def held(*times: Time) -> Held:
    h = Held()
    for t in times:
        h.add(t)
    return h


def taken_in(entry: Entry) -> Optional[Time]:
    """A message's time as broker/run/cancelling.Judge reads it."""
    if entry.accepted_us is None:
        return None
    return Time(entry.accepted_us, envelope.broker_stamp(entry.user.headers, NOW + 60_000))


class Judge:
    """The decision over a plain dict of cancels held, recording what it dropped where."""

    def __init__(self, held: Optional[Dict[bytes, Held]] = None) -> None:
        self.held = held or {}
        self.dropped: List[Tuple[bytes, str]] = []

    def __call__(self, entry: Entry, where: str) -> bool:
        mid = entry.user.get("message_id")
        h = self.held.get(mid) if mid else None
        if h is not None and h.cancels(taken_in(entry)):
            self.dropped.append((mid, where))
            return True
        return False


def message(mid: Optional[str], delay_ms: int = 5000, exchange: str = "t.check-in", **headers) -> Delivery:
    table = Table([long("x-delay", delay_ms)] + [long(k, v) for k, v in headers.items()])
    return Delivery(exchange, b"key", Properties.build(message_id=mid, headers=table), b"body")


def cancel(mid: Optional[str], **headers) -> Delivery:
    props = Properties.build(message_id=mid, headers=Table([long(k, v) for k, v in headers.items()]) or None)
    return Delivery(NAMES.cancel, b"", props, b"")


# -- the decision ------------------------------------------------------------------------------
def test_a_cancel_read_at_or_after_the_message_wins_and_one_before_it_does_not():
    assert after(Time(10), Time(10)) and after(Time(11), Time(10))
    assert not after(Time(9), Time(10))
    assert held(Time(1)).cancels(None)  # a message from before times were kept: any cancel held wins


def test_stamps_are_compared_with_stamps_and_read_times_with_read_times():
    # both stamped: the broker's clock decides, whatever the read times (another replica's)
    assert after(Time(read_us=5, arrived_ms=NOW + 1), Time(read_us=9, arrived_ms=NOW))
    assert not after(Time(read_us=9, arrived_ms=NOW), Time(read_us=5, arrived_ms=NOW + 1))
    # the same millisecond: the order check-in read them in
    assert after(Time(7, NOW), Time(5, NOW)) and not after(Time(5, NOW), Time(7, NOW))
    # one of them unstamped (the interceptor turned on or off between them): read times only
    assert after(Time(7, None), Time(5, NOW + 100)) and not after(Time(5, NOW + 100), Time(7, None))


def test_held_cancels_answer_for_each_kind_of_message():
    h = held(Time(100, NOW), Time(50, None))
    assert h.newest_read_us == 100
    assert h.cancels(Time(90, NOW - 1)) and not h.cancels(Time(90, NOW + 1))
    assert h.cancels(Time(40, NOW + 1))  # the unstamped cancel was read after it
    assert h.cancels(Time(99, None)) and not h.cancels(Time(101, None))
    # the latest stamped cancel is kept, by stamp and then read time, in any order of arrival
    h2 = held(Time(300, NOW + 2), Time(500, NOW + 1), Time(200, NOW + 2))
    assert h2.stamped == Time(300, NOW + 2)


def test_the_sequencer_orders_reads_within_one_millisecond_and_starts_above_a_floor():
    seq = Sequencer()
    times = [seq(NOW) for _ in range(5)] + [seq(NOW - 3)]  # the clock stepped back too
    assert times == sorted(times) and len(set(times)) == 6 and times[0] == NOW * 1000
    restarted = Sequencer().above(times[-1])  # a new process whose clock is behind
    assert restarted(NOW - 1000) > times[-1]


def test_read_times_are_reserved_before_they_are_handed_out_and_a_replacement_starts_above_them():
    """A check-in process hands out no read time above what it reserved in the stream: so a
    replacement whose clock is behind (it starts above every reservation) cannot put a message
    after a cancel published after it, even one the dead process had forwarded."""
    from gateway.core.cancels import LEASE_US, OVERFLOW_US, RENEW_US, read_reservation, reservation
    seq = Sequencer(ceiling=0)
    assert seq.wanted(NOW) == NOW * 1000 + LEASE_US  # (nothing reserved yet: at once)
    seq.reserved(NOW * 1000 + LEASE_US)
    assert read_reservation(reservation(NOW * 1000 + LEASE_US).headers) == NOW * 1000 + LEASE_US
    assert seq(NOW) == NOW * 1000 and seq.wanted(NOW) is None  # well within it: nothing to renew
    near = NOW + (LEASE_US - RENEW_US) // 1000 + 1
    assert seq(near) == near * 1000 and seq.wanted(near) == near * 1000 + LEASE_US  # renewed ahead
    # it cannot renew (the stream is unreachable): past the ceiling, one µs a read
    late = NOW + 10 * LEASE_US // 1000
    times = [seq(late) for _ in range(3)]
    assert times == [NOW * 1000 + LEASE_US + i for i in range(3)]
    # a replacement with its clock 10 s behind starts above the reservation, and its overflow
    replacement = Sequencer(ceiling=0).above(NOW * 1000 + LEASE_US + OVERFLOW_US)
    replacement.reserved(replacement.wanted(NOW - 10_000) or 0)
    assert replacement(NOW - 10_000) > max(times)
    assert Sequencer()(NOW) == NOW * 1000  # (no ceiling: a process that records nothing others read)


@pytest.mark.parametrize("raw, why", [(None, "needs the id"), (b"", "empty"), ("x" * 256, "256 bytes")])
def test_bad_ids_are_refused_with_the_reason(raw, why):
    with pytest.raises(BadCancel, match=why):
        checked_id(raw)


def test_ids_are_bytes_and_255_bytes_is_allowed():
    assert checked_id("é" * 127) == ("é" * 127).encode()
    assert checked_id(b"\xff" * 255) == b"\xff" * 255


def test_a_record_reads_back_and_a_mark_is_no_record():
    assert cancels.read_record(cancels.record(b"order-1", Time(123)).headers) == (b"order-1", Time(123))
    assert cancels.read_record(cancels.record(b"o", Time(123, NOW)).headers) == (b"o", Time(123, NOW))
    assert cancels.read_record(cancels.mark(b"tok").headers) is None
    # a record of the version before: one time, read as the read time
    old = Table([cancels.wire.longstr(cancels.RECORD_ID, b"o"), long(cancels.RECORD_AT, 5)])
    assert cancels.read_record(old) == (b"o", Time(5))


def test_the_brokers_stamp_is_taken_as_it_is_and_only_x_delay_counts_from_it_capped():
    ahead = Table([long("timestamp_in_ms", NOW + 10_000)])
    assert envelope.broker_stamp(ahead, NOW) == NOW + 10_000  # the broker's clock, never mixed with ours
    assert envelope.arrival_stamp(ahead, NOW) == NOW  # x-delay never counts from our future
    assert envelope.broker_stamp(Table([long("timestamp_in_ms", 12)]), NOW) is None  # not plausible
    assert envelope.broker_stamp(Table([long("timestamp_in_ms", NOW + 61_000)]), NOW) is None


# -- the store ---------------------------------------------------------------------------------
def test_the_store_keeps_the_latest_cancel_of_an_id_and_forgets_past_the_window():
    store = Store(window_ms=1000)
    assert store.add(b"a", Time(NOW * 1000), NOW)
    assert store.add(b"a", Time((NOW - 500) * 1000), NOW)  # older record of the same id, out of order
    assert store.get(b"a").newest_read_us == NOW * 1000 == store.newest_read_us
    assert not store.add(b"old", Time((NOW - 2000) * 1000), NOW)  # already outside: nothing held
    assert store.prune(NOW + 600) == 0 and store.get(b"a").newest_read_us == NOW * 1000
    assert store.prune(NOW + 1001) == 1 and store.get(b"a") is None and len(store) == 0


@settings(max_examples=examples(200))
@given(st.lists(st.tuples(st.sampled_from([b"a", b"b", b"c", b"d"]), st.integers(0, 5000)), max_size=60),
       st.integers(0, 6000))
def test_the_store_answers_as_the_latest_record_inside_the_window(records, prune_at):
    store = Store(window_ms=1000)
    base = NOW
    kept = []
    for mid, t in records:
        if store.add(mid, Time((base + t) * 1000), base + t):
            kept.append((mid, (base + t) * 1000))
    store.prune(base + prune_at)
    cutoff = (base + prune_at - 1000) * 1000
    for mid in (b"a", b"b", b"c", b"d"):
        times = [t for m, t in kept if m == mid]
        latest = max(times, default=None)
        got = store.get(mid)
        got_us = None if got is None else got.newest_read_us
        if latest is not None and latest >= cutoff:
            assert got_us == latest  # never forgets a cancel inside the window
        else:
            assert got_us in (None, latest)  # outside the window: forgotten, or soon


def test_memory_per_100000_cancellations_is_bounded_and_measured(record_property):
    store = Store(window_ms=10_000)
    ids = [str(uuid.uuid4()).encode() for _ in range(100_000)]
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    for i, mid in enumerate(ids):
        store.add(mid, Time(NOW * 1000 + i), NOW)
    used = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    record_property("figures", f"cancellations: {used / 1e6:.1f} MB per 100,000 held (36-byte ids, ids counted apart)")
    assert len(store) == 100_000
    assert used < 40_000_000
    store.prune(NOW + 20_000)
    assert len(store) == 0 and store.oldest_us is None


# -- handlers ----------------------------------------------------------------------------------
def test_check_in_records_a_cancel_with_its_time():
    check_in = handlers.CheckIn(CHAIN, 0)
    [record] = check_in(cancel("order-1"), NOW)
    assert isinstance(record, Forward) and record.exchange == NAMES.cancellations and record.mandatory
    assert record.way is Way.CANCEL and record.fence
    mid, at = cancels.read_record(record.props.headers)
    assert mid == b"order-1" and at.read_us // 1000 == NOW and at.arrived_ms is None
    [stamped] = check_in(cancel("order-1", timestamp_in_ms=NOW - 7), NOW)
    _, at2 = cancels.read_record(stamped.props.headers)
    assert at2.arrived_ms == NOW - 7 and at2.read_us > at.read_us


@pytest.mark.parametrize("mid, why", [(None, "needs the id"), ("", "empty")])
def test_a_cancel_without_an_id_is_parked_with_the_reason(mid, why):
    [parked] = handlers.CheckIn(CHAIN, 0)(cancel(mid), NOW)
    assert parked.way == "parked" and why in parked.reason


def test_a_message_on_check_in_is_timed_and_a_cancel_read_later_wins_over_it():
    judge = Judge()
    check_in = handlers.CheckIn(CHAIN, 0, cancelled=judge)
    [sent] = check_in(message("m1"), NOW)
    [rec] = check_in(cancel("m1"), NOW)
    mid, at = cancels.read_record(rec.props.headers)
    assert isinstance(sent, Enqueue) and sent.entry.accepted_us < at.read_us
    judge.held[mid] = held(at)
    assert check_in(message("m1"), NOW) != []  # published again after the cancel: a reschedule
    assert judge.held[mid].cancels(taken_in(sent.entry))  # the first one is cancelled wherever it is


def test_check_in_drops_a_message_whose_cancel_is_held_and_stamped_later():
    judge = Judge({b"m1": held(Time(1, NOW + 5))})  # read long ago by another replica
    check_in = handlers.CheckIn(CHAIN, 0, cancelled=judge)
    [dropped] = check_in(message("m1", timestamp_in_ms=NOW), NOW + 10)
    assert isinstance(dropped, Drop)
    assert judge.dropped == [(b"m1", "check-in")]
    assert check_in(message("m2", timestamp_in_ms=NOW), NOW + 10) != []
    assert check_in(message("m1", timestamp_in_ms=NOW + 6), NOW + 10) != []


def test_the_time_travels_alone_and_in_carriers_and_old_formats_still_read():
    e1 = Entry(b"k1", Properties.build(message_id=b"a"), b"x", NOW, 111)
    e2 = Entry(b"k2", Properties.build(message_id=b"b"), b"y", NOW, None)
    alone = handlers.carry("ex", b"", Way.CHAIN, [e1])
    assert handlers.entries(Delivery("ex", b"", alone.props, alone.body)) == [e1]
    both = handlers.carry("ex", b"", Way.CHAIN, [e1, e2])
    assert handlers.entries(Delivery("ex", b"", both.props, both.body)) == [e1, e2]
    # a carrier and a message from before the time was kept: delivered as they are, untimed
    old = Properties.build(headers=Table([long(envelope.DUE_AT, NOW), long(carrier.COUNT, 2)]))
    assert [e.accepted_us for e in handlers.entries(Delivery("ex", b"", old, both.body))] == [None, None]
    plain = envelope.inside(e1.user, e1.routing_key, NOW)
    assert handlers.entries(Delivery("ex", b"", plain, b"x"))[0].accepted_us is None
    stamped = envelope.inside(e1.user, b"k", NOW, None, 5)
    assert Inside(stamped).next_hop() == stamped


def test_returning_and_the_distributor_drop_cancelled_messages_of_a_carrier():
    cut = Entry(b"k", Properties.build(message_id=b"cut"), b"x", NOW + 50, 100)
    kept = Entry(b"k", Properties.build(message_id=b"kept"), b"y", NOW + 50, 100)
    later = Entry(b"k", Properties.build(message_id=b"cut"), b"z", NOW + 50, 300)  # rescheduled
    both = handlers.carry("ex", b"", Way.CHAIN, [cut, kept, later])
    judge = Judge({b"cut": held(Time(200))})
    d = Delivery("ex", b"", both.props, both.body)
    back = handlers.Returning(CHAIN, 0, cancelled=judge)(d, NOW)
    assert [a.entry for a in back if not isinstance(a, Drop)] == [kept, later]
    assert [a.entry for a in back if isinstance(a, Drop)] == [cut]  # (the index notes it gone)
    out = handlers.Distributor(CHAIN, 0, cancelled=judge)(d, NOW)
    assert [a.entry for a in out if not isinstance(a, Drop)] == [kept, later]
    assert judge.dropped == [(b"cut", "returning"), (b"cut", "distributor")]


def test_the_distributor_asks_again_at_release():
    judge = Judge()
    dist = handlers.Distributor(CHAIN, 0, cancelled=judge)
    e = Entry(b"k", Properties.build(message_id=b"m"), b"x", NOW + 50, 100)
    [kept] = dist(Delivery("ex", b"", handlers.carry("ex", b"", Way.DISTRIBUTOR, [e]).props, b"x"), NOW)
    assert dist.still_wanted(kept)
    judge.held[b"m"] = held(Time(150))
    assert not dist.still_wanted(kept)
