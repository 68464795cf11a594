"""What a reader makes of the index's records (gateway/core/listing.py), pure: an entry waits
while its time has not passed, or after it within the horizon; done keys take a message off;
a lap that ended counts once, as its next entry or as itself; cancels and rules hide what
they cancel; the horizon is a minute only while every consumer beats; and the answer says
why it is not exact. The fast path (whole records at once) counts exactly as the one-by-one
path does."""

import dataclasses
from typing import List, Optional, Sequence, Tuple

import pytest
from hypothesis import given, settings, strategies as st

from gateway.core import cancels, horizon, index_records, listing, rules
from gateway.core.carrier import Entry
from gateway.core.horizon import Gap, Horizon
from gateway.core.index_records import Place
from gateway.core.listing import View
from gateway.core.selection import Selection
from gateway.core.index_records import Beat, Consumers
from gateway.core.wire import Properties, Table, long, longstr

from .support import examples

NOW = 1_800_000_000_000
EXACT = Horizon(NOW - horizon.GRACE_MS, True, "")


def entry(key: bytes = b"k", mid: Optional[bytes] = b"m", due: int = NOW + 60_000, read_us: int = NOW * 1000,
          body: bytes = b"body", exchange: Optional[str] = None, headers: Optional[Table] = None) -> Entry:
    values = {"headers": headers} if headers is not None else {}
    if mid is not None:
        values["message_id"] = mid
    return Entry(key, Properties.build(**values), body, due, read_us, exchange)


def key(e: Entry) -> bytes:
    found = index_records.done_key(e)
    assert found is not None
    return found


def view(written: Sequence[Tuple[Entry, int]], done: Sequence[Entry] = (), select: Optional[Selection] = None,
         cancelled=None, keep: Optional[int] = 0, at: Horizon = EXACT, one_record: bool = False,
         read_at: int = NOW) -> View:
    """A view fed as a reader feeds it: the done stream's records, then the bands' (each
    entry a record of its own, or all of them in one), read at `read_at`."""
    v = View(NOW, at, cancelled, select or Selection(), keep)
    if done:
        v.add_keys(index_records.pack_done([key(e) for e in done]))
    records = [index_records.entry_record(e, until) for e, until in written]
    for group in ([records] if one_record else [[r] for r in records]):
        v.add_entries(index_records.pack_entries(group), read_at)
    v.finish()
    return v


def test_a_lap_that_ended_counts_once_as_its_next_entry_or_as_itself():
    """A lap's entry whose lap had ended when it was read: the message came back from
    meditation. Read in band order (the lap's entry first), its next entry takes its place;
    without one (on its way through the returning queue, or its next entry written after the
    reader passed) it counts as it is."""
    e = entry(due=NOW + 10 * 86_400_000)
    lap_ended, next_lap = (e, NOW - 1000), (e, NOW + 5000)
    v = view([lap_ended, next_lap])
    assert v.total == 1 and [m.until_ms for m in v.listed()] == [NOW + 5000]
    v = view([lap_ended])
    assert v.total == 1 and [m.until_ms for m in v.listed()] == [NOW - 1000]
    # the lap ends while the reader reads (after its `now`): its next entry, written since, is met
    ending, after = (e, NOW + 500), (e, NOW + 4000)
    assert view([ending, after], read_at=NOW + 1000).total == 1
    assert view([ending, after], read_at=NOW).total == 2  # (read before it ended: two laps, two copies)
    assert view([lap_ended, next_lap, next_lap]).total == 2  # a copy: the broker holds it twice


def test_overdue_within_the_horizon_waits_and_leaves_when_done():
    e = entry(due=NOW - 30_000)
    v = view([(e, e.due_ms)])  # due half a minute ago, no gateway delivered it yet
    assert v.total == 1 and v.counts.counts[0] == 1  # overdue
    assert view([(e, e.due_ms)], done=[e]).total == 0
    old = entry(due=NOW - horizon.GRACE_MS - 1)
    assert view([(old, old.due_ms)]).total == 0  # past the horizon: delivered by gateways that keep up
    assert view([(old, old.due_ms)], at=Horizon(NOW - 3_600_000, False, "no gateway")).total == 1


