"""Reading a publisher's due time, and the gateway's own format (pure)."""

import datetime
import struct
from decimal import Decimal

import pytest
from hypothesis import given, strategies as st
from pika import BasicProperties

from gateway.broker.plumbing import lazy_properties
from gateway.core import envelope
from gateway.core.envelope import Inside, Unreadable, due_at
from gateway.core.wire import TableField, Properties, Table, long

NOW = 1_800_000_000_000


def props(**kwargs) -> Properties:
    """Properties as pika would send them (doubles for floats, as other clients do)."""
    return lazy_properties.to_wire(BasicProperties(**kwargs))


def headers(**values) -> Table:
    return props(headers={k.replace("_", "-"): v for k, v in values.items()}).headers


@pytest.mark.parametrize("table,due", [
    ({}, NOW), ({"other": 1}, NOW),
    ({"x-delay": 0}, NOW), ({"x-delay": -5000}, NOW), ({"x-delay": 1500}, NOW + 1500),
    ({"x-delay": "1500"}, NOW + 1500), ({"x-delay": b" 20 "}, NOW + 20),
    ({"x-delay": 1.2}, NOW + 2), ({"x-delay": Decimal("0.5")}, NOW + 1),   # rounded up: never early
    ({"x-delay": None}, NOW),
    ({"x-deliver-at": NOW + 99}, NOW + 99), ({"x-deliver-at": NOW - 99}, NOW - 99),
    ({"x-delay": 1000, "x-deliver-at": NOW + 1200}, NOW + 1200),   # agree: the later wins
    ({"x-delay": 100 * 31_557_600_000}, NOW + 100 * 31_557_600_000),
    # a publisher's x-gateway-* headers are its data, never read as instructions
    ({"x-delay": 4000, "x-gateway-due-at": NOW}, NOW + 4000),
    # the broker's arrival stamp (RabbitMQ 3.12+): x-delay counts from it...
    ({"x-delay": 1000, "timestamp_in_ms": NOW - 300}, NOW + 700),
    # ...when it is plausible: not ahead of the clock by more than the skew, not epoch seconds
    ({"x-delay": 1000, "timestamp_in_ms": NOW + 10_000}, NOW + 1000),
    ({"x-delay": 1000, "timestamp_in_ms": NOW + 10**9}, NOW + 1000),
    ({"x-delay": 1000, "timestamp_in_ms": 1_800_000_000}, NOW + 1000),
    ({"x-delay": 1000, "timestamp_in_ms": "yesterday"}, NOW + 1000),
    ({"x-deliver-at": NOW + 50, "timestamp_in_ms": NOW - 10_000}, NOW + 50),
])
def test_due_time_table(table, due):
    assert due_at(props(headers=table).headers, NOW) == due


@pytest.mark.parametrize("table,reason", [
    ({"x-delay": "soon"}, "'soon', not a number"),
    ({"x-delay": True}, "boolean"),
    ({"x-delay": float("nan")}, "not a finite number"),
    ({"x-delay": float("inf")}, "not a finite number"),
    ({"x-delay": [1]}, "a list"),
    ({"x-delay": {"ms": 1}}, "a dict"),
    ({"x-delay": b"\xff"}, "binary"),
    ({"x-delay": 10**18 + 1}, "out of range"),
    ({"x-delay": datetime.datetime(2030, 1, 1)}, "datetime"),
    ({"x-deliver-at": 1_700_000_000}, "epoch seconds by mistake"),
    ({"x-deliver-at": NOW + 2000 * 31_557_600_000}, "out of range"),
    ({"x-delay": 1000, "x-deliver-at": NOW + 3_600_000}, "disagree"),
])
def test_unreadable_headers_give_a_reason(table, reason):
    with pytest.raises(Unreadable, match=reason):
        due_at(props(headers=table).headers, NOW)


def test_a_delay_of_a_type_that_cannot_be_read_gives_its_type():
    raw = b"\x07x-delay" + b"T" + struct.pack(">Q", 2**62)  # a timestamp past the year 9999
    with pytest.raises(Unreadable, match="AMQP type 'T'"):
        due_at(Table.parse(raw), NOW)


