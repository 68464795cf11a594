"""The index of what waits, on the pure core (gateway/core/waiting.py, the Flow's recorder):
its records read back exactly, the view's rules (a later entry of a message supersedes an
earlier one, done and cancelled ones leave, overdue ones stay within the horizon), and,
against a model of the broker with crashes at any moment, that the index names every
message that waits and none that does not."""

import random
from typing import Dict, List, Optional

import pytest
from hypothesis import given, settings, strategies as st

from topology import ChainSettings
from topology.routing import topic_matches
from topology.waiting import band, bands, span_ms

from gateway.core import cancels, handlers, waiting
from gateway.core.inputs import Delivery
from gateway.core.routes import Way
from gateway.core.carrier import Batcher, Entry
from gateway.core.flow import Flow
from gateway.core.waiting import Horizon, Listed, Recorder, Selection, View
from gateway.core.wire import Properties, Table, long, longstr

from .support import examples

NOW = 1_800_000_000_000
CHAIN = ChainSettings(prefix="w", max_level=4, resolution_ms=1000)
NAMES = CHAIN.names
ids = st.binary(min_size=0, max_size=255)
keys = st.binary(min_size=0, max_size=255)


def entry(key: bytes = b"k", mid: Optional[bytes] = b"m", due: int = NOW + 60_000, read_us: int = NOW * 1000,
          body: bytes = b"body", exchange: Optional[str] = None, headers: Optional[Table] = None) -> Entry:
    values = {"headers": headers} if headers is not None else {}
    if mid is not None:
        values["message_id"] = mid
    return Entry(key, Properties.build(**values), body, due, read_us, exchange)


def listed(e: Entry, until: int) -> Listed:
    [m] = waiting.entries(waiting.pack_entries([waiting.entry_record(e, until)]))
    return m


# -- records -------------------------------------------------------------------------------------
@settings(max_examples=examples(300))
@given(st.lists(st.tuples(keys, st.one_of(st.none(), ids.filter(bool)), st.integers(0, 2**62),
                          st.integers(-2**62, 2**62), st.binary(max_size=64), st.booleans(), st.integers(0, 70_000)),
                max_size=20))
def test_entries_read_back_exactly(items):
    sent = []
    for key, mid, read_us, due, body, retry, attempt in items:
        headers = Table([long("x-retry-attempt", attempt)]) if retry else Table([longstr("h", b"\x00\xff")])
        sent.append((entry(key, mid, due, read_us, body, "" if retry else None, headers), due + 5))
    got = list(waiting.entries(waiting.pack_entries([waiting.entry_record(e, until) for e, until in sent])))
    assert len(got) == len(sent)
    for (e, until), m in zip(sent, got, strict=True):
        assert (m.routing_key, m.message_id, m.read_us, m.due_ms, m.until_ms, m.size) == \
            (e.routing_key, e.user.get("message_id"), e.accepted_us, e.due_ms, until, len(e.body))
        assert m.props == e.user.raw and m.retry == (e.exchange == "")
        attempt = e.user.headers.get("x-retry-attempt")
        assert m.retry_attempt == (attempt if m.retry and 0 < attempt < 65536 else None)
        assert m.key == waiting.key_of(e.accepted_us, cancels.checksum(e.routing_key, e.user.raw, e.body))


def test_done_keys_and_beats_read_back_and_nothing_else_reads_as_them():
    a, b = entry(b"a", read_us=1), entry(b"b", read_us=2)
    assert waiting.done_keys(waiting.pack_done([waiting.done_key(a), waiting.done_key(b)])) == \
        [waiting.key_of(1, waiting.checksum(a)), waiting.key_of(2, waiting.checksum(b))]
    assert waiting.done_key(entry(read_us=None)) is None  # (from before read times were kept: never indexed)
    beat = waiting.beat(waiting.pack_beat(b"g" * 16, 3, NOW - 5, NOW))
    assert beat == waiting.Beat(b"g" * 16, 3, NOW - 5, NOW)
    for other in (b"", b"DGM1" + b"x" * 16, waiting.pack_done([]), b"DGW1\xff\xff\xff\xff"):
        assert list(waiting.entries(other)) == [] and waiting.beat(other) is None
    assert waiting.done_keys(waiting.pack_entries([])) == []


