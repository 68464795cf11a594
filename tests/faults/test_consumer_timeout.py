"""A broker whose consumer_timeout is shorter than a hold: a node of each suite version of its
own, started with `consumer_timeout = 2000`, where the distributor holds a message for 8 s
on the shorter path.

RabbitMQ 3.11.15 and later honour a consumer's own `x-consumer-timeout`, which the gateway
sets longer than anything it holds: on 4.3 the distributor keeps its consumer and delivers
the message once (without it, 4.3 cancels the consumer every 2 s and hands the message back:
checked). 3.10 ignores it: the broker closes the distributor's channel with 406, and the
gateway says so in one line that names consumer_timeout and what to raise (before: "an object
of the same name exists with other arguments"); the message is handed back, held again, and
delivered, never early."""

import pika

from ..conftest import broker_label, checked_runtime
from ..support import GatewayProcess, Receiver, chains, connect, now_ms, publish_sentinel
from .nodes import Cluster, unique_names

CHAIN = dict(max_level=4, resolution_ms=250)
SHORT = ["consumer_timeout = 2000"]
TICK = "[{rabbit, [{channel_tick_interval, 1000}]}]."  # (a channel checks its consumers at each tick: 60 s)


def test_a_hold_longer_than_the_brokers_consumer_timeout(broker, request):
    label = broker_label(request.node)
    cluster = Cluster(unique_names(1, "ctimeout"), extra_config=SHORT, advanced_config=TICK,
                      runtime=checked_runtime(label))
    cluster.start_or_fail(f"a RabbitMQ node with a short consumer_timeout ({label})")
    node = cluster.nodes[0]
    gateway = receiver = None
    try:
        with chains(node.url) as make:
            chain = make(**CHAIN)
            receiver = Receiver(chain, url=node.url)
            gateway = GatewayProcess(chain, url=node.url).wait_ready()
            due = now_ms() + 8_000
            with connect(node.url) as c:
                ch = c.channel()
                ch.confirm_delivery()
                ch.basic_publish(chain.names.check_in, "held", b"x", pika.BasicProperties(
                    message_id="held", delivery_mode=2, headers={"x-deliver-at": due}), mandatory=True)
            publish_sentinel(chain, due + 2_000, absolute=True, url=node.url)
            [got] = receiver.until_sentinel(60)
            assert got.at_ms >= due
            closed = [e for e in gateway.lines if "consumer_timeout" in str(e)]
            if label == "rmq3.10":
                assert closed, "3.10 ignores x-consumer-timeout: its consumer_timeout should have closed the channel"
                assert all("an object of the same name" not in str(e) for e in gateway.lines)
            else:
                assert not closed and not gateway.events("consumer_cancelled_by_broker"), gateway.lines[-5:]
            gateway.terminate()
            receiver.close()
    finally:
        if gateway is not None and gateway.proc.poll() is None:
            gateway.terminate()
        cluster.close()
