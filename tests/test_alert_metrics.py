"""The metrics the alerts read (deploy/prometheus/delay-gateway-rules.yaml), from a real
`delay-gateway run` against a real broker: readiness by role, the ready messages of the
gateway's own queues, and whether the process follows the cancellations stream."""

import pika
import pytest

from topology import build
from topology.broker.declare import declare
from topology.broker.inventory import Prober

from gateway.broker.run.upkeep import count_queues, counted_queues
from gateway.metrics import Metrics

from .support import GatewayProcess, connect, wait_until

pytestmark = [pytest.mark.brokers("rmq3.10", reason="the gateway's own metrics: no broker version changes them")]


def ready_by_role(gateway) -> dict:
    return {labels["role"]: value for labels, value in gateway.samples("delay_gateway_ready")}


def test_readiness_is_labelled_with_the_processes_role(make_chain, run_gateway):
    chain = make_chain(max_level=3, resolution_ms=100)
    check_in = run_gateway(chain, "--role", "check-in")
    distributor = run_gateway(chain, "--role", "distributor")
    both = run_gateway(chain)
    assert ready_by_role(check_in) == {"check-in": 1.0}
    assert ready_by_role(distributor) == {"distributor": 1.0}
    assert ready_by_role(both) == {"all": 1.0}


def test_every_consumer_exposes_its_parked_count_from_the_start(make_chain, run_gateway):
    """At 0 before anything is parked: an alert's increase() sees the first park too."""
    chain = make_chain(max_level=3, resolution_ms=100)
    gateway = run_gateway(chain, "--role", "check-in")
    n = chain.names
    assert dict((labels["queue"], value) for labels, value in gateway.samples("delay_gateway_parked_total")) == \
        {n.check_in: 0, n.returning: 0, n.retry: 0}


def test_the_queues_ready_messages_are_counted(make_chain):
    """Messages waiting in check-in (no check-in consumer runs) are counted by the upkeep's
    passive declares, and every counted queue has a value."""
    chain = make_chain(max_level=3, resolution_ms=100)
    with connect() as c:
        ch = c.channel()
        ch.confirm_delivery()
        for i in range(7):
            ch.basic_publish(chain.names.check_in, f"k.{i}", b"x", pika.BasicProperties(headers={"x-delay": 60_000}),
                             mandatory=True)
    # (not waited ready: with messages in check-in and no check-in consumer, a distributor waits
    # for one before it consumes, worker.wait_for_check_in; its upkeep counts meanwhile)
    gateway = GatewayProcess(chain, "--role", "distributor")

    def counts() -> dict:
        return {labels["queue"]: value for labels, value in gateway.samples("delay_gateway_queue_messages")}

    try:
        found = wait_until(lambda: counts() if len(counts()) == 6 else None, 20, what="the queues counted")
        assert set(found) == set(counted_queues(chain.names))
        assert found[chain.names.check_in] == 7
        assert found[chain.names.parked] == 0 and found[chain.names.distributor] == 0
    finally:
        gateway.terminate()


def test_a_queue_that_is_missing_has_no_count(make_chain):
    chain = make_chain(max_level=1)
    metrics = Metrics()
    metrics.queue_messages.labels("gone").set(3)
    with connect() as c:
        prober = Prober(c)
        count_queues(prober, (chain.names.parked, "gone", "never-there"), metrics)
    def sample(queue: str):
        return metrics.registry.get_sample_value("delay_gateway_queue_messages", {"vhost": "/", "queue": queue})
    assert sample(chain.names.parked) == 0
    assert sample("gone") is None
    assert sample("never-there") is None


def test_following_the_cancellations_stream_drops_to_0_while_it_cannot_be_read(make_chain, run_gateway):
    chain = make_chain(max_level=3, resolution_ms=100)
    gateway = run_gateway(chain)
    assert gateway.metric("delay_gateway_cancellations_following") == 1
    with connect() as c:
        c.channel().queue_delete(chain.names.cancellations)
    wait_until(lambda: gateway.metric("delay_gateway_cancellations_following") == 0 and
               gateway.events("cancellations_consumer_cancelled"), 20, what="following drops to 0")
    with connect() as c:  # back: the follower attaches again and reads on
        declare(c.channel(), build(chain))
    wait_until(lambda: gateway.metric("delay_gateway_cancellations_following") == 1, 20, what="following again")
    assert gateway.proc.poll() is None
