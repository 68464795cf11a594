"""Carriers: packing many messages exactly, and closing batches by count, bytes and age (pure)."""

import pytest
from hypothesis import given, strategies as st

from gateway.core.carrier import Batcher, Damaged, Entry, pack, unpack
from gateway.core.wire import Properties, Table

entries = st.builds(Entry, st.binary(max_size=255), st.binary(max_size=300).map(Properties.parse),
                    st.binary(max_size=2000), st.integers(-2**63, 2**63 - 1), accepted_us=st.none(), exchange=st.none())


@given(st.lists(entries, min_size=1, max_size=20))
def test_a_carrier_gives_back_every_message_byte_for_byte(batch):
    assert unpack(pack(batch)) == batch


@pytest.mark.parametrize("body", [b"", b"plain body", pack([Entry(b"k", Properties.parse(b"\x00\x00"), b"b", 1)])[:-1]])
def test_anything_else_is_not_a_carrier(body):
    with pytest.raises(Damaged):
        unpack(body)


def entry(size: int = 10, due: int = 0) -> Entry:
    return Entry(b"k", Properties.build(headers=Table()), b"x" * size, due)


def test_batches_close_by_count_bytes_and_age():
    b = Batcher(max_messages=3, max_bytes=10_000, wait_ms=20)
    assert b.add("a", 1, entry(), 0) == [] and b.add("b", 2, entry(), 5) == []
    assert b.add("a", 3, entry(), 6) == []
    [full] = b.add("a", 4, entry(), 7)  # the third of route a
    assert [t for t, _ in full.items] == [1, 3, 4] and len(b) == 1
    assert b.next_deadline() == 25 and b.expired(24) == []
    [old] = b.expired(25)
    assert old.key == "b" and len(b) == 0 and b.next_deadline() is None
    b.add("c", 5, entry(6000), 30)
    [first] = b.add("c", 6, entry(6000), 31)  # would pass 10,000 bytes: the first goes alone
    assert [t for t, _ in first.items] == [5] and len(b) == 1
    [alone] = b.add("c", 7, entry(20_000), 32)  # too big for any carrier
    assert [t for t, _ in alone.items] == [7] and len(b) == 1
    assert [t for batch in b.drain() for t, _ in batch.items] == [6]


def test_a_message_that_may_not_wait_the_whole_wait_closes_its_batch_sooner():
    b = Batcher(max_messages=1000, max_bytes=10_000, wait_ms=200)
    b.add("a", 1, entry(), 0)
    assert b.next_deadline() == 200
    b.add("a", 2, entry(), 10, send_by_ms=60)  # due soon: its batch goes by then
    assert b.next_deadline() == 60 and b.expired(59) == []
    b.add("b", 3, entry(), 20)
    [a] = b.expired(60)
    assert [t for t, _ in a.items] == [1, 2] and b.next_deadline() == 220
    b.add("c", 4, entry(), 30, send_by_ms=0)  # due already: at the next tick, with whoever joins it by then
    b.add("c", 5, entry(), 30)
    assert b.next_deadline() == 30
    [c] = b.expired(30)
    assert [t for t, _ in c.items] == [4, 5]


def test_without_waiting_every_message_goes_alone():
    b = Batcher(max_messages=1000, max_bytes=10_000, wait_ms=0)
    assert [len(x.items) for x in b.add("a", 1, entry(), 0)] == [1] and len(b) == 0


def test_holds_release_in_due_order_and_first_come_first_for_the_same_time():
    from gateway.core.carrier import Holds
    h = Holds()
    for due, key in [(30, "c"), (10, "a"), (20, "b"), (10, "a2")]:
        h.add(due, key, key.upper())
    assert h.next_due() == 10 and h.due(9) == []
    assert h.due(20) == [("a", "A"), ("a2", "A2"), ("b", "B")]
    assert len(h) == 1 and h.drain() == [("c", "C")] and h.next_due() is None


def test_a_delivery_given_up_leaves_its_batches_and_holds():
    from gateway.core.carrier import Holds
    b = Batcher(max_messages=3, max_bytes=10_000, wait_ms=20)
    b.add("a", 1, entry(), 0)
    b.add("a", 2, entry(), 1)
    b.add("b", 2, entry(), 2)
    b.discard(2)
    assert [(batch.key, [t for t, _ in batch.items]) for batch in b.drain()] == [("a", [1])]
    h: Holds = Holds()
    h.add(5, 1, "x")
    h.add(3, 2, "y")
    h.add(4, 1, "z")
    h.discard(1)
    assert len(h) == 1 and h.due(10) == [(2, "y")]
