"""The index of what waits, on the pure core (gateway/core/index_records.py, the Flow's recorder):
its records read back exactly; against a model of the broker with crashes at any moment,
that the index names every message that waits and none that does not; and that the keys
saying a message left (or finished a lap) are confirmed before its delivery is acknowledged.
What a reader makes of the records: tests/test_listing.py."""

import random
import zlib
from typing import Dict, List, Optional

from hypothesis import given, settings, strategies as st

from topology import ChainSettings
from topology.index_bands import DONE, band, bands, span_ms

from gateway.core import cancels, carrier, handlers, index_records
from gateway.core.inputs import Delivery
from gateway.core.routes import Way
from gateway.core.carrier import Batcher, Entry
from gateway.core.flow import Flow
from gateway.core.index_records import Consumers, Listed, Recorder
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
    [m] = index_records.entries(index_records.pack_entries([index_records.entry_record(e, until)]))
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
    records = [index_records.entry_record(e, until) for e, until in sent]
    got = list(index_records.entries(index_records.pack_entries(records)))
    assert len(got) == len(sent)
    for (e, until), m in zip(sent, got, strict=True):
        assert (m.routing_key, m.message_id, m.read_us, m.due_ms, m.until_ms, m.size) == \
            (e.routing_key, e.user.get("message_id"), e.accepted_us, e.due_ms, until, len(e.body))
        assert m.props == e.user.raw and m.retry == (e.exchange == "")
        attempt = e.user.headers.get("x-retry-attempt")
        assert m.retry_attempt == (attempt if m.retry and 0 < attempt < 65536 else None)
        assert m.key == index_records.key_of(e.accepted_us, cancels.checksum(e.routing_key, e.user.raw, e.body))


def adds_up(record: bytes, fixed) -> bool:
    """Whether the lengths its entries' fixed parts give fill the record exactly."""
    count = int.from_bytes(record[4:8], "big")
    if 8 + count * fixed.size > len(record):
        return False
    parts = [fixed.unpack_from(record, 8 + i * fixed.size) for i in range(count)]
    return 8 + count * fixed.size + sum(sum(p[-3:]) for p in parts) == len(record)


def first_layout_record(sent) -> bytes:
    """Entries as 345936a..bc3eba0 wrote them: today's fixed part without the checksum."""
    fixed, rest = [], []
    for e, until in sent:
        mid = e.user.get("message_id") or b""
        retry = e.exchange == ""
        attempt = e.user.headers.get("x-retry-attempt") if retry else 0
        flags = (index_records.RETRY if retry else 0) | (index_records.HAS_ID if mid else 0)
        fixed.append(index_records.FIRST_FIXED.pack(e.accepted_us, e.due_ms, until, len(e.body),
                                                    attempt if 0 < attempt < 65536 else 0, flags,
                                                    len(mid), len(e.routing_key), len(e.user.raw)))
        rest.append(mid + e.routing_key + e.user.raw)
    return index_records.ENTRIES + len(sent).to_bytes(4, "big") + b"".join(fixed) + b"".join(rest)


@settings(max_examples=examples(300))
@given(st.lists(st.tuples(keys, st.one_of(st.none(), ids.filter(bool)), st.integers(0, 2**62),
                          st.integers(-2**62, 2**62), st.binary(max_size=300), st.booleans()), min_size=1, max_size=20))
