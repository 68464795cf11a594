"""AMQP 1.0, RabbitMQ 4's own protocol, with RabbitMQ's AMQP 1.0 Python client: a 1.0
publisher sends to `/exchanges/<prefix>.check-in/<key>` with the delay in
application-properties (`x-delay`) or as annotations (`x-opt-delivery-delay`,
`x-opt-delivery-time`, as Tanzu RabbitMQ's delayed queue reads them), cancels through
`/exchanges/<prefix>.cancel`, and a 1.0 receiver consumes from a queue bound to pick-up.
What arrives is what was sent, but for the differences docs/contract.md lists (RabbitMQ's
own mapping between the protocols: the gateway works in 0.9.1). On the 4.x brokers only."""

import pytest
import threading
from typing import List, Tuple
from urllib.parse import urlsplit

from rabbitmq_amqp_python_client.qpid.proton import timestamp
from rabbitmq_amqp_python_client import AddressHelper, AMQPMessagingHandler, Delivery, Environment, Message

from .support import SENTINEL, connect, now_ms, publish_sentinel
from .support import RMQ4

# AMQP 1.0 is RabbitMQ 4's own protocol (3.x speaks it only through a plugin).
pytestmark = [pytest.mark.brokers(*RMQ4)]


def amqp10_url(url: str) -> str:
    parts = urlsplit(url)
    return f"amqp://{parts.username}:{parts.password}@{parts.hostname}:{parts.port}/"


class Collect(AMQPMessagingHandler):
    """What arrives until the sentinel (not kept)."""

    def __init__(self) -> None:
        super().__init__()
        self.got = []
        self.done = threading.Event()

    def on_amqp_message(self, event) -> None:
        self.delivery_context.accept(event)
        if event.message.id != SENTINEL:
            self.got.append((now_ms(), event.message))
            return
        self.done.set()
        event.receiver.close()
        event.connection.close()


def receive(url: str, queue: str, timeout: float) -> List[Tuple[int, Message]]:
    """What a 1.0 receiver gets from `queue` until the sentinel (`publish_sentinel`) comes:
    once it did, nothing due before it can come any more."""
    handler = Collect()
    env = Environment(amqp10_url(url))
    connection = env.connection()
    connection.dial()
    consumer = connection.consumer(AddressHelper.queue_address(queue), message_handler=handler)
    threading.Thread(target=consumer.run, daemon=True).start()
    assert handler.done.wait(timeout), f"no sentinel within {timeout} s (got {handler.got})"
    return handler.got


def test_an_amqp10_publisher_and_receiver_delay_cancel_and_keep_what_was_sent(broker, make_chain, run_gateway):
    chain = make_chain(max_level=4, resolution_ms=100)
    run_gateway(chain)
    queue = f"{chain.prefix}.amqp10-receiver"
    with connect() as c:
        ch = c.channel()
        ch.queue_declare(queue, durable=True, arguments={"x-queue-type": "quorum"})
        ch.queue_bind(queue, chain.names.pick_up, "orders.#")
    env = Environment(amqp10_url(broker))
    connection = env.connection()
    connection.dial()
    try:
        publisher = connection.publisher(AddressHelper.exchange_address(chain.names.check_in, "orders.eu"))
        sent = now_ms()
        ways = {"app-x-delay": ({"x-delay": 1500}, None),
                "annotation-delay": (None, {"x-opt-delivery-delay": 1500}),
                "annotation-time": (None, {"x-opt-delivery-time": sent + 1500}),
                "service-bus": (None, {"x-opt-scheduled-enqueue-time": timestamp(sent + 1500)}),
                "cancelled": ({"x-delay": 1500}, None)}
        for mid, (application, annotations) in ways.items():
            message = Message(body=f"body of {mid}".encode(), id=mid, durable=True, content_type="text/plain",
                              correlation_id="corr", application_properties={"tenant": "t1", **(application or {})},
                              annotations=annotations)
            assert publisher.publish(message).remote_state == Delivery.ACCEPTED
        canceller = connection.publisher(AddressHelper.exchange_address(chain.names.cancel, ""))
        assert canceller.publish(Message(body=b"", id="cancelled")).remote_state == Delivery.ACCEPTED
        # Due after them all: the Service Bus time is a timestamp, whole seconds for the
        # gateway, which counts it to the end of its second (never early).
        publish_sentinel(chain, sent + 1500 + 999, absolute=True, routing_key="orders.sentinel")
        got = receive(broker, queue, timeout=15)
        with connect() as c:  # nothing more came (the cancelled one), also not behind the sentinel
            assert c.channel().queue_declare(queue, passive=True).method.message_count == 0
    finally:
        connection.close()
        env.close()
        with connect() as c:
            c.channel().queue_delete(queue)
    assert sorted(m.id for _, m in got) == ["annotation-delay", "annotation-time", "app-x-delay", "service-bus"], got
    for at, m in got:
        assert at >= sent + 1500, (m.id, at - sent)  # never early
        assert bytes(m.body) == f"body of {m.id}".encode() and m.content_type == "text/plain"
        assert m.correlation_id == "corr" and m.durable
        assert m.application_properties["tenant"] == "t1"
        # what RabbitMQ's mapping adds for a 1.0 receiver: where it was routed
        assert m.annotations["x-routing-key"] == "orders.eu" and m.annotations["x-exchange"] == chain.names.pick_up
    by_id = {m.id: m for _, m in got}
    # an annotation comes back an annotation; an application property named x-* comes back an
    # annotation too (RabbitMQ maps 0.9.1 headers named x-* to annotations for a 1.0 receiver)
    assert by_id["annotation-delay"].annotations["x-opt-delivery-delay"] == 1500
    assert by_id["annotation-time"].annotations["x-opt-delivery-time"] == sent + 1500
    assert by_id["app-x-delay"].annotations["x-delay"] == 1500
    assert "x-delay" not in by_id["app-x-delay"].application_properties
