"""A 3-node cluster on this machine, quorum queues replicated on all three: stop the node
that leads the level queues mid-run; the gateway, given all three URLs, carries on.

Known broker limitation, found by this test: on RabbitMQ 3.10.8 (Debian's) messages that
expire in a quorum queue whose leader moved often stop being dead-lettered: they stay in
their source queue (counted in `messages`, neither ready nor unacked) and are not
delivered, even with traffic going on and after the old leader is back; in about one run
of three everything flows. This matches the dead-letter worker failover bugs fixed after
3.10.8 (rabbitmq-server PR #7677, "Improve rabbit_fifo_dlx_worker resiliency"). Nothing is
destroyed: the test checks that every missing message is still held by the chain's queues,
and reports an expected failure (xfail, with the figures) on 3.10 only; on any other
broker version a stall fails the test.
"""

import dataclasses
import time

import pytest

from topology import ChainSettings

from ..support import GatewayProcess, declared, unique_prefix
from .load import Sink, count, mixed_delays, publish, where_are_they
from .nodes import Cluster, unique_names
from .test_broker import queue_depths


@pytest.fixture
def cluster():
    c = Cluster(unique_names(3, "cluster")).start_or_fail("a 3-node cluster")
    yield c
    c.close()


def quorum_queues(node, prefix: str) -> dict:
    """name -> (leader, members) for the chain's queues."""
    out = node.ctl("list_queues", "-q", "--no-table-headers", "name", "leader", "members").stdout
    found = {}
    for line in out.splitlines():
        name, leader, members = line.split("\t")
        if name.startswith(prefix + "."):
            found[name] = (leader, members)
    return found


def test_cluster_survives_losing_the_leader(cluster, fault_report):
    chain = declared(ChainSettings(prefix=unique_prefix(), max_level=4, resolution_ms=200), cluster.urls[0])
    queues = quorum_queues(cluster.nodes[1], chain.prefix)
    levels = {n: q for n, q in queues.items() if ".level." in n}
    assert levels and all(members.count("@") == 3 for _, members in levels.values()), queues
    leader = levels[chain.names.delay_queue(0)][0]
    victim = next(n for n in cluster.nodes if n.node == leader)
    survivors = [n for n in cluster.nodes if n is not victim]
    # The leader's URL first: the gateway is connected to the node that will go away.
    urls = [victim.url] + [n.url for n in survivors]
    sink = Sink(urls, chain)
    gateway = GatewayProcess(chain, url=",".join(urls)).wait_ready()
    try:
        sent = publish(urls, chain, mixed_delays(1500, 6000, seed=11))
        time.sleep(1.0)
        victim.stop()
        # Traffic goes on while the node is down (new messages through the survivors).
        for i in range(10):
            sent += publish([n.url for n in survivors], chain,
                            mixed_delays(40, 6000, seed=100 + i))
            time.sleep(0.5)
        sink.wait_for([s.message_id for s in sent], timeout=10)
        stalled = count("", sent, sink, 0).lost
        new_leader = quorum_queues(survivors[0], chain.prefix)[chain.names.delay_queue(0)][0]
        reconnected = int(gateway.metric("delay_gateway_connections_total"))
        victim.start()
        delivered = sink.wait_for([s.message_id for s in sent], timeout=20)
        whereabouts = {} if delivered else where_are_they(urls, chain)
        # `messages` counts what a quorum queue holds, ready or not (passive declare would not).
        depths = queue_depths(survivors[0], chain.prefix)
        held = sum(n for q, n in depths.items() if not q.endswith(".test-sink"))
        version = survivors[0].ctl("version").stdout.strip()
        problems = [e for e in gateway.lines if e.get("level") in ("warning", "error")]
    finally:
        code = gateway.terminate()
        sink.close()
        sink.delete()
    figures = count("cluster-leader-stopped", sent, sink, 1, nodes=3, stalled_while_leader_down=stalled)
    # Report lost as destroyed (neither delivered nor held by the chain's queues), and the
    # rest of the undelivered as what it is: still in the broker.
    destroyed = max(0, figures.lost - held)
    fault_report(dataclasses.replace(figures, lost=destroyed, extra={
        **figures.extra, "undelivered_held_in_broker": figures.lost - destroyed}))
    assert new_leader != leader and reconnected >= 2 and code == 0
    assert figures.early == 0, figures.early_ids
    if not delivered:
        # Not delivered is not lost: the broker still holds each one in the chain's queues.
        assert held >= figures.lost, (figures.lost_ids, whereabouts, problems[-20:])
        if version.startswith("3.10."):
            pytest.xfail(f"RabbitMQ {version}: {figures.lost} messages stalled in quorum dead-lettering "
                         f"after the leader moved (held, not lost: {depths})")
    assert delivered and figures.lost == 0, (figures.lost_ids, whereabouts, problems[-20:])
    assert figures.early == 0, figures.early_ids