@settings(max_examples=examples(200))
@given(st.integers(0, 2**62), st.integers(0, 2**32 - 1))
def test_a_handle_names_its_read_time_and_is_a_message_id(read_us, crc):
    h = cancels.handle(read_us, crc).encode("ascii")
    assert len(h) == cancels.HANDLE_BYTES and cancels.handle_read_us(h) == read_us
    assert cancels.checked_id(h) == h
    assert cancels.handle_read_us(b"order-42") is None and cancels.handle_read_us(b"@" + b"!" * 20) is None


def test_a_store_knows_the_read_times_its_handles_name_until_it_forgets_them():
    store = cancels.Store(window_ms=1000)
    h = cancels.handle(5, 7).encode("ascii")
    store.add(h, cancels.Time(NOW * 1000), NOW)
    store.add(b"plain-id", cancels.Time(NOW * 1000), NOW)
    assert store.handle_times == {5: 1}
    store.prune(NOW + 2000)
    assert store.handle_times == {} and not len(store)


def test_bands_hold_waits_up_to_four_to_the_b_seconds():
    assert [band(ms) for ms in (0, 1000, 1001, 4000, 4001, 16_000, 86_400_000)] == [0, 0, 1, 1, 2, 2, 9]
    assert band(10**15) == waiting_top() and span_ms(1) == 4000
    assert bands(ChainSettings()) == 11  # a lap of 2^20 s is 4^10 s less a second
    assert bands(CHAIN) == 3 and bands(ChainSettings(max_level=3, resolution_ms=100)) == 1


def waiting_top() -> int:
    from topology.waiting import BANDS
    return BANDS - 1


@settings(max_examples=examples(300))
@given(st.lists(st.sampled_from(["a", "b", "*", "#", ""]), min_size=0, max_size=4),
       st.lists(st.sampled_from(["a", "b", "c", ""]), min_size=0, max_size=5))
def test_key_patterns_match_as_rabbitmq_matches(pattern_words, key_words):
    pattern, key = ".".join(pattern_words), ".".join(key_words)
    # RabbitMQ splits "" into no words at all, a pattern as a key
    if not key:
        expected = all(w == "#" for w in pattern.split(".")) if pattern else True
    else:
        expected = topic_matches(pattern, key) if pattern else False
    assert waiting.topic_pattern(pattern)(key.encode()) == expected, (pattern, key)


# -- the view ------------------------------------------------------------------------------------
EXACT = Horizon(NOW - waiting.GRACE_MS, True, "")


def view(select=None, cancelled=None, limit=0, at=EXACT) -> View:
    return View(NOW, at, cancelled or (lambda m: False), select or (lambda m: True), limit)


def test_a_later_entry_of_a_message_supersedes_an_earlier_one_in_any_order():
    e = entry(due=NOW + 10 * 86_400_000)
    lap_ended = listed(e, NOW - 1000)  # its meditation lap ended a second ago
    next_lap = listed(e, NOW + 5000)
    for order in ([lap_ended, next_lap], [next_lap, lap_ended]):
        v = view()
        for m in order:
            v.add(m)
        v.finish()
        assert v.total == 1 and v.listed() == [next_lap]


def test_overdue_within_the_horizon_waits_and_leaves_when_done():
    e = entry(due=NOW - 30_000)
    v = view()
    v.add(listed(e, e.due_ms))  # due half a minute ago, no gateway delivered it yet
    v.finish()
    assert v.total == 1 and v.counts.counts[0] == 1  # overdue
    v = view()
    v.add_done([waiting.key_of(e.accepted_us, waiting.checksum(e))])
    v.add(listed(e, e.due_ms))
    v.finish()
    assert v.total == 0
    old = entry(due=NOW - waiting.GRACE_MS - 1)
    v = view()
    v.add(listed(old, old.due_ms))  # past the horizon: delivered by gateways that keep up
    v.finish()
    assert v.total == 0
    v = view(at=Horizon(NOW - 3_600_000, False, "no gateway"))
    v.add(listed(old, old.due_ms))
    v.finish()
    assert v.total == 1


