"""End to end through the real gateway and broker, in every queue-type x zero-bits mode."""

import time

import pika
import pytest

from gateway.broker.plumbing import lazy_properties

from .support import CHAIN_PATH, Receiver, connect, drain, now_ms, publish_sentinel, same_entries, sent_headers, \
    wait_until

# quorum/queue (the default) and classic/exchange use every broker feature the four modes
# use (quorum and classic v2 queues, pass queues, exchange-to-exchange bindings); the other
# two run on 3.10. Saves about 30 s.
pytestmark = [pytest.mark.brokers("rmq3.10", when={"chain": ("quorum", "exchange")}),
              pytest.mark.brokers("rmq3.10", when={"chain": ("classic", "queue")})]

MODES = [("quorum", "queue"), ("quorum", "exchange"), ("classic", "queue"), ("classic", "exchange")]
# A small chain so that long delays need meditation: 3 levels x 100 ms = 700 ms at most.
SMALL = dict(max_level=3, resolution_ms=100)


@pytest.fixture(params=MODES, ids=["-".join(m) for m in MODES])
def chain(request, make_chain):
    queue_type, zero_bits = request.param
    return make_chain(queue_type=queue_type, zero_bits=zero_bits, **SMALL)


# Stalls of a loaded CI machine reach a few hundred milliseconds. Due order is the
# distributor's job, and it can only order what the chain hands it early, so the order tests
# run with a lead that absorbs such stalls (the setting an operator raises for the same reason).
LEAD_MS = 500


def publish(chain, messages):
    """messages: (routing_key, body, BasicProperties) tuples; confirmed one by one.

    Returns, per body, the clock read just before its publish: the gateway cannot have seen
    the message earlier, so its due time is at least this plus the delay."""
    sent = {}
    with connect() as c:
        ch = c.channel()
        ch.confirm_delivery()
        for key, body, properties in messages:
            sent[body] = now_ms()
            ch.basic_publish(chain.names.check_in, key, body, lazy_properties.encoded(properties), mandatory=True)
    return sent


def delayed(ms, **properties):
    return pika.BasicProperties(headers={"x-delay": ms}, **properties)


def test_every_kind_of_delay_arrives_in_due_order_never_early(chain, run_gateway):
    # Without carriers, so that a message's route is exactly its delay's (the carrier wait
    # would be planned in as well): carriers have tests of their own. On the chain path: the
    # routes through each level and meditation are the test's point.
    run_gateway(chain, *CHAIN_PATH, "--lead-ms", str(LEAD_MS), "--stamp-due-at", "--carrier-wait-ms", "0")
    receiver = Receiver(chain)
    # Units in the chain = (delay - lead) // 100: none (0, 550); level 0 only (600);
    # level 2 only (900); levels 0 and 2 (1050); the chain's maximum, 7 (1200); and three
    # meditation laps of 700 ms before the chain (3000).
    delays = [0, 550, 600, 900, 1050, 1200, 3000]
    sent = publish(chain, [(f"k.{d}", str(d).encode(), delayed(d)) for d in reversed(delays)])
    got = receiver.collect(len(delays), timeout=20)
    assert sorted(m.body for m in got) == sorted(str(d).encode() for d in delays)
    # In the order of the due times the gateway gave them (x-gateway-due-at): x-delay counts
    # from check-in on 3.10, so 550 and 600 published together may fall due either way round.
    due = [m.properties.headers["x-gateway-due-at"] for m in got]
    assert due == sorted(due), [(m.body, d) for m, d in zip(got, due, strict=False)]
    for m in got:
        assert m.at_ms >= int(m.properties.headers["x-gateway-due-at"])
        assert m.at_ms >= sent[m.body] + int(m.body)  # never early
        assert m.routing_key == f"k.{int(m.body)}"