def test_a_delivered_copy_takes_the_message_off_even_where_it_still_waits():
    """A message the broker holds twice (a crash after it was sent on), one copy delivered:
    listed once at most, never more often than it will be delivered."""
    e = entry(due=NOW + 5000)
    assert view([(e, e.due_ms)], done=[e]).total == 0


def test_a_copy_written_twice_is_listed_as_often_as_the_broker_holds_it():
    """A copy read again after a crash has a read time of its own; one sent on again with its
    read time (from a carrier handed back) is in the broker twice, and will be delivered
    twice: listed twice, never more."""
    first, again = entry(read_us=NOW * 1000), entry(read_us=NOW * 1000 + 7)
    assert view([(first, first.due_ms), (again, again.due_ms)]).total == 2
    assert view([(first, first.due_ms), (first, first.due_ms)]).total == 2


def test_two_processes_reading_in_the_same_microsecond_list_two_messages():
    """Read times of two gateways meet (each counts from its millisecond); a message's key,
    property or body tells them apart, even on the same routing key."""
    a, b = entry(b"load.1", b"m-1", read_us=NOW * 1000), entry(b"load.1", b"m-2", read_us=NOW * 1000)
    assert view([(a, a.due_ms), (b, b.due_ms)]).total == 2


def test_cancels_by_id_after_the_message_by_handle_always_and_rules_after_the_message():
    store = cancels.Store(window_ms=10**9)
    held = rules.Rules(window_ms=10**9)
    t = NOW * 1000
    by_id, by_handle, after, spared = (entry(b"k", b"x", read_us=t + 10), entry(b"k", None, read_us=t + 20),
                                       entry(b"k", b"y", read_us=t + 30), entry(b"k", b"z", read_us=t + 40))
    by_rule, after_rule = entry(b"orders.42.a", b"r", read_us=t + 50), entry(b"orders.42.b", b"s", read_us=t + 70)
    store.add(b"x", cancels.Time(t + 11), NOW)
    store.add(b"y", cancels.Time(t + 29), NOW)  # before the message (a reschedule): it stays
    store.add(cancels.handle(t + 20, index_records.checksum(by_handle)).encode(), cancels.Time(t + 1), NOW)
    held.add(rules.Rule(b"r1", Selection(key="orders.42.#"), cancels.Time(t + 60)), NOW)
    v = view([(e, e.due_ms) for e in (by_id, by_handle, after, spared, by_rule, after_rule)],
             cancelled=listing.cancelled_by(store, held, NOW))
    assert [m.message_id for m in v.listed()] == [b"y", b"z", b"s"]
    assert listing.cancelled_by(cancels.Store(1000), rules.Rules(1000), NOW) is None


FILTERED = [entry(b"orders.42.reminder", b"a1", NOW + 3_600_000, 1), entry(b"orders.421.x", b"a2", NOW + 60_000, 2),
            entry(b"orders.42.reminder", b"b1", NOW + 90_000_000, 3,
                  headers=Table([long("customer", 42), longstr("tier", b"gold")])),
            entry(b"orders.42.other", None, NOW + 10_000, 4, headers=Table([longstr("customer", b"42")])),
            entry(b"jobs", b"r1", NOW + 5000, 5, exchange="", headers=Table([long("x-retry-attempt", 3)]))]