def test_entries_of_the_first_layout_read_back_with_its_checksum(items):
    """A record of the index's first layout reads as its version wrote it, its checksum the
    routing key's CRC-32 (what its done keys and handles name); today's layout of the same
    entries reads as today's (test_entries_read_back_exactly), never as the first."""
    sent = [(entry(key, mid, due, read_us, body, "" if retry else None,
                   Table([long("x-retry-attempt", 2)]) if retry else None), due + 5)
            for key, mid, read_us, due, body, retry in items]
    today = index_records.pack_entries([index_records.entry_record(e, until) for e, until in sent])
    assert not index_records.first_layout(today)
    old = first_layout_record(sent)
    if not index_records.first_layout(old):  # (it adds up under today's layout too: read as today's, by the rule)
        assert adds_up(old, index_records.FIXED)
        return
    got = list(index_records.entries(old))
    assert [(m.read_us, m.crc, m.due_ms, m.until_ms, m.size, m.retry, m.message_id, m.routing_key, m.props)
            for m in got] == [(e.accepted_us, zlib.crc32(e.routing_key), e.due_ms, until, len(e.body),
                               e.exchange == "", e.user.get("message_id"), e.routing_key, e.user.raw)
                              for e, until in sent]
    assert [m.key for m in got] == [index_records.key_of(e.accepted_us, index_records.first_checksum(e.routing_key))
                                    for e, _ in sent]


def test_a_record_that_adds_up_under_both_layouts_reads_as_todays():
    """One entry with no id whose body size's low byte is 4 + its properties' length fills the
    record under either fixed part: it is today's."""
    props = Properties.build(content_type=b"x")
    e = Entry(b"key", props, b"b" * (4 + len(props.raw)), NOW + 5, NOW * 1000)
    record = index_records.pack_entries([index_records.entry_record(e, NOW + 5)])
    assert adds_up(record, index_records.FIRST_FIXED) and adds_up(record, index_records.FIXED)
    assert not index_records.first_layout(record)
    assert [(m.read_us, m.routing_key, m.crc) for m in index_records.entries(record)] == [
        (NOW * 1000, b"key", index_records.checksum(e))]


def test_done_keys_and_beats_read_back_and_nothing_else_reads_as_them():
    a, b = entry(b"a", read_us=1), entry(b"b", read_us=2)
    keys = [index_records.key_of(1, index_records.checksum(a)), index_records.key_of(2, index_records.checksum(b))]
    done = index_records.pack_done([index_records.done_key(a), index_records.done_key(b)])
    assert index_records.done_keys(done) == keys
    assert index_records.done_key(entry(read_us=None)) is None  # (from before read times were kept: never indexed)
    beat = index_records.beat(index_records.pack_beat(b"g" * 16, 3, NOW - 5, NOW, Consumers(2, 1, 2), 0))
    assert beat == index_records.Beat(b"g" * 16, 3, NOW - 5, NOW, Consumers(2, 1, 2), 0) and not beat.indexes
    for other in (b"", b"DGM1" + b"x" * 16, index_records.pack_done([]), b"DGW1\xff\xff\xff\xff"):
        assert list(index_records.entries(other)) == [] and index_records.beat(other) is None
    assert index_records.done_keys(index_records.pack_entries([])) == []


def test_a_beat_carries_what_its_gateway_saw_of_the_queues():
    """DGB3: ready messages and consumers of check-in, returning and distributor, as the
    gateway saw them (a reader with read permission only cannot look); SEEN says they were
    seen, and a beat that could not look says nothing of them."""
    seen = index_records.Seen(index_records.Place(7, 2), index_records.Place(0, 1), index_records.Place(2 ** 40, 3))
    body = index_records.pack_beat(b"g" * 16, 3, NOW - 5, NOW, Consumers(2, 1, 3), index_records.INDEXES, seen)
    found = index_records.beat(body)
    assert body.startswith(b"DGB3") and found is not None and found.indexes
    assert found.seen == index_records.Seen(index_records.Place(7, 2), index_records.Place(0, 1),
                                            index_records.Place(2 ** 32 - 1, 3))  # (a count beyond 32 bits: the most)
    blind = index_records.beat(index_records.pack_beat(b"g" * 16, 1, NOW, NOW, Consumers(1), index_records.SEEN))
    assert blind is not None and blind.seen is None and blind.flags == 0


