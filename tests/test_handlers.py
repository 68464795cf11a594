"""What each consumer does with a delivery, with a fixed clock (pure)."""

from pika import BasicProperties

from gateway import codec, envelope
from gateway.actions import Delivery
from gateway.envelope import Inside
from gateway.handlers import CheckIn, Distributor, Parking, Returning
from gateway.wire import Properties
from topology import ChainSettings

NOW = 1_800_000_000_000
CHAIN = ChainSettings(prefix="d", max_level=4, resolution_ms=1000)
LEVEL = "d.1000ms-quorum-queue.level."


def props(**kwargs) -> Properties:
    codec.install()
    return Properties.parse(b"".join(BasicProperties(**kwargs).encode()))


def published(headers=None, key=b"user.key", **properties) -> Delivery:
    return Delivery("d.check-in", key, props(headers=headers, **properties), b"body")


def through(forward, exchange="") -> Delivery:
    """What the next queue delivers of a forward (the broker keeps the bytes)."""
    return Delivery(exchange or forward.exchange, forward.routing_key, forward.props, forward.body)


def check_in(headers=None, **kw):
    return CheckIn(CHAIN, lead_ms=50, clock=lambda: NOW)(published(headers, **kw))


def test_check_in_routes_by_remaining_delay():
    f = check_in({"x-delay": 11_050})
    assert (f.exchange, f.routing_key, f.outcome) == (LEVEL + "03", b"1.1.0.1", "chain")
    assert check_in({"x-delay": 500}).exchange == "d.distributor"
    assert check_in({"x-delay": 60_000}).exchange == "d.1000ms-quorum-queue.meditation.04"
    assert Inside(check_in({"x-delay": 500}).props).due_ms == NOW + 500


def test_check_in_parks_an_unreadable_delay_under_the_publishers_key():
    parked = check_in({"x-delay": "tomorrow"}, key=b"\xffnot-utf8")
    assert (parked.exchange, parked.routing_key, parked.outcome) == ("d.parked", b"\xffnot-utf8", "parked")
    inside = Inside(parked.props)
    assert "not a number" in inside.error and inside.due_ms is None and inside.routing_key == b"\xffnot-utf8"


def test_forged_internal_headers_are_only_the_publishers_data():
    forged = {"x-delay": 4000, "x-gateway-due-at": NOW, "x-gateway-routing-key": "elsewhere",
              "x-gateway-expiration": 5000, "x-gateway-properties": b"\x00"}
    f = check_in(forged, expiration="100")
    inside = Inside(f.props)
    assert inside.due_ms == NOW + 4000 and inside.routing_key == b"user.key"
    assert inside.user.headers.to_dict() == forged and inside.user.get("expiration") == b"100"


def test_returning_from_meditation_goes_on_by_its_due_time():
    meditating = check_in({"x-delay": 60_000})
    later = Returning(CHAIN, 50, lambda: NOW + 15_000)(through(meditating, "d.returning"))
    assert later.exchange == "d.1000ms-quorum-queue.meditation.04"  # 45 s to go: another lap
    last = Returning(CHAIN, 50, lambda: NOW + 52_000)(through(meditating, "d.returning"))
    assert (last.exchange, last.routing_key) == (LEVEL + "02", b"1.1.1")
    assert Inside(last.props).due_ms == NOW + 60_000


def test_returning_parks_what_is_not_in_the_gateways_format():
    f = Returning(CHAIN, 50, lambda: NOW)(published({"x-gateway-due-at": NOW}))
    assert f.outcome == "parked" and "without a due time" in Inside(f.props).error


def test_distributor_holds_until_due_and_restores_key_and_properties_exactly():
    user = dict(headers={"x-delay": 3000, "n": 1.5}, expiration="10", delivery_mode=1, message_id="m")
    inside = check_in(**user)
    out = Distributor(CHAIN, 50, lambda: NOW + 2500)(through(inside))
    assert (out.exchange, out.routing_key, out.not_before_ms, out.mandatory) == (
        "d.pick-up", b"user.key", NOW + 3000, True)
    assert out.props.raw == props(**user).raw


def test_distributor_stamps_the_due_time_only_when_asked():
    inside = check_in({"x-delay": 3000})
    out = Distributor(CHAIN, 50, lambda: NOW, stamp_due_at=True)(through(inside))
    assert out.props.headers.get("x-gateway-due-at") == NOW + 3000


def test_distributor_sends_a_far_early_message_back_into_the_chain():
    inside = check_in({"x-deliver-at": NOW + 3_600_000})
    out = Distributor(CHAIN, 50, lambda: NOW)(through(inside, "d.distributor"))
    assert out.outcome == "recheck" and out.exchange == "d.1000ms-quorum-queue.meditation.04"


def test_distributor_parks_an_unroutable_message_keeping_its_due_time():
    inside = check_in({"x-delay": 300}, key=b"nobody.home")
    parked = Distributor(CHAIN, 50, lambda: NOW).unroutable(through(inside))
    got = Inside(parked.props)
    assert (parked.exchange, parked.routing_key) == ("d.parked", b"nobody.home")
    assert got.due_ms == NOW + 300 and "no queue bound to exchange 'd.pick-up'" in got.error


def test_parking_explains_dead_letters_and_unroutable_messages():
    park = Parking(CHAIN.names)
    # a publisher's message the broker dead-lettered from check-in (routing key: the queue's role)
    dead = Delivery("d.parking", b"check-in", props(headers={"x-delay": 5, "x-death": [
        {"queue": "d.check-in", "reason": "expired", "routing-keys": ["orders.eu"]}]}), b"b")
    f = park(dead)
    got = Inside(f.props)
    assert got.error == "dead-lettered from queue d.check-in: its own expiration ran out before the gateway read it"
    assert f.routing_key == b"orders.eu" and got.user.headers.to_dict() == {"x-delay": 5}
    # one in the gateway's format, from the distributor
    inside = check_in({"x-delay": 5})
    dl = inside.props.replace(headers=inside.props.headers.with_entry(props(headers={"x-death": [
        {"queue": "d.distributor", "reason": "delivery_limit"}]}).headers.entries[0]))
    f = park(Delivery("d.parking", b"distributor", dl, b"body"))
    assert "redelivered too often" in Inside(f.props).error and Inside(f.props).due_ms == NOW + 5
    # a chain exchange had no binding for the key
    stray = park(Delivery(LEVEL + "01", b"1.7", inside.props, b"body"))
    assert "unroutable in the chain" in Inside(stray.props).error


def test_a_parked_message_keeps_the_publishers_properties_for_replay():
    sent = props(headers={"x-delay": "soon", "t": "x"}, message_id="m-1", expiration="5")
    f = CheckIn(CHAIN, 50, lambda: NOW)(Delivery("d.check-in", b"k", sent, b"b"))
    assert Inside(f.props).user.raw == envelope.publishers(sent).raw
