"""The three consumers' decisions, with a fixed clock (pure)."""

import pika

from gateway.actions import Delivery
from gateway.handlers import CheckIn, Distributor, Parking
from topology import ChainSettings

NOW = 1_800_000_000_000
CHAIN = ChainSettings(prefix="d", max_level=4, resolution_ms=1000)


def delivery(headers=None, key="user.key", exchange="d.check-in", **properties):
    return Delivery(exchange, key, pika.BasicProperties(headers=headers, **properties), b"body")


def test_check_in_routes_by_remaining_delay():
    check_in = CheckIn(CHAIN, lead_ms=50, clock=lambda: NOW)
    assert (lambda f: (f.exchange, f.routing_key))(check_in(delivery({"x-delay": 11_050}))) == ("d.level.03", "1.1.0.1")
    assert check_in(delivery({"x-delay": 500})).exchange == "d.distributor"
    assert check_in(delivery({"x-delay": 60_000})).exchange == "d.meditation"
    parked = check_in(delivery({"x-delay": "tomorrow"}))
    assert (parked.exchange, parked.routing_key, parked.outcome) == ("d.parked", "user.key", "parked")
    assert "not a number" in parked.properties.headers["x-gateway-error"]


def test_distributor_holds_until_due_and_restores_the_key():
    inside = CheckIn(CHAIN, 50, lambda: NOW)(delivery({"x-delay": 3000}, expiration="10"))
    out = Distributor(CHAIN, 50, lambda: NOW + 2500)(
        Delivery("d.distributor", inside.routing_key, inside.properties, b"body"))
    assert (out.exchange, out.routing_key, out.not_before_ms) == ("d.pick-up", "user.key", NOW + 3000)
    assert out.properties.headers == {"x-delay": 3000} and out.properties.expiration == "10"


def test_distributor_sends_a_far_early_message_back_to_check_in():
    inside = CheckIn(CHAIN, 50, lambda: NOW)(delivery({"x-deliver-at": NOW + 3_600_000}))
    out = Distributor(CHAIN, 50, lambda: NOW)(Delivery("d.distributor", "", inside.properties, b"body"))
    assert out.exchange == "d.check-in" and out.outcome == "recheck"


def test_parking_explains_dead_letters_and_unroutable_messages():
    park = Parking(CHAIN.names)
    dead = park(delivery({"x-death": [{"queue": "d.check-in", "reason": "delivery_limit"}]}, exchange="d.parking"))
    assert dead.properties.headers["x-gateway-error"] == \
        "dead-lettered from queue d.check-in: redelivered too often (a consumer kept failing on it)"
    unroutable = park(delivery({"x-delay": 5}, key="nobody.home", exchange="d.pick-up"))
    assert unroutable.routing_key == "nobody.home"
    assert "no queue bound to exchange 'd.pick-up'" in unroutable.properties.headers["x-gateway-error"]


def test_a_forward_that_cannot_be_encoded_is_parked_readably():
    from gateway.actions import Forward
    from gateway.handlers import park_unencodable
    bad = Forward("d.pick-up", "user.key", pika.BasicProperties(headers={"huge": 2**70, "ok": 1}), b"b",
                  "delivered")
    parked = park_unencodable(CHAIN.names, bad)
    assert (parked.exchange, parked.routing_key, parked.outcome) == ("d.parked", "user.key", "parked")
    assert "'huge'" in parked.reason and "cannot be encoded" in parked.reason
    assert parked.properties.headers["huge"] == repr(2**70) and parked.properties.headers["ok"] == 1
    b"".join(parked.properties.encode())  # and this one can be published