def test_a_copy_read_again_after_a_crash_is_listed_as_the_copy_it_is():
    first, again = entry(read_us=NOW * 1000), entry(read_us=NOW * 1000 + 7)
    v = view()
    for m in (listed(first, first.due_ms), listed(again, again.due_ms), listed(first, first.due_ms)):
        v.add(m)
    v.finish()
    assert v.total == 2


def test_two_processes_reading_in_the_same_microsecond_list_two_messages():
    """Read times of two gateways meet (each counts from its millisecond); a message's key,
    property or body tells them apart, even on the same routing key."""
    a, b = entry(b"load.1", b"m-1", read_us=NOW * 1000), entry(b"load.1", b"m-2", read_us=NOW * 1000)
    v = view()
    v.add(listed(a, a.due_ms))
    v.add(listed(b, b.due_ms))
    v.finish()
    assert v.total == 2


def test_cancels_by_id_after_the_message_and_by_handle_always():
    store = cancels.Store(window_ms=10**9)
    t = NOW * 1000
    by_id, by_handle, after, spared = (entry(b"k", b"x", read_us=t + 10), entry(b"k", None, read_us=t + 20),
                                       entry(b"k", b"y", read_us=t + 30), entry(b"k", b"z", read_us=t + 40))
    store.add(b"x", cancels.Time(t + 11), NOW)
    store.add(b"y", cancels.Time(t + 29), NOW)  # before the message (a reschedule): it stays
    store.add(cancels.handle(t + 20, waiting.checksum(by_handle)).encode(), cancels.Time(t + 1), NOW)
    v = view(cancelled=waiting.cancelled_by(store, NOW))
    for e in (by_id, by_handle, after, spared):
        v.add(listed(e, e.due_ms))
    v.finish()
    assert [m.message_id for m in v.listed()] == [b"y", b"z"]


def test_filters_combine_and_the_soonest_due_are_kept():
    ms = [entry(b"orders.42.reminder", b"a1", NOW + 3_600_000, 1), entry(b"orders.421.x", b"a2", NOW + 60_000, 2),
          entry(b"orders.42.reminder", b"b1", NOW + 90_000_000, 3,
                headers=Table([long("customer", 42), longstr("tier", b"gold")])),
          entry(b"orders.42.other", None, NOW + 10_000, 4, headers=Table([longstr("customer", b"42")])),
          entry(b"jobs", b"r1", NOW + 5000, 5, exchange="", headers=Table([long("x-retry-attempt", 3)]))]

    def chosen(**given) -> List[int]:
        v = view(Selection(**given))
        for e in ms:
            v.add(listed(e, e.due_ms))
        v.finish()
        return [m.read_us for m in v.listed()]
    assert chosen(key="orders.42.#") == [4, 1, 3]
    assert chosen(key="orders.42.#", due_after_ms=NOW + 60_000, due_before_ms=NOW + 86_400_000) == [1]
    assert chosen(headers=(("customer", "42"),)) == [4, 3]
    assert chosen(headers=(("customer", "42"), ("tier", "gold"))) == [3]
    assert chosen(ids=(b"a*",)) == [2, 1] and chosen(ids=(b"a1", b"r1")) == [5, 1]
    assert chosen(ids=(cancels.handle(4, waiting.checksum(ms[3])).encode(),)) == [4]
    assert chosen(retries=True) == [5]
    v = view(limit=2)
    for e in ms:
        v.add(listed(e, e.due_ms))
    v.finish()
    assert [m.read_us for m in v.listed()] == [5, 4] and v.total == 5