@pytest.mark.parametrize("one_record", [False, True])
def test_filters_combine_and_the_soonest_due_are_kept(one_record):
    def chosen(**given) -> List[int]:
        return [m.read_us for m in view([(e, e.due_ms) for e in FILTERED], select=Selection(**given),
                                        one_record=one_record).listed()]
    assert chosen(key="orders.42.#") == [4, 1, 3]
    assert chosen(key="orders.42.#", due_after_ms=NOW + 60_000, due_before_ms=NOW + 86_400_000) == [1]
    assert chosen(headers=(("customer", "42"),)) == [4, 3]
    assert chosen(headers=(("customer", "42"), ("tier", "gold"))) == [3]
    assert chosen(ids=(b"a*",)) == [2, 1] and chosen(ids=(b"a1", b"r1")) == [5, 1]
    assert chosen(ids=(cancels.handle(4, index_records.checksum(FILTERED[3])).encode(),)) == [4]
    assert chosen(retries=True) == [5]
    v = view([(e, e.due_ms) for e in FILTERED], keep=2, one_record=one_record)
    assert [m.read_us for m in v.listed()] == [5, 4] and v.total == 5 and v.latest_due_ms == NOW + 90_000_000
    v = view([(e, e.due_ms) for e in FILTERED], keep=None, one_record=one_record)
    assert v.listed() == [] and v.total == 5


@settings(max_examples=examples(300))
@given(st.lists(st.tuples(st.integers(0, 40), st.integers(-120_000, 400 * 86_400_000), st.integers(-150_000, 10**9),
                          st.booleans(), st.sampled_from([b"a.1", b"a.2", b"b.1"])), max_size=60),
       st.sampled_from([None, 0, 3]), st.booleans(), st.booleans(), st.integers(0, 5000))
def test_the_fast_path_counts_and_keeps_what_one_by_one_does(items, keep, filtered, one_record, late):
    """Whole records judged at once (no filter, no cancel) against the same with a filter
    that selects everything (judged one by one): the same totals, counts and listing; and
    both as a plain model of the rules says."""
    written, done = [], []
    for reader, due_in, until_in, is_done, rk in items:
        # (a message is its read time, key, id and body: the same reader and key, the same
        # message, written again at another time: laps, copies)
        e = entry(rk, f"m{reader}".encode(), NOW + due_in, (NOW + reader) * 1000)
        written.append((e, NOW + until_in))
        if is_done:
            done.append(e)
    read_at = NOW + late
    fast = view(written, done, keep=keep, one_record=one_record, read_at=read_at)
    nothing = listing.Cancels(cancels.Store(10**9), rules.Rules(10**9), NOW)  # (judged, and cancels none)
    slow = view(written, done, Selection(key="#") if filtered else Selection(), cancelled=nothing,
                keep=keep, one_record=one_record, read_at=read_at)
    model, transit = [], {}
    gone = {key(e) for e in done}
    for group in ([written] if one_record else [[w] for w in written]):
        alive = [(e, until) for e, until in group if key(e) not in gone]
        ended = [(e, until) for e, until in alive if e.due_ms > until and EXACT.at_ms <= until < read_at]
        for e, until in ended:  # (within a record, laps that ended are met first)
            transit[key(e)] = (e, until)
        for e, until in alive:
            if (e, until) in ended:
                continue
            if until >= NOW:
                model.append((e, until))
                transit.pop(key(e), None)
            elif until >= EXACT.at_ms and e.due_ms <= NOW:
                model.append((e, until))
    model += transit.values()
    assert fast.total == slow.total == len(model)
    assert fast.counts.counts == slow.counts.counts
    assert sorted(m.read_us for m in fast.listed()) == sorted(m.read_us for m in slow.listed())
    if keep:
        assert [m.due_ms for m in fast.listed()] == sorted(e.due_ms for e, _ in model)[:keep]


def first_layout(written: Sequence[Tuple[Entry, int]]) -> bytes:
    """Entries as 345936a..bc3eba0 wrote them: today's fixed part without the checksum."""
    fixed = [index_records.FIRST_FIXED.pack(e.accepted_us, e.due_ms, until, len(e.body), 0, index_records.HAS_ID,
                                            len(e.user.get("message_id")), len(e.routing_key), len(e.user.raw))
             for e, until in written]
    rest = [e.user.get("message_id") + e.routing_key + e.user.raw for e, _ in written]
    return index_records.ENTRIES + len(written).to_bytes(4, "big") + b"".join(fixed) + b"".join(rest)


