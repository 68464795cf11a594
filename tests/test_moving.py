"""Moving what waits to another cluster, the pure part (gateway/core/moving.py): what each
message taken from the old cluster's queues becomes for the new one. Against real brokers,
through a SIGKILL: tests/test_move_e2e.py."""

from hypothesis import given, strategies as st
from pika import BasicProperties

from topology import ChainSettings

from gateway.broker.plumbing import lazy_properties
from gateway.core import carrier, envelope, handlers, index_records, retries
from gateway.core.carrier import Entry
from gateway.core.inputs import Delivery
from gateway.core.moving import ORDER, SOURCES, Mover, Source, done_of, index_of
from gateway.core.wire import Properties

from .test_retry_core import rejected

OLD = ChainSettings(prefix="old", max_level=8, resolution_ms=100)
NEW = ChainSettings(prefix="new", max_level=8, resolution_ms=100)
NOW = 1_800_000_000_000
LEAD = 50


def user(message_id: str, **headers) -> Properties:
    return lazy_properties.to_wire(BasicProperties(message_id=message_id, delivery_mode=2, headers=headers or None))


def entry(n: int, due_in_ms: int, exchange=None) -> Entry:
    return Entry(f"key.{n}".encode(), user(f"m{n}", n=n), f"body {n}".encode(), NOW + due_in_ms, 1_000_000 + n,
                 exchange)


def carried(entries, queue: str = "old.100ms-quorum-queue-queue.level.03.delay") -> Delivery:
    return Delivery(queue, b"1", carrier.properties(entries), carrier.pack(entries))


def unpacked(publishes):
    """Every entry the publishes carry (carriers and single messages), with where each went."""
    out = []
    for exchange, key, props, body in publishes:
        for e in handlers.entries(Delivery(exchange, key, props, body)):
            out.append((exchange, key, e))
    return out


def test_held_messages_keep_everything_and_enter_the_new_chain_where_check_in_would_send_them():
    entries = [entry(n, due) for n, due in enumerate([30, 900, 5_000, 20_000, 60_000, 3_600_000])]
    mover = Mover(OLD.names, NEW, LEAD, 1000, 1 << 20)
    moved = mover.take([(Source.HELD, carried(entries[3:])), (Source.HELD, carried(entries[:3]))], NOW)
    assert moved.entries == entries  # exactly, and by due time
    assert moved.messages == len(entries) and moved.as_sent == 0 and not moved.cancelled
    got = unpacked(moved.publishes)
    assert sorted((e for _, _, e in got), key=lambda e: e.due_ms) == entries
    for exchange, key, e in got:
        assert (exchange, key) == handlers.route(NEW, e.due_ms - NOW, LEAD)[:2], e
        assert exchange.startswith("new.")
    # the soonest to the new distributor, the longest wait round the new meditation
    assert got[0][0] == NEW.names.distributor or min(got, key=lambda g: g[2].due_ms)[0] == NEW.names.distributor
    assert max(got, key=lambda g: g[2].due_ms)[0] == NEW.meditation


@given(st.lists(st.integers(0, 10_000), min_size=1, max_size=60), st.integers(1, 7), st.integers(200, 4000))
def test_carriers_hold_at_most_their_limits_and_lose_nothing(dues, most, max_bytes):
    entries = [entry(n, due) for n, due in enumerate(dues)]
    moved = Mover(OLD.names, NEW, LEAD, most, max_bytes).take([(Source.HELD, carried(entries))], NOW)
    for _, _, props, body in moved.publishes:
        count = props.headers.get(carrier.COUNT)
        if count is not None:  # (one too big for a carrier travels alone)
            assert count <= most and len(body) <= max_bytes + len(carrier.MAGIC)
    assert sorted((e for _, _, e in unpacked(moved.publishes)), key=lambda e: (e.due_ms, e.accepted_us)) == \
        sorted(entries, key=lambda e: (e.due_ms, e.accepted_us))


def test_a_cancelled_message_is_not_moved_and_its_done_key_is_written():
    entries = [entry(n, 5_000) for n in range(4)]
    mover = Mover(OLD.names, NEW, LEAD, 1000, 1 << 20, cancelled=lambda e: e.user.get("message_id") == b"m2")
    moved = mover.take([(Source.HELD, carried(entries))], NOW)
    assert [e.user.get("message_id") for e in moved.cancelled] == [b"m2"]
    assert b"m2" not in {e.user.get("message_id") for _, _, e in unpacked(moved.publishes)}
    gone = done_of(moved.entries + moved.cancelled)
    assert gone is not None
    assert sorted(index_records.done_keys(gone)) == sorted(
        index_records.key_of(e.accepted_us, index_records.checksum(e)) for e in entries)