@pytest.mark.parametrize("places,beats,exact", [
    ({"distributor": (0, 1), "returning": (0, 1)}, [(3, NOW - 1000)], True),
    ({"distributor": (0, 2), "returning": (0, 1)}, [(3, NOW - 1000)], False),  # a consumer that said nothing
    ({"distributor": (5, 1), "returning": (0, 1)}, [(3, NOW - 1000)], False),  # unread in the distributor queue
    ({"distributor": (0, 0), "returning": (0, 0)}, [], False),  # no gateway
    ({"distributor": (0, 1), "returning": (0, 1)}, [(3, NOW - 60_000)], False),  # its last beat is old
    ({"distributor": (0, 1), "returning": (0, 1)}, [(2, NOW - 1000), (1, NOW - 900)], True),  # roles split
])
def test_the_horizon_is_a_minute_only_while_every_consumer_keeps_up(places, beats, exact):
    found = waiting.horizon(NOW, [waiting.Beat(bytes([i]) * 16, roles, NOW - 10, at)
                                  for i, (roles, at) in enumerate(beats)], places)
    assert found.exact == exact
    assert found.at_ms == (NOW - 10 - waiting.GRACE_MS if exact else NOW - waiting.RETENTION_SLACK_MS)


# -- the recorder in a consumer's core, against a model of the broker -----------------------------
class Quiet:
    def forwarded(self, action) -> None: ...

    def landed(self, forward) -> None: ...

    def batched(self, outcome, messages) -> None: ...

    def late(self, ms) -> None: ...

    def note(self, level, event, **fields) -> None: ...


class Broker:
    """Check-in's queue; what went down the chain and what the waiting streams hold."""

    def __init__(self, count: int) -> None:
        self.queue = [Delivery(NAMES.check_in, f"k{n}".encode(), Properties.build(
            message_id=f"m{n}", headers=Table([long("x-delay", 60_000 * (1 + n % 3))])), b"x") for n in range(count)]
        self.chain: List[int] = []  # keys of the copies in the chain
        self.index: List[int] = []  # keys of the entries in the streams

    def take(self, forward) -> None:
        if forward.outcome is Way.INDEX:
            for m in waiting.entries(forward.body):
                assert m.key in self.chain, "an entry for a message the broker does not have"
                self.index.append(m.key)
            return
        for e in handlers.entries(Delivery(forward.exchange, forward.routing_key, forward.props, forward.body)):
            self.chain.append(waiting.key_of(e.accepted_us, waiting.checksum(e)))


def run_check_in(count: int, seed: int, crashes: int) -> Broker:
    rng = random.Random(seed)
    broker = Broker(count)
    now, steps = NOW, 0
    sequence = cancels.Sequencer()
    while True:
        check_in = handlers.CheckIn(CHAIN, 50, wait_ms=200, sequence=sequence)
        flow = Flow(NAMES.check_in, NAMES, check_in, Quiet(), Batcher(4, 10**6, 200), prefetch=8,
                    recorder=Recorder(bands(CHAIN), CHAIN.meditation_ms))
        flow.publishing_opened(now)
        delivered: Dict[int, Delivery] = {}
        inflight: List = []
        tag = 0
        while True:
            steps += 1
            assert steps < 200_000
            if not broker.queue and not delivered and not inflight:
                return broker
            if crashes and rng.random() < 0.01:  # killed: the broker has a prefix of what was sent
                crashes -= 1
                for pub in inflight[:rng.randint(0, len(inflight))]:
                    broker.take(pub.payload.forward)
                broker.queue[:0] = [delivered[t] for t in sorted(delivered)]
                now += 5
                break
            choice = rng.random()
            if choice < 0.4 and broker.queue and len(delivered) < 8:
                tag += 1
                delivered[tag] = broker.queue.pop(0)
                out = flow.delivered(tag, delivered[tag], now)
            elif choice < 0.7 and inflight:
                n = rng.randint(1, len(inflight))
                for pub in inflight[:n]:
                    broker.take(pub.payload.forward)
                last, inflight = inflight[n - 1], inflight[n:]
                out = flow.confirmed(last.seq, True, True, now)
            else:
                now += rng.choice([1, 50, 250])
                out = flow.tick(now)
            inflight += out.publish
            for t, multiple in out.ack:
                for d in [d for d in delivered if (d <= t if multiple else d == t)]:
                    del delivered[d]


