"""Faults at the gateway's edges, on the main broker (they do not disturb it): a due
message nobody is bound to receive, and SIGTERM while messages are held."""

import pika

from gateway.core.envelope import Inside

from ..support import GatewayProcess, Receiver, broker_url, connect, drain, now_ms, wait_until
from .load import Sink, count, publish


def test_unroutable_due_message_is_parked_and_does_not_wedge_its_level(make_chain, run_gateway, fault_report):
    # Quorum queues dead-letter at least once: a message that could not be routed would
    # stay at the head of its queue and block the ones behind it. The gateway must park it.
    # On the default path all 51 go from check-in straight to the distributor, which holds
    # them: it is the distributor's queue that must not wedge.
    chain = make_chain(max_level=3, resolution_ms=100)
    run_gateway(chain)
    receiver = Receiver(chain, "bound.#")
    with connect() as connection:
        channel = connection.channel()
        channel.confirm_delivery()
        sent_at = now_ms()
        channel.basic_publish(chain.names.check_in, "nobody.home", b"lost?", pika.BasicProperties(
            message_id="orphan", headers={"x-delay": 300}), mandatory=True)
        behind = []
        for i in range(50):
            before = now_ms()
            channel.basic_publish(chain.names.check_in, f"bound.{i}", b"x", pika.BasicProperties(
                message_id=f"m{i}", headers={"x-delay": 300 + 6 * i}), mandatory=True)
            behind.append((f"m{i}", before + 300 + 6 * i))
    got = receiver.collect(50, timeout=20)
    receiver.close()
    with connect() as connection:
        channel = connection.channel()
        parked = wait_until(lambda: drain(channel, chain.names.parked), 10, 0.1, fail=False) or []
    arrivals = {m.properties.message_id: m.at_ms for m in got}
    early = sum(1 for mid, due in behind if mid in arrivals and arrivals[mid] < due)
    fault_report(count_simple("unroutable-at-pick-up", 51, lost=50 - len(arrivals) + (1 - len(parked)),
                              early=early, parked=len(parked)))
    assert sorted(arrivals) == sorted(mid for mid, _ in behind)
    [(method, properties, body)] = parked
    assert Inside(properties.wire).user.text("message_id") == "orphan" and body == b"lost?"
    assert method.routing_key == "nobody.home"
    assert "unroutable" in properties.headers["x-gateway-error"]
    assert properties.headers["x-gateway-due-at"] >= sent_at + 300


def count_simple(name, sent, lost, early, **extra):
    from .load import Figures
    return Figures(name, sent, 1, lost, early, 0, extra)


def test_sigterm_returns_held_messages_and_exits_0(make_chain, fault_report):
    chain = make_chain(max_level=3, resolution_ms=500)
    url = broker_url()
    sink = Sink([url], chain)
    # The defaults: due within the hold (10 s), every message goes from check-in straight to
    # the distributor, which holds it until due.
    gateway = GatewayProcess(chain).wait_ready()
    try:
        # Delays of 1.2-2 s: all of them held by the distributor within a second; SIGTERM once
        # a good number are.
        sent = publish([url], chain, [1200 + i * 4 for i in range(200)])
        wait_until(lambda: gateway.metric("delay_gateway_held_messages") >= 20, 10,
                   what="20 messages held by the distributor")
        code = gateway.terminate()
        returned = sum(e.get("returned", 0) for e in gateway.events("stopping"))
        # No longer consuming: a new message stays in check-in (the process has exited: the
        # broker counts the message there once it has dropped the gateway's consumers).
        late = publish([url], chain, [0])
        with connect() as connection:
            channel = connection.channel()

            def check_in() -> tuple:
                found = channel.queue_declare(chain.names.check_in, passive=True).method
                return found.message_count, found.consumer_count
            waiting, consumers = wait_until(lambda: (found := check_in())[1] == 0 and found, 10, 0.05,
                                            what="check-in without a consumer")
        restarted = GatewayProcess(chain).wait_ready()
        delivered = sink.wait_for([s.message_id for s in sent + late], timeout=30)
        restarted.terminate()
    finally:
        gateway.kill()
        sink.close()
        sink.delete()
    figures = fault_report(count("sigterm", sent + late, sink, 1, returned_on_stop=returned))
    assert code == 0
    assert returned > 0, "nothing was held at SIGTERM: the test proved nothing"
    assert waiting == 1 and consumers == 0
    assert delivered and figures.lost == 0, figures.lost_ids
    assert figures.early == 0, figures.early_ids