@pytest.mark.parametrize("cancelled", [False, True])
def test_entries_of_the_first_layout_are_listed_and_taken_off_by_their_keys(cancelled):
    """Records of the index's first layout beside today's: listed, counted and kept alike (the
    fast path and one by one), each taken off by a done key of its version (the routing key's
    checksum) and, with a cancel held, only what a cancel names."""
    old = [entry(b"a.%d" % n, b"old-%d" % n, NOW + 1000 * n, (NOW - 5) * 1000 + n) for n in range(4)]
    new = [entry(b"b.%d" % n, b"new-%d" % n, NOW + 500 + 1000 * n, NOW * 1000 + n) for n in range(3)]
    store = cancels.Store(86_400_000)
    store.add(b"new-1", cancels.Time(NOW * 1000 + 10), NOW)
    named = cancels.handle(old[2].accepted_us, index_records.first_checksum(b"a.2")).encode()  # a handle of its time
    store.add(named, cancels.Time(NOW * 1000), NOW)
    judge = listing.cancelled_by(store, rules.Rules(86_400_000), NOW) if cancelled else None
    for one_record in (False, True):
        v = View(NOW, EXACT, judge, Selection(), 0)
        first = index_records.KEY.pack(old[0].accepted_us, index_records.first_checksum(b"a.0"))
        v.add_keys(index_records.pack_done([first, key(new[0])]))
        records = [first_layout([(e, e.due_ms)]) for e in old] if not one_record else [
            first_layout([(e, e.due_ms) for e in old])]
        for body in records + [index_records.pack_entries([index_records.entry_record(e, e.due_ms) for e in new])]:
            assert index_records.first_layout(body) == (body in records)
            v.add_entries(body)
        v.finish()
        left = {b"old-1", b"old-2", b"old-3", b"new-1", b"new-2"} - ({b"old-2", b"new-1"} if cancelled else set())
        assert {m.message_id for m in v.listed()} == left and v.total == len(left) and v.read == 7
        assert [m.handle for m in v.listed() if m.message_id == b"old-1"] == [
            cancels.handle(old[1].accepted_us, index_records.first_checksum(b"a.1"))]


# -- the horizon and the gaps ------------------------------------------------------------------
def beat(n: int, roles: int, at: int, consumers: Optional[Consumers] = None, indexes: bool = True) -> Beat:
    return Beat(bytes([n]) * 16, roles, NOW - 10, at, consumers or Consumers(1, 1, 1),
                index_records.INDEXES if indexes else 0)


@pytest.mark.parametrize("distributor,returning,beats,exact", [
    ((0, 1), (0, 1), [beat(0, 3, NOW - 1000)], True),
    ((0, 2), (0, 1), [beat(0, 3, NOW - 1000)], False),  # a consumer that said nothing
    ((0, 2), (0, 2), [beat(0, 3, NOW - 1000, Consumers(2, 2, 2))], True),  # a classic chain: two exits each
    ((5, 1), (0, 1), [beat(0, 3, NOW - 1000)], False),  # unread in the distributor queue
    ((0, 0), (0, 0), [], False),  # no gateway
    ((0, 1), (0, 1), [beat(0, 3, NOW - 60_000)], False),  # its last beat is old
    ((0, 1), (0, 1), [beat(0, 2, NOW - 1000, Consumers(0, 0, 1)), beat(1, 1, NOW - 900, Consumers(2, 1, 0))],
     True),  # roles split
])
def test_the_horizon_is_a_minute_only_while_every_consumer_keeps_up(distributor, returning, beats, exact):
    found = horizon.horizon(NOW, beats, {"distributor": Place(*distributor), "returning": Place(*returning)})
    assert found.exact == exact
    assert found.at_ms == (NOW - 10 - horizon.GRACE_MS if exact else NOW - horizon.RETENTION_SLACK_MS)