@settings(max_examples=examples(200))
@given(st.integers(1, 30), st.integers(0, 2**32), st.integers(0, 3))
def test_every_copy_in_the_chain_is_in_the_index_and_no_entry_names_one_that_is_not(count, seed, crashes):
    broker = run_check_in(count, seed, crashes)
    # (no phantom: Broker.take asserts each entry's message was taken first)
    copies, indexed = set(broker.chain), set(broker.index)
    # A crash between a carrier and its entries leaves that copy unindexed; its delivery was
    # not acknowledged, so it came again: each message is in the index by a copy of its own.
    assert {k & 0xFFFFFFFF for k in copies} == {k & 0xFFFFFFFF for k in indexed}
    if not crashes:
        assert copies == indexed and len(broker.index) == count


def test_an_entry_the_broker_will_not_take_is_dropped_and_the_message_acknowledged():
    """The waiting streams missing (an older topology with --no-declare): the entry comes
    back unroutable, or the broker closes the channel over it; the message went on all the
    same and is acknowledged, not parked."""
    for refusal in ("returned", "closed"):
        check_in = handlers.CheckIn(CHAIN, 50, wait_ms=0)
        flow = Flow(NAMES.check_in, NAMES, check_in, Quiet(), Batcher(1, 10**6, 0),
                    recorder=Recorder(bands(CHAIN), CHAIN.meditation_ms))
        flow.publishing_opened(NOW)
        out = flow.delivered(1, Delivery(NAMES.check_in, b"k", Properties.build(
            headers=Table([long("x-delay", 60_000)])), b"x"), NOW)
        [carried, record] = out.publish
        assert record.payload.forward.outcome is Way.INDEX and record.side and record.tags == (1,)
        assert carried.seq < record.seq  # the entry right after the message, on the same channel
        if refusal == "returned":
            f = record.payload.forward
            flow.returned(f.routing_key, f.props.raw, f.body)
            out = flow.confirmed(record.seq, True, True, NOW + 1)
        else:
            flow.confirmed(carried.seq, False, True, NOW + 1)
            out = flow.publishing_closed("NOT_FOUND - no queue", NOW + 1)
        assert not out.publish and not out.reject  # nothing parked, nothing given up
        out = flow.tick(NOW + 10)
        assert out.ack == [(1, True)], (refusal, out)


def test_the_distributor_records_what_leaves_within_its_flush():
    distributor = handlers.Distributor(CHAIN, 50)
    flow = Flow(NAMES.distributor, NAMES, distributor, Quiet(),
                recorder=Recorder(bands(CHAIN), CHAIN.meditation_ms))
    flow.publishing_opened(NOW)
    e = entry(due=NOW + 100)
    props = handlers.next_hop(e)
    flow.delivered(1, Delivery(NAMES.distributor, b"", props, e.body), NOW)
    out = flow.tick(NOW + 100)
    [delivered] = out.publish
    assert delivered.payload.forward.outcome is Way.DELIVERED
    assert flow.next_wake() == NOW + 100 + waiting.DONE_FLUSH_MS
    out = flow.tick(NOW + 100 + waiting.DONE_FLUSH_MS)
    [done] = out.publish
    assert done.side and done.tags == () and waiting.done_keys(done.payload.forward.body) == \
        [waiting.key_of(e.accepted_us, waiting.checksum(e))]


def test_the_model_finds_a_recorder_that_loses_entries(monkeypatch):
    """The model test above can fail: a recorder that forgets one band's entries is caught."""
    original = Recorder.take_entries
    monkeypatch.setattr(Recorder, "take_entries", lambda self: original(self)[1:])
    failed = 0
    for seed in range(20):
        broker = run_check_in(12, seed, 0)
        failed += set(broker.chain) != set(broker.index)
    assert failed
