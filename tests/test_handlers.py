"""What each consumer does with a delivery, with a fixed clock (pure)."""

from hypothesis import given
from hypothesis import strategies as st
from pika import BasicProperties

from gateway.core import carrier, envelope
from gateway.broker.plumbing import lazy_properties
from gateway.core.actions import Enqueue, Forward
from gateway.core.inputs import Delivery
from gateway.core.routes import Way
from gateway.core.carrier import Entry
from gateway.core.envelope import Inside
from gateway.core.handlers import CheckIn, Distributor, Parking, Returning, Routes, carry, route
from gateway.core.wire import Properties
from topology import ChainSettings

NOW = 1_800_000_000_000
CHAIN = ChainSettings(prefix="d", max_level=4, resolution_ms=1000)
LEVEL = "d.1000ms-quorum-queue.level."
MEDITATION = "d.1000ms-quorum-queue.meditation.04"


def props(**kwargs) -> Properties:
    return lazy_properties.to_wire(BasicProperties(**kwargs))


def published(headers=None, key=b"user.key", **properties) -> Delivery:
    return Delivery("d.check-in", key, props(headers=headers, **properties), b"body")


def check_in(headers=None, wait_ms=0, **kw):
    [action] = CheckIn(CHAIN, lead_ms=50, wait_ms=wait_ms)(published(headers, **kw), NOW)
    return action


def sent(action) -> Delivery:
    """What the next queue delivers of an action sent alone (the broker keeps the bytes)."""
    f = carry(action.exchange, action.routing_key, action.way, [action.entry]) \
        if isinstance(action, Enqueue) else action
    return Delivery(f.exchange, f.routing_key, f.props, f.body)


def test_check_in_routes_by_remaining_delay():
    a = check_in({"x-delay": 11_050})
    assert isinstance(a, Enqueue) and (a.exchange, a.routing_key, a.way) == (LEVEL + "03", b"1.1.0.1", "chain")
    assert check_in({"x-delay": 500}).exchange == "d.distributor"
    assert check_in({"x-delay": 60_000}).exchange == MEDITATION
    assert check_in({"x-delay": 500}).entry.due_ms == NOW + 500


def test_a_message_that_may_wait_for_a_carrier_leaves_the_chain_that_much_earlier():
    assert check_in({"x-delay": 11_050}).routing_key == b"1.1.0.1"
    assert check_in({"x-delay": 11_050}, wait_ms=20).routing_key == b"0.1.0.1"  # 10 units, not 11


def test_check_in_parks_an_unreadable_delay_under_the_publishers_key():
    parked = check_in({"x-delay": "tomorrow"}, key=b"\xffnot-utf8")
    assert isinstance(parked, Forward)
    assert (parked.exchange, parked.routing_key, parked.way) == ("d.parked", b"\xffnot-utf8", "parked")
    inside = Inside(parked.props)
    assert "not a number" in inside.error and inside.due_ms is None and inside.routing_key == b"\xffnot-utf8"


def test_forged_internal_headers_are_only_the_publishers_data():
    forged = {"x-delay": 4000, "x-gateway-due-at": NOW, "x-gateway-routing-key": "elsewhere",
              "x-gateway-expiration": 5000, "x-gateway-properties": b"\x00", "x-gateway-carrier": 3}
    e = check_in(forged, expiration="100").entry
    assert e.due_ms == NOW + 4000 and e.routing_key == b"user.key"
    assert e.user.headers.to_dict() == forged and e.user.get("expiration") == b"100"


def test_returning_from_meditation_goes_on_by_its_due_time():
    meditating = sent(check_in({"x-delay": 60_000}))
    [later] = Returning(CHAIN, 50)(meditating, NOW + 15_000)
    assert later.exchange == MEDITATION  # 45 s to go: another lap
    [last] = Returning(CHAIN, 50)(meditating, NOW + 52_000)
    assert (last.exchange, last.routing_key) == (LEVEL + "02", b"1.1.1")
    assert last.entry.due_ms == NOW + 60_000


def test_returning_parks_what_is_not_in_the_gateways_format():
    [f] = Returning(CHAIN, 50)(published({"x-gateway-due-at": NOW}), NOW)
    assert f.way == "parked" and "not in the gateway's format" in Inside(f.props).error


def test_distributor_holds_until_due_and_restores_key_and_properties_exactly():
    user = dict(headers={"x-delay": 3000, "n": 1.5}, expiration="10", delivery_mode=1, message_id="m")
    [out] = Distributor(CHAIN, 50)(sent(check_in(**user)), NOW + 2500)
    assert (out.exchange, out.routing_key, out.not_before_ms, out.mandatory) == (
        "d.pick-up", b"user.key", NOW + 3000, True)
    assert out.props.raw == props(**user).raw