def test_what_the_queues_hold_is_what_the_newest_live_beat_saw():
    """A reader with read permission only takes the queues' counts from the gateways' beats
    (DGB3): the newest live one that says; none that says (no gateway, or only earlier
    versions'): not known, and why."""
    def seen(ready: int) -> index_records.Seen:
        return index_records.Seen(Place(ready, 1), Place(0, 1), Place(0, 1))
    older = dataclasses.replace(beat(0, 3, NOW - 3000), seen=seen(5))
    newer = dataclasses.replace(beat(1, 3, NOW - 1000), seen=seen(7))
    places, why = horizon.seen(NOW, [newer, older, beat(2, 3, NOW - 500)])
    assert places is not None and places["check_in"] == Place(7, 1) and why == ""
    assert horizon.seen(NOW, [dataclasses.replace(newer, at_ms=NOW - 60_000)]) == (None, horizon.seen(NOW, [])[1])
    assert "no gateway beat within 20 s" in horizon.seen(NOW, [])[1]
    assert "a version before 1.0" in horizon.seen(NOW, [beat(0, 3, NOW - 1000)])[1]


def test_a_gateway_of_0_1_0_reading_check_in_is_told_until_its_consumers_are_gone():
    """`pending cancel` refuses while one may read check-in (it would deliver a rule): its DGB1
    beat is live, and the broker counts more consumers of check-in than the later gateways."""
    old = dataclasses.replace(beat(0, 3, NOW - 1000, Consumers(1, 1, 1)), first_layout=True)
    new = beat(1, 3, NOW - 1000, Consumers(1, 1, 1))
    assert horizon.earlier_check_in(NOW, [old, new], {"check_in": Place(0, 2)}) == 1
    assert horizon.earlier_check_in(NOW, [old, new], None) == 1  # (not known: still said)
    assert horizon.earlier_check_in(NOW, [old, new], {"check_in": Place(0, 1)}) == 0  # it stopped
    assert horizon.earlier_check_in(NOW, [new], {"check_in": Place(0, 1)}) == 0


def test_what_can_wait_unlisted_is_said_until_it_cannot():
    live = [beat(0, 3, NOW - 1000, Consumers(2, 1, 1))]
    assert horizon.gaps(NOW, live, Place(0, 2), []) == []
    unread = horizon.gaps(NOW, live, Place(7, 2), [])
    assert [g.why.split(":")[0] for g in unread] == ["7 message(s) wait in check-in, not read by a gateway yet"]
    quiet = horizon.gaps(NOW, live, Place(0, 3), [])  # a check-in consumer that does not beat: an older gateway
    assert len(quiet) == 1 and quiet[0].why.startswith("1 consumer(s) of check-in said nothing")
    blind = horizon.gaps(NOW, [beat(0, 3, NOW - 1000, Consumers(2, 1, 1), indexes=False)], Place(0, 2), [])
    assert len(blind) == 1 and "--no-pending-index" in blind[0].why
    before = Gap("messages scheduled before the index", NOW + 1)
    assert horizon.gaps(NOW, live, Place(0, 2), [before, Gap("over", NOW - 1)]) == [before]
    # a gateway that held messages read and not sent on yet, or one the broker blocks: said
    flagged = dataclasses.replace(live[0], flags=index_records.INDEXES | index_records.READING | index_records.BLOCKED)
    said = [g.why for g in horizon.gaps(NOW, [flagged], Place(0, 2), [])]
    assert len(said) == 2 and "held messages they had read and not sent on yet" in said[0]
    assert "blocks 1 gateway(s) (a resource alarm)" in said[1]
    body = index_records.pack_beat(b"g" * 16, 3, NOW, NOW, Consumers(1, 1, 1), flagged.flags)
    read_back = index_records.beat(body)
    assert read_back is not None and read_back.reading and read_back.blocked and read_back.indexes
