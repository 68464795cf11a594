"""Reading due times and moving properties in and out of the chain (pure)."""

import datetime
from decimal import Decimal

import pytest
from hypothesis import given, strategies as st
from pika import BasicProperties

from gateway import envelope
from gateway.envelope import Unreadable, due_at, external, internal

NOW = 1_800_000_000_000


@pytest.mark.parametrize("headers,due", [
    (None, NOW), ({}, NOW), ({"other": 1}, NOW),
    ({"x-delay": 0}, NOW), ({"x-delay": -5000}, NOW), ({"x-delay": 1500}, NOW + 1500),
    ({"x-delay": "1500"}, NOW + 1500), ({"x-delay": b" 20 "}, NOW + 20),
    ({"x-delay": 1.2}, NOW + 2), ({"x-delay": Decimal("0.5")}, NOW + 1),   # rounded up: never early
    ({"x-delay": None}, NOW),
    ({"x-deliver-at": NOW + 99}, NOW + 99), ({"x-deliver-at": NOW - 99}, NOW - 99),
    ({"x-delay": 1000, "x-deliver-at": NOW + 1200}, NOW + 1200),   # agree: the later wins
    ({"x-delay": 10**9, "x-gateway-due-at": NOW + 5}, NOW + 5),    # checked in before: fixed
    ({"x-delay": 100 * 31_557_600_000}, NOW + 100 * 31_557_600_000),
])
def test_due_time_table(headers, due):
    assert due_at(headers, NOW) == due


@pytest.mark.parametrize("headers,reason", [
    ({"x-delay": "soon"}, "'soon', not a number"),
    ({"x-delay": True}, "boolean"),
    ({"x-delay": float("nan")}, "not a finite number"),
    ({"x-delay": float("inf")}, "not a finite number"),
    ({"x-delay": [1]}, "a list"),
    ({"x-delay": {"ms": 1}}, "a dict"),
    ({"x-delay": b"\xff"}, "binary"),
    ({"x-delay": 10**20}, "out of range"),
    ({"x-delay": datetime.datetime(2030, 1, 1)}, "datetime"),
    ({"x-deliver-at": 1_700_000_000}, "epoch seconds by mistake"),
    ({"x-deliver-at": NOW + 2000 * 31_557_600_000}, "out of range"),
    ({"x-delay": 1000, "x-deliver-at": NOW + 3_600_000}, "disagree"),
    # a publisher may forge the internal header; it gets the same range checks
    ({"x-gateway-due-at": 5}, "x-gateway-due-at 5 is out of range"),
    ({"x-gateway-due-at": NOW + 2000 * 31_557_600_000}, "out of range"),
])
def test_unreadable_headers_give_a_reason(headers, reason):
    with pytest.raises(Unreadable, match=reason):
        due_at(headers, NOW)


FULL = dict(content_type="application/json", content_encoding="gzip", priority=7,
            correlation_id="c-1", reply_to="replies", expiration="250", message_id="m-1",
            timestamp=1_700_000_000, type="order.created", app_id="shop", delivery_mode=1,
            headers={"x-delay": 5000, "tenant": "acme", "nested": {"a": [1, "b"]}})


def wire(properties: BasicProperties) -> BasicProperties:
    """Through pika's encoder and decoder, as the broker would carry it."""
    decoded = BasicProperties()
    decoded.decode(b"".join(properties.encode()))
    return decoded


def test_internal_sets_aside_what_would_cut_the_delay_short():
    p = internal(BasicProperties(**FULL), "orders.eu", due_ms=NOW)
    assert p.expiration is None and p.delivery_mode == 2 and p.user_id is None
    assert p.headers[envelope.EXPIRATION] == "250"
    assert p.headers[envelope.DELIVERY_MODE] == 1
    assert p.headers[envelope.ROUTING_KEY] == "orders.eu"
    assert p.headers[envelope.DUE_AT] == NOW


def test_a_second_pass_keeps_what_the_first_recorded():
    first = wire(internal(BasicProperties(**FULL), "k", due_ms=NOW))
    dead_lettered = BasicProperties(**{**vars(first), "headers": {
        **first.headers, "x-death": [{"queue": "q", "reason": "expired"}], "x-first-death-queue": "q",
        "x-last-death-reason": "expired", "x-delivery-count": 0}})
    second = internal(dead_lettered, "meditation-key", due_ms=NOW)
    assert second.headers == first.headers


keys = st.text(max_size=40).filter(lambda s: len(s.encode()) <= 255)
def _containers(inner):
    return st.lists(inner, max_size=3) | st.dictionaries(st.text(min_size=1, max_size=8), inner, max_size=3)


header_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**63, 2**63 - 1) | st.text(max_size=20) | st.binary(max_size=20)
    | st.decimals(allow_nan=False, allow_infinity=False, places=3, min_value=-10**6, max_value=10**6),
    _containers, max_leaves=8)
user_headers = st.dictionaries(st.text(min_size=1, max_size=12).filter(
    lambda k: not k.startswith(("x-gateway-", "x-death", "x-first-death-", "x-last-death-", "x-delivery-count"))),
    header_values, max_size=5)


@given(key=keys, headers=st.none() | user_headers,
       expiration=st.none() | st.integers(0, 10**9).map(str), mode=st.sampled_from([None, 1, 2]),
       meditations=st.integers(0, 3))
def test_external_restores_what_internal_set_aside(key, headers, expiration, mode, meditations):
    original = BasicProperties(**{**FULL, "headers": headers, "expiration": expiration, "delivery_mode": mode})
    p = wire(internal(wire(original), key, due_ms=NOW))
    for _ in range(meditations):  # meditation: back through check-in, dead-letter headers added
        p.headers["x-death"] = [{"queue": "m", "reason": "expired", "count": 1}]
        p = wire(internal(p, "", due_ms=NOW))
    p.headers["x-first-death-queue"] = "x"
    restored_key, restored = external(wire(p), "1.0.1")
    restored = wire(restored)
    expected = wire(original)
    assert restored_key == key
    # An empty header table comes back as no table: the same thing in AMQP.
    assert (restored.headers or {}) == (expected.headers or {}) and restored.expiration == expiration
    assert restored.delivery_mode == mode
    for name in ("content_type", "content_encoding", "priority", "correlation_id", "reply_to",
                 "message_id", "timestamp", "type", "app_id"):
        assert getattr(restored, name) == getattr(expected, name), name


def test_the_distributor_reads_only_the_due_time_check_in_fixed():
    from gateway.envelope import fixed_due_at
    assert fixed_due_at({"x-gateway-due-at": NOW + 5, "x-delay": 10**6}, NOW) == NOW + 5
    assert fixed_due_at({"x-delay": 10**6}, NOW) == NOW
    with pytest.raises(Unreadable):
        fixed_due_at({"x-gateway-due-at": "later"}, NOW)