def test_a_burst_published_in_reverse_comes_out_in_due_order(chain, run_gateway):
    run_gateway(chain, "--lead-ms", str(LEAD_MS))
    receiver = Receiver(chain)
    # The first due is published last: the order can hold only if it reaches the gateway
    # before the second is due. 30 confirmed publishes took 514 ms on a loaded machine here.
    start = now_ms() + 2000
    due = [start + 100 * i for i in range(30)]
    sent = publish(chain, [("burst", str(t).encode(), pika.BasicProperties(headers={"x-deliver-at": t}))
                           for t in reversed(due)])
    got = receiver.collect(len(due), timeout=30)
    last_publish = max(sent.values()) - start  # below 0: before the first due time, as it must be
    assert [int(m.body) for m in got] == due, (last_publish, [(int(m.body) - start, m.at_ms - start) for m in got])
    assert all(m.at_ms >= int(m.body) for m in got)
    assert len(sent) == len(got)


def test_what_the_user_sent_survives_exactly(chain, run_gateway):
    run_gateway(chain, *CHAIN_PATH)  # (through levels and meditation, whose dead-lettering adds x-death)
    receiver = Receiver(chain)
    body = bytes(range(256)) * 3
    headers = {"x-delay": 900, "tenant": "acme", "n": -7, "big": 2**40, "f": 1.5, "list": [1, "two", b"3"],
               "table": {"deep": {"er": True}}, "raw": b"\x00\xff", "none": None}
    properties = dict(content_type="application/octet-stream", content_encoding="identity",
                      correlation_id="corr-1", reply_to="replies", message_id="id-1", timestamp=1_700_000_000,
                      type="t", app_id="tests", priority=3, delivery_mode=1, expiration="250")
    keys = ["orders.eu.created", "", "ключ.ü.✓", "a" * 255]
    sent = pika.BasicProperties(headers=headers, **properties)
    publish(chain, [(key, body, sent) for key in keys])
    got = receiver.collect(len(keys), timeout=15)
    assert sorted(m.routing_key for m in got) == sorted(keys)
    for m in got:
        assert m.body == body
        assert sent_headers(m.properties) == headers  # no x-gateway-*, x-death, x-delivery-count
        for name, value in properties.items():
            assert getattr(m.properties, name) == value, name
        # byte for byte, every header with its wire type (the broker may add its arrival stamp)
        assert same_entries(m.properties.wire.headers, lazy_properties.to_wire(sent).headers)


def test_a_short_expiration_does_not_cut_the_delay_short(chain, run_gateway):
    run_gateway(chain, *CHAIN_PATH)  # (an expiration would bite where it waits in a queue: meditation, the levels)
    receiver = Receiver(chain)
    sent = publish(chain, [("e", b"e", delayed(1500, expiration="200"))])
    [m] = receiver.collect(1, timeout=10)
    assert m.at_ms - sent[b"e"] >= 1500
    assert m.properties.expiration == "200"


def test_no_header_means_now(chain, run_gateway):
    run_gateway(chain)
    receiver = Receiver(chain)
    publish(chain, [("now", b"a", pika.BasicProperties()), ("now", b"b", delayed(-3000))])
    assert sorted(m.body for m in receiver.collect(2, timeout=10)) == [b"a", b"b"]


def test_unreadable_delays_are_parked_with_a_reason(chain, run_gateway):
    gateway = run_gateway(chain)
    publish(chain, [("bad.1", b"1", delayed("soon")),
                    ("bad.2", b"2", pika.BasicProperties(headers={"x-deliver-at": 1_700_000_000})),
                    ("bad.3", b"3", pika.BasicProperties(headers={"x-delay": 10, "x-deliver-at": now_ms() + 9**9}))])
    parked = wait_parked(chain, 3)
    reasons = {body: p.headers["x-gateway-error"] for _, p, body in parked}
    assert "not a number" in reasons[b"1"]
    assert "epoch seconds" in reasons[b"2"]
    assert "disagree" in reasons[b"3"]
    assert {m.routing_key for m, _, _ in parked} == {"bad.1", "bad.2", "bad.3"}
    assert len(gateway.events("parked")) == 3
    assert gateway.metric("delay_gateway_parked_total", queue=chain.names.check_in) == 3