def test_a_beat_of_an_earlier_version_stands_for_one_consumer_of_each_kind_its_roles_run():
    """Before 1.0 a beat (DGB1) did not count consumers; a gateway then always wrote entries
    (and took a rule for a message: `first_layout`)."""
    old = b"DGB1" + b"g" * 16 + bytes([3]) + (NOW - 5).to_bytes(8, "big") + NOW.to_bytes(8, "big")
    assert index_records.beat(old) == index_records.Beat(b"g" * 16, 3, NOW - 5, NOW, Consumers(1, 1, 1),
                                                         first_layout=True)
    distributor_only = old[:20] + bytes([index_records.ROLE_DISTRIBUTOR]) + old[21:]
    assert index_records.beat(distributor_only).consumers == Consumers(0, 0, 1) and index_records.beat(old).indexes


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
    from topology.index_bands import BANDS
    return BANDS - 1


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
        if forward.way is Way.INDEX:
            for m in index_records.entries(forward.body):
                assert m.key in self.chain, "an entry for a message the broker does not have"
                self.index.append(m.key)
            return
        for e in handlers.entries(Delivery(forward.exchange, forward.routing_key, forward.props, forward.body)):
            self.chain.append(index_records.key_of(e.accepted_us, index_records.checksum(e)))


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
        assert record.payload.forward.way is Way.INDEX and record.side and record.tags == (1,)
        assert carried.seq < record.seq  # the entry right after the message, on the same channel
        if refusal == "returned":
            f = record.payload.forward
            flow.returned(f.routing_key, f.props.raw, f.body)
            out = flow.confirmed(record.seq, True, True, NOW + 1)
        else:
            flow.confirmed(carried.seq, False, True, NOW + 1)
            out = flow.publishing_closed("NOT_FOUND - no queue", NOW + 1)
        assert not out.publish and not out.reject  # nothing parked, nothing given up
        assert out.ack + flow.tick(NOW + 10).ack == [(1, True)], (refusal, out)


def distributor_flow(judge=None) -> Flow:
    distributor = handlers.Distributor(CHAIN, 50, cancelled=judge)
    flow = Flow(NAMES.distributor, NAMES, distributor, Quiet(), still_wanted=distributor.still_wanted,
                recorder=Recorder(bands(CHAIN), CHAIN.meditation_ms))
    flow.publishing_opened(NOW)
    return flow


def test_a_delivery_is_acknowledged_only_once_the_key_saying_its_message_left_is_confirmed():
    """The distributor delivers a message; its done key speaks for the delivery: no
    acknowledgement before the broker confirmed it, so a process killed in between hands the
    delivery back (delivered again, with its key then) instead of leaving a delivered message
    listed. Alone (nothing else due soon), its key goes out with it: no wait for company."""
    flow = distributor_flow()
    e = entry(due=NOW + 100)
    flow.delivered(1, Delivery(NAMES.distributor, b"", handlers.next_hop(e), e.body), NOW)
    [delivered, done] = flow.tick(NOW + 100).publish
    assert delivered.payload.forward.way is Way.DELIVERED
    assert done.side and done.tags == (1,) and index_records.done_keys(done.payload.forward.body) == \
        [index_records.key_of(e.accepted_us, index_records.checksum(e))]
    out = flow.confirmed(delivered.seq, False, True, NOW + 101)
    assert out.ack == [] and not flow.tick(NOW + 110).ack  # confirmed at pick-up, its key not yet
    assert flow.confirmed(done.seq, False, True, NOW + 111).ack == [(1, True)]  # nothing else awaited


def test_done_keys_wait_for_company_that_is_due():
    """Another held message due within DONE_FLUSH_MS: the first key waits for it, and both
    go out in one record, with the second release."""
    flow = distributor_flow()
    batch = [entry(key=f"k{n}".encode(), due=NOW + 100 + n * 100, read_us=NOW * 1000 + n) for n in range(2)]
    flow.delivered(1, Delivery(NAMES.distributor, b"", carrier.properties(batch), carrier.pack(batch)), NOW)
    [first] = flow.tick(NOW + 100).publish
    assert first.payload.forward.way is Way.DELIVERED
    flow.confirmed(first.seq, False, True, NOW + 101)
    [second, done] = flow.tick(NOW + 200).publish
    assert second.payload.forward.way is Way.DELIVERED and done.tags == (1,)
    assert sorted(index_records.done_keys(done.payload.forward.body)) == sorted(
        index_records.key_of(e.accepted_us, index_records.checksum(e)) for e in batch)