def test_moved_entries_are_listed_in_the_new_index_until_due():
    entries = [entry(n, due) for n, due in enumerate([1_000, 100_000, 90_000_000])]
    records = index_of(entries, 6, NOW)
    listed = {m.read_us: m for body in records.values() for m in index_records.entries(body)}
    assert sorted(listed) == [e.accepted_us for e in entries]
    for e in entries:
        m = listed[e.accepted_us]
        assert (m.due_ms, m.until_ms, m.routing_key, m.props, m.size) == (e.due_ms, e.due_ms, e.routing_key,
                                                                          e.user.raw, len(e.body))
    assert set(records) <= {f"{b:02d}" for b in range(6)}


def test_what_waits_at_check_in_goes_to_the_new_exchange_it_was_sent_to_as_sent():
    mover = Mover(OLD.names, NEW, LEAD, 1000, 1 << 20)
    sent = lazy_properties.to_wire(BasicProperties(message_id="a", user_id="publisher", headers={"x-delay": 5000}))
    cancel = lazy_properties.to_wire(BasicProperties(message_id="a"))
    rule = lazy_properties.to_wire(BasicProperties(headers={"x-cancel-routing-key": "k.#"}))
    moved = mover.take([(Source.CHECK_IN, Delivery(OLD.names.check_in, b"k.1", sent, b"x")),
                        (Source.CHECK_IN, Delivery(OLD.names.cancel, b"", cancel, b"")),
                        (Source.CHECK_IN, Delivery(OLD.names.rules, b"", rule, b""))], NOW)
    assert [(x, k, b) for x, k, _, b in moved.publishes] == [
        (NEW.names.check_in, b"k.1", b"x"), (NEW.names.cancel, b"", b""), (NEW.names.rules, b"", b"")]
    # the same bytes but the user_id the new broker would check against the move's login
    assert moved.publishes[0][2] == envelope.for_pick_up(sent) and moved.publishes[0][2].get("user_id") is None
    assert moved.publishes[1][2] == cancel and moved.publishes[2][2] == rule
    assert moved.as_sent == 3 and not moved.entries


def test_hostile_a_publishers_gateway_headers_at_check_in_are_its_data_not_a_due_time():
    """A publisher sets the gateway's own headers on a message still unread at check-in: it is
    moved as sent, for the new check-in to read as publisher data, never as a message with a
    due time (which would skip its delay, or the check of it)."""
    forged = lazy_properties.to_wire(BasicProperties(headers={
        envelope.DUE_AT: NOW - 86_400_000, envelope.ROUTING_KEY: b"admin.key", envelope.PROPERTIES: b"",
        carrier.COUNT: 3}))
    moved = Mover(OLD.names, NEW, LEAD, 1000, 1 << 20).take(
        [(Source.CHECK_IN, Delivery(OLD.names.check_in, b"k", forged, carrier.pack([entry(1, 0)])))], NOW)
    assert [(x, k, p) for x, k, p, _ in moved.publishes] == [(NEW.names.check_in, b"k", forged)]
    assert not moved.entries


def test_a_retry_waiting_unread_names_its_queue_and_one_the_old_gateway_would_park_is_parked():
    mover = Mover(OLD.names, NEW, LEAD, 1000, 1 << 20)
    moved = mover.take([(Source.RETRY, rejected("orders", attempt=2, reason="boom")),
                        (Source.RETRY, rejected("orders", death_reason="expired"))], NOW)
    (exchange, key, props, body), (parked_to, _, parked_props, _) = moved.publishes
    assert (exchange, key, body) == (NEW.names.retry, b"orders", b"job")
    assert props.headers.get(retries.QUEUE) == "orders" and props.headers.get(retries.ATTEMPT) == 2
    assert "x-death" not in props.headers  # (RabbitMQ 4 drops a client's)
    assert retries.failure(props.headers).queue == "orders" and retries.failure(props.headers).attempt == 3
    assert parked_to == NEW.names.parked and "only a rejection is retried" in parked_props.headers.get(envelope.ERROR)


def test_damaged_in_the_gateways_queues_is_parked_on_the_new_cluster():
    props = lazy_properties.to_wire(BasicProperties(headers={"junk": 1}))
    moved = Mover(OLD.names, NEW, LEAD, 1000, 1 << 20).take(
        [(Source.HELD, Delivery(OLD.names.distributor, b"", props, b"??"))], NOW)
    [(exchange, _, parked, body)] = moved.publishes
    assert exchange == NEW.names.parked and body == b"??"
    assert "not in the gateway's format" in parked.headers.get(envelope.ERROR)


def test_every_queue_that_holds_messages_is_read_soonest_first():
    assert set(ORDER) == set(SOURCES)
    assert ORDER["distributor"] < ORDER["delay"] < ORDER["meditation"] < ORDER["parked"]


def test_parked_messages_move_as_they_are_parked():
    parked = handlers.park(OLD.names, user("p1"), b"key.p", b"body", "unroutable: no queue bound")
    moved = Mover(OLD.names, NEW, LEAD, 1000, 1 << 20).take(
        [(Source.PARKED, Delivery(OLD.names.parked, b"key.p", parked.props, parked.body))], NOW)
    assert moved.publishes == [(NEW.names.parked, b"key.p", parked.props, b"body")]
    assert moved.as_sent == 1 and not moved.entries