def test_a_due_message_nobody_is_bound_for_is_parked(chain, run_gateway):
    gateway = run_gateway(chain)
    receiver = Receiver(chain, pattern="bound.#")
    # due within the hold: straight to the distributor, which holds it until due (the
    # distributor that consumes this chain's exit is test_every_kind_of_delay's)
    publish(chain, [("unbound.key", b"lost?", delayed(800)), ("bound.key", b"fine", delayed(900))])
    assert [m.body for m in receiver.collect(1, timeout=10)] == [b"fine"]
    [(method, properties, body)] = wait_parked(chain, 1)
    assert body == b"lost?" and method.routing_key == "unbound.key"
    assert "no queue bound" in properties.headers["x-gateway-error"]
    assert chain.names.pick_up in properties.headers["x-gateway-error"]
    # parked the same way as an unreadable header: one log line and the counter beside it
    [logged] = [e for e in gateway.events("parked") if e.get("routing_key") == "unbound.key"]
    distributor = chain.names.distributor
    assert logged["queue"] == distributor and "no queue bound" in logged["reason"]
    assert gateway.metric("delay_gateway_parked_total", queue=distributor) == 1


def wait_parked(chain, count, timeout=10.0):
    """Take `count` messages out of parked (drained as they come; fewer if no more came)."""
    with connect() as c:
        ch = c.channel()
        got = []

        def enough() -> bool:
            got.extend(drain(ch, chain.names.parked))
            return len(got) >= count
        wait_until(enough, timeout, fail=False)
        return got


def test_competing_gateways_deliver_each_message_once(make_chain, run_gateway):
    chain = make_chain(**SMALL)
    run_gateway(chain)
    run_gateway(chain)
    receiver = Receiver(chain)
    n = 300
    publish(chain, [("c", str(i).encode(), delayed(i * 7 % 1500)) for i in range(n)])
    publish_sentinel(chain, 1500)  # once it came, nothing more may come
    receiver.until_sentinel(20)
    assert sorted(int(m.body) for m in receiver.messages) == list(range(n))


def broker_stamps_arrival() -> bool:
    """Whether the broker adds `timestamp_in_ms` to what it receives (RabbitMQ 3.12+ with the
    message interceptor on): then x-delay counts from arrival."""
    with connect() as c:
        ch = c.channel()
        q = ch.queue_declare("", exclusive=True).method.queue
        ch.confirm_delivery()
        ch.basic_publish("", q, b"probe", mandatory=True)  # confirmed: in the queue

        def probe():
            method, properties, _ = ch.basic_get(q, auto_ack=True)
            return method is not None and (properties,)
        [properties] = wait_until(probe, 10, what="the probe in its queue")
        return "timestamp_in_ms" in (properties.headers or {})


def test_x_delay_counts_from_arrival_where_the_broker_stamps_it_else_from_check_in(make_chain, run_gateway):
    """Published while no gateway runs (a check-in backlog of 2 s): with the broker's
    arrival stamp the message is due 3 s after its publish; without it, 3 s after the
    gateway read it."""
    chain = make_chain(**SMALL)
    receiver = Receiver(chain)
    sent = publish(chain, [("backlog", b"b", delayed(3000))])[b"b"]
    stamps = broker_stamps_arrival()
    time.sleep(2.0)  # the backlog this test is about: a chosen span, not a wait for something
    started = now_ms()
    run_gateway(chain, "--stamp-due-at")
    [m] = receiver.collect(1, timeout=15)
    # The due time the gateway gave it, not when it came: a gateway slow to start on a busy
    # machine delivers it late either way.
    due = int(m.properties.headers["x-gateway-due-at"])
    assert m.at_ms >= due
    if stamps:
        assert sent + 3000 <= m.at_ms and due < started + 3000  # from arrival: before read + 3 s
    else:
        assert due >= started + 3000  # from when check-in read it