FULL = dict(content_type="application/json", content_encoding="gzip", priority=7,
            correlation_id="c-1", reply_to="replies", expiration="250", message_id="m-1",
            timestamp=1_700_000_000, type="order.created", app_id="shop", delivery_mode=1,
            headers={"x-delay": 5000, "tenant": "acme", "nested": {"a": [1, "b"]}, "x-gateway-due-at": 1})


def test_publishers_properties_lose_only_user_id_and_the_brokers_history():
    sent = props(**FULL)
    assert envelope.for_pick_up(sent) is sent  # nothing to remove: the very same bytes
    with_extras = props(**{**FULL, "user_id": "guest", "headers": {
        **FULL["headers"], "x-death": [{"queue": "q"}], "x-first-death-queue": "q", "x-delivery-count": 3}})
    cleaned = envelope.for_pick_up(with_extras)
    assert cleaned.raw == sent.raw


def due_by_each_name(headers, now):
    """due_at as it read the headers until 2026-11-28, one `get` a name: the reference."""
    due = []
    for name in envelope.DELAYS:
        delay = headers.get(name)
        if delay is not None:
            delay_ms = envelope._as_ms(name, delay)
            if delay_ms > envelope.MAX_AHEAD_MS:
                raise Unreadable("out of range")
            stamp = envelope.arrival_stamp(headers, now)
            due.append((name, (now if stamp is None else stamp) + max(delay_ms, 0)))
    for name in envelope.DUE_TIMES:
        at = headers.get(name)
        if at is not None:
            due.append((name, envelope._absolute(name, at, now)))
    if due and max(d for _, d in due) - min(d for _, d in due) > envelope.AGREEMENT_MS:
        raise Unreadable("disagree")
    return max((at for _, at in due), default=now)


VALUES = st.one_of(st.integers(-2**63, 2**63 - 1).map(lambda v: (b"l", struct.pack(">q", v))),
                   st.integers(NOW - 100_000, NOW + 100_000).map(lambda v: (b"l", struct.pack(">q", v))),
                   st.integers(0, 10**6).map(lambda v: (b"I", struct.pack(">i", v))),
                   st.binary(max_size=12).map(lambda b: (b"S", struct.pack(">I", len(b)) + b)),
                   st.just((b"V", b"")), st.just((b"t", b"\x01")))
DUE_NAMES = st.sampled_from([n.encode() for n in envelope.DELAYS + envelope.DUE_TIMES + (envelope.ARRIVED,)]
                            + [b"other"])


@given(fields=st.lists(st.tuples(DUE_NAMES, VALUES), max_size=8))
def test_due_at_reads_in_one_pass_what_it_read_one_name_at_a_time(fields):
    """Any mix of the delay headers, the arrival stamp and others, of any type, repeated (the
    first of a name counts): the same due time, or unreadable both ways."""
    headers = Table([TableField(n, kind, raw) for n, (kind, raw) in fields])
    try:
        expected = due_by_each_name(headers, NOW)
    except Unreadable:
        with pytest.raises(Unreadable):
            due_at(headers, NOW)
        return
    assert due_at(headers, NOW) == expected


NAMES = st.sampled_from([b"x-death", b"x-delivery-count", b"x-acquired-count", b"x-first-death-queue",
                         b"x-last-death-reason", b"x-first-death-\xff", b"x-last-death-\xc3", b"x-delay", b"\xff"]) \
    | st.binary(max_size=20)


@given(names=st.lists(NAMES, max_size=8))
def test_the_brokers_headers_are_told_from_their_bytes_as_from_their_decoded_names(names):
    """for_pick_up reads names as bytes (every message passes it); what it drops is what
    is_broker_header drops of the decoded names: a name that is not UTF-8 is the publisher's."""
    table = Table([TableField(n, b"l", struct.pack(">q", 1)) for n in names])
    props = Properties.build(headers=table)
    kept = envelope.for_pick_up(props).headers
    assert kept.encode() == table.without(envelope.is_broker_header).encode()


