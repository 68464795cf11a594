"""What a gateway says about the broker's arrival stamp, on the private nodes (which have
it off, as a broker has by default): on 3.12+ (4.x here) one `arrival_stamp_off` warning at
start with the rabbitmq.conf line that turns the stamp on, and never again, however often
it reconnects; on 3.10, which cannot stamp, an info line and no such warning. On both, once,
what that means for cancels (exact while one gateway consumes check-in) and what lifts the
limit there. The stamp turned on is tests/test_arrival_stamp.py's (the session's 4.x nodes
have it). About 5 s."""

from gateway.broker.run.stamp import STAMP_CONFIG

from ..support import GatewayProcess, wait_until
from .nodes import HAS_ARRIVAL_STAMP


def test_a_gateway_says_once_that_x_delay_counts_from_check_in(own_node, node_chain, request):
    label = request.node.callspec.params["own_cluster"]
    chain = node_chain(max_level=2, resolution_ms=100)
    gateway = GatewayProcess(chain, url=own_node.url).wait_ready()
    try:
        own_node.ctl("close_all_connections", "test: the gateway reconnects")
        wait_until(lambda: gateway.metric("delay_gateway_connections_total") == 2 and gateway.ready, 20)
        said, off = gateway.events("arrival_stamp"), gateway.events("arrival_stamp_off")
        cancels = gateway.events("cancels_need_one_check_in_consumer")
    finally:
        gateway.terminate()
    [limit] = cancels
    assert limit["level"] == "warning" and limit["cancels"] == "one check-in consumer"
    assert STAMP_CONFIG in limit["fix"] and ("--role distributor" in limit["fix"]) == (label not in HAS_ARRIVAL_STAMP)
    if label in HAS_ARRIVAL_STAMP:
        assert said == [] and len(off) == 1, (said, off)
        [notice] = off
        assert notice["level"] == "warning" and notice["x_delay_counts_from"] == "check-in"
        assert STAMP_CONFIG in notice["fix"] and notice["broker_version"] == label[len("rmq"):]
    else:
        assert off == [] and len(said) == 1, (said, off)
        assert said[0]["state"] == "unavailable" and said[0]["broker_version"] == "3.10"