def test_a_carrier_is_acknowledged_once_every_message_in_it_left_and_its_keys_are_confirmed():
    flow = distributor_flow()
    batch = [entry(key=f"k{n}".encode(), due=NOW + 100 + n * 300, read_us=NOW * 1000 + n) for n in range(3)]
    flow.delivered(1, Delivery(NAMES.distributor, b"", carrier.properties(batch), carrier.pack(batch)), NOW)
    now, keys, acks = NOW, [], []
    while not acks:
        at = flow.next_wake()
        if at is None:
            break
        now = max(now, at)
        out = flow.tick(now)
        acks += out.ack
        for pub in out.publish:
            if pub.payload.forward.way is Way.INDEX:
                keys += index_records.done_keys(pub.payload.forward.body)
            acks += flow.confirmed(pub.seq, False, True, now).ack
        assert not acks or not flow.ledger, acks  # acknowledged only once all of it left
    assert acks == [(1, True)]
    assert sorted(keys) == sorted(index_records.key_of(e.accepted_us, index_records.checksum(e)) for e in batch)


def test_a_cancelled_message_dropped_at_release_is_noted_gone():
    cancelled = {b"m"}
    flow = distributor_flow(judge=lambda e, where: e.user.get("message_id") in cancelled and where == "release")
    e = entry(due=NOW + 100)
    flow.delivered(1, Delivery(NAMES.distributor, b"", handlers.next_hop(e), e.body), NOW)
    out = flow.tick(NOW + 100)
    [done] = out.publish  # released, and dropped: not delivered, only the key saying it is gone
    gone = index_records.key_of(e.accepted_us, index_records.checksum(e))
    assert index_records.done_keys(done.payload.forward.body) == [gone]
    assert not out.ack
    assert flow.confirmed(done.seq, False, True, NOW + 400).ack == [(1, True)]


def test_keys_outlive_a_lost_channel_but_speak_for_no_new_delivery():
    """The consuming channel is lost after a delivery: its key is still written (the message
    was delivered), and a new delivery that reuses the tag is not settled by it."""
    flow = distributor_flow()
    e, company = entry(due=NOW + 100), entry(key=b"k2", due=NOW + 300, read_us=NOW * 1000 + 2)
    flow.delivered(1, Delivery(NAMES.distributor, b"", handlers.next_hop(e), e.body), NOW)
    flow.delivered(2, Delivery(NAMES.distributor, b"", handlers.next_hop(company), company.body), NOW)
    [delivered] = flow.tick(NOW + 100).publish  # its key waits for the company due at +300
    flow.confirmed(delivered.seq, False, True, NOW + 101)
    flow.consuming_lost()
    flow.publishing_opened(NOW + 150)  # (a consumer that carried on: none does, the connection closes)
    later = entry(due=NOW + 10_000, read_us=NOW * 1000 + 1)
    out = flow.delivered(1, Delivery(NAMES.distributor, b"", handlers.next_hop(later), later.body), NOW + 200)
    out.publish += flow.tick(NOW + 100 + index_records.DONE_FLUSH_MS).publish
    [done] = [p for p in out.publish if p.payload.forward.way is Way.INDEX and p.payload.forward.routing_key
              == DONE.encode()]
    assert done.tags == () and index_records.done_keys(done.payload.forward.body) == \
        [index_records.key_of(e.accepted_us, index_records.checksum(e))]


def test_the_model_finds_a_recorder_that_loses_entries(monkeypatch):
    """The model test above can fail: a recorder that forgets one band's entries is caught."""
    original = Recorder.take_entries
    monkeypatch.setattr(Recorder, "take_entries", lambda self: original(self)[1:])
    failed = 0
    for seed in range(20):
        broker = run_check_in(12, seed, 0)
        failed += set(broker.chain) != set(broker.index)
    assert failed