@given(key=st.binary(max_size=255), due=st.integers(0, 2**62), meditations=st.integers(0, 3),
       expiration=st.none() | st.integers(0, 10**9).map(str), mode=st.sampled_from([None, 1, 2]))
def test_the_gateways_format_carries_key_properties_and_due_time_exactly(key, due, meditations, expiration, mode):
    user = props(**{**FULL, "expiration": expiration, "delivery_mode": mode})
    inside = envelope.inside(user, key, due)
    for _ in range(meditations):  # each lap adds the broker's history; the next hop drops it
        death = props(headers={"x-death": [{"q": 1}]}).headers.entries[0]
        dead = inside.replace(headers=inside.headers.with_entry(death))
        inside = Inside(dead).next_hop()
    read = Inside(inside)
    assert read.complete and read.routing_key == key and read.due_ms == due and read.user.raw == user.raw
    assert inside.get("expiration") is None and inside.get("delivery_mode") == 2  # nothing cuts the wait short
    assert [str(n) for n in inside.headers.names()] == [envelope.DUE_AT, envelope.ROUTING_KEY, envelope.PROPERTIES]


def test_a_damaged_format_reads_as_incomplete():
    assert not Inside(props(headers={"x-gateway-routing-key": "text, not bytes"})).complete
    assert not Inside(props()).complete
    parked = Inside(envelope.inside(props(), b"k", None, error="why"))
    assert parked.complete and parked.due_ms is None and parked.error == "why"


def test_the_due_time_stamp_is_added_last_and_replaces_a_publishers_own():
    user = props(**FULL)
    stamped = envelope.stamped(user, NOW)
    assert stamped.headers.get("x-gateway-due-at") == NOW
    assert stamped.headers.names()[-1] == "x-gateway-due-at"
    assert stamped.headers.find("x-gateway-due-at").kind == b"l"
    assert stamped.headers.without(lambda n: n == "x-gateway-due-at") == user.headers.without(
        lambda n: n == "x-gateway-due-at")


def test_the_vocabulary_of_other_schedulers_is_read_the_same_way():
    """Tanzu's delayed queue and AMQP 1.0 clients (x-opt-delivery-delay, x-opt-delivery-time)
    and Azure Service Bus (x-opt-scheduled-enqueue-time): RabbitMQ 4 hands their annotations to
    the gateway as headers."""
    now = 1_800_000_000_000
    assert due_at(Table([long("x-opt-delivery-delay", 1500)]), now) == now + 1500
    assert due_at(Table([long("x-opt-delivery-delay", 1500), long("timestamp_in_ms", now - 200)]), now) == now + 1300
    assert due_at(Table([long("x-opt-delivery-time", now + 5000)]), now) == now + 5000
    assert due_at(Table([long("x-opt-scheduled-enqueue-time", now + 5000)]), now) == now + 5000
    # an AMQP timestamp is whole seconds in 0.9.1: to the end of its second, never early
    second = TableField(b"x-opt-scheduled-enqueue-time", b"T", (now // 1000 + 5).to_bytes(8, "big"))
    assert due_at(Table([second]), now) == now + 5999
    assert isinstance(Table([second]).get("x-opt-scheduled-enqueue-time"), datetime.datetime)
    # several that agree (within a minute): the latest; that disagree: parked, naming both
    assert due_at(Table([long("x-delay", 1000), long("x-opt-delivery-time", now + 1500)]), now) == now + 1500
    with pytest.raises(Unreadable, match="x-delay and x-opt-delivery-time disagree by"):
        due_at(Table([long("x-delay", 1000), long("x-opt-delivery-time", now + 3_600_000)]), now)
    with pytest.raises(Unreadable, match="x-opt-delivery-delay is a boolean"):
        due_at(Table([TableField(b"x-opt-delivery-delay", b"t", b"\x01")]), now)