def test_a_carrier_takes_every_message_exactly_and_the_distributor_releases_each_at_its_time():
    batch = [check_in({"x-delay": 3000 + i}, key=f"k.{i}".encode(), message_id=f"m{i}").entry for i in range(3)]
    big = check_in({"x-delay": 3000}, key=b"\xff", message_id="\x00" * 255).entry
    batch.append(Entry(big.routing_key, big.user, b"\x00" * 70_000, big.due_ms))
    c = carry(LEVEL + "01", b"1.1", Way.CHAIN, batch)
    assert Inside(c.props).due_ms == NOW + 3000 and c.props.headers.get(carrier.COUNT) == 4
    out = Distributor(CHAIN, 50)(Delivery("d.distributor", b"", c.props, c.body), NOW + 2000)
    assert [(f.routing_key, f.not_before_ms, f.body) for f in out] == [(e.routing_key, e.due_ms, e.body) for e in batch]
    assert [f.props.raw for f in out] == [e.user.raw for e in batch]


def test_returning_sends_each_message_of_a_carrier_on_by_its_own_time():
    batch = [check_in({"x-delay": 20_000}).entry, check_in({"x-delay": 60_000}).entry]
    c = carry(MEDITATION, b"", "meditation", batch)
    out = Returning(CHAIN, 50)(Delivery("d.returning", b"", c.props, c.body), NOW + 15_000)
    assert [(a.exchange, a.entry.due_ms) for a in out] == [(LEVEL + "02", NOW + 20_000), (MEDITATION, NOW + 60_000)]


def test_distributor_stamps_the_due_time_only_when_asked():
    [out] = Distributor(CHAIN, 50, stamp_due_at=True)(sent(check_in({"x-delay": 3000})), NOW)
    assert out.props.headers.get("x-gateway-due-at") == NOW + 3000
    [plain] = Distributor(CHAIN, 50)(sent(check_in({"x-delay": 3000})), NOW)
    assert "x-gateway-due-at" not in plain.props.headers


def test_distributor_sends_a_far_early_message_back_into_the_chain():
    [out] = Distributor(CHAIN, 50)(sent(check_in({"x-deliver-at": NOW + 3_600_000})), NOW)
    assert out.way == "recheck" and out.exchange == MEDITATION


def test_distributor_parks_an_unroutable_message_keeping_its_due_time():
    e = check_in({"x-delay": 300}, key=b"nobody.home").entry
    parked = Distributor(CHAIN, 50).unroutable(e)
    got = Inside(parked.props)
    assert (parked.exchange, parked.routing_key) == ("d.parked", b"nobody.home")
    assert got.due_ms == NOW + 300 and "no queue bound to exchange 'd.pick-up'" in got.error


def test_parking_explains_dead_letters_and_unroutable_messages():
    park = Parking(CHAIN.names)
    # a publisher's message the broker dead-lettered from check-in (routing key: the queue's role)
    dead = Delivery("d.parking", b"check-in", props(headers={"x-delay": 5, "x-death": [
        {"queue": "d.check-in", "reason": "expired", "routing-keys": ["orders.eu"]}]}), b"b")
    [f] = park(dead, NOW)
    got = Inside(f.props)
    assert got.error == "dead-lettered from queue d.check-in: its own expiration ran out before the gateway read it"
    assert f.routing_key == b"orders.eu" and got.user.headers.to_dict() == {"x-delay": 5}
    # a carrier of two, from the distributor: each parked on its own, with its due time
    batch = [check_in({"x-delay": 5}, key=b"a").entry, check_in({"x-delay": 6}, key=b"b").entry]
    c = carry("d.distributor", b"", Way.DISTRIBUTOR, batch)
    death = props(headers={"x-death": [{"queue": "d.distributor", "reason": "delivery_limit"}]}).headers.entries[0]
    out = park(Delivery("d.parking", b"distributor", c.props.replace(headers=c.props.headers.with_entry(death)),
                        c.body), NOW)
    assert [(f.routing_key, Inside(f.props).due_ms) for f in out] == [(b"a", NOW + 5), (b"b", NOW + 6)]
    assert all("redelivered too often" in Inside(f.props).error for f in out)
    # a chain exchange had no binding for the key
    [stray] = park(Delivery(LEVEL + "01", b"1.7", sent(check_in({"x-delay": 5})).props, b"body"), NOW)
    assert "unroutable in the chain" in Inside(stray.props).error


def test_a_parked_message_keeps_the_publishers_properties_for_replay():
    original = props(headers={"x-delay": "soon", "t": "x"}, message_id="m-1", expiration="5")
    [f] = CheckIn(CHAIN, 50)(Delivery("d.check-in", b"k", original, b"b"), NOW)
    assert Inside(f.props).user.raw == envelope.for_pick_up(original).raw


@given(st.integers(-10**6, 10**13), st.integers(0, 5000))
def test_remembered_routes_are_the_routes(remaining_ms, lead_ms):
    chain = ChainSettings(prefix="r", max_level=6, resolution_ms=250)
    routes = Routes(chain, lead_ms)
    assert routes(remaining_ms) == route(chain, remaining_ms, lead_ms)
    assert routes(remaining_ms) == route(chain, remaining_ms, lead_ms)  # and once remembered
