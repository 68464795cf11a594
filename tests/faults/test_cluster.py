"""A 3-node cluster on this machine, quorum queues replicated on all three: the node that
leads the distributor queue is stopped, killed (-9) or cut off from the other two mid-run,
while the gateway holds hundreds of messages from it (the defaults: what is due within the
hold, 10 s or 1,000 messages' worth at the rate, goes from check-in straight to the
distributor), with the rest in the chain and new ones arriving through the other nodes; the
gateway, given all three URLs and connected to that node first, carries on.

Required on RabbitMQ 4.3.x (Khepri, its only metadata store; every fault) and, when the run
includes 4.0 (DELAY_GATEWAY_TEST_BROKERS), on 4.0.x with the Mnesia and with the Khepri store
(the same cluster, moved to Khepri by enabling the `khepri_db` flag after the Mnesia cases):
lost = 0, early = 0 and stalled = 0, where stalled counts a message not delivered within
STALL_BOUND_S of the later of its due time and the moment the cluster is whole again. The
figures (recover_s: from the fault to the last message more than a second late) are in the
test report.

Where 4.3 differs: its quorum queues hold the messages of a consumer whose node became
unreachable for `consumer_disconnected_timeout` (60 s by default) or until the node is back.
A kill -9 of the leader the gateway is connected to leaves the few deliveries it held there
waiting until the node returns: the figures show them (overdue_before_heal, recover_s),
still within the stall bound. The broker's default is kept here, as users have it.

The 4.x nodes each live in a network namespace of their own (tests/faults/netns.py), so
the partition is real: the leader's link is taken down and not one packet passes between it
and the others until it comes back up. They run with `cluster_partition_handling =
pause_minority` (the lone node pauses and closes its clients' connections, so the gateway
moves to the majority) and `net_ticktime = 10` (the partition is noticed in about 10 s, not
60). The partition lasts until the gateway has moved, then for the traffic below.

Known broker limitation, found by this test: on RabbitMQ 3.10.8 (Debian's) messages that
expire in a quorum queue whose leader moved often stop being dead-lettered: they stay in
their source queue (counted in `messages`, neither ready nor unacked) and are not
delivered, even with traffic going on and after the old leader is back; in about one run
of three everything flows. This matches the dead-letter worker failover bugs fixed after
3.10.8 (rabbitmq-server PR #7677, "Improve rabbit_fifo_dlx_worker resiliency"). Nothing is
destroyed: the test checks that every missing message is still held by the chain's queues,
and reports an expected failure (xfail, with the figures) on 3.10 only, for the stopped
leader (in the long run only: DELAY_GATEWAY_TEST_BROKERS=3.10,4.3,4.0); on 4.x nothing is
excused.
"""

import dataclasses
import json
import time
from typing import Optional

import pytest

from topology import ChainSettings

from ..conftest import brokers_wanted, checked_runtime
from ..support import GatewayProcess, declared, now_ms, unique_prefix, wait_until
from .load import Sink, count, mixed_delays, publish, where_are_they
from .netns import Lan
from .nodes import HOST_RUNTIME, Cluster, unique_names
from .test_broker import queue_depths

# Once the cluster is whole again, every message must arrive within this many seconds
# of the later of that moment and its due time.
STALL_BOUND_S = 30
# How long after the fault, the node still away, the figures wait for every message due more
# than a second ago (caught_up_before_heal_s): half of RabbitMQ 4.3's consumer_disconnected_timeout.
CAUGHT_UP_S = 30
RABBITMQ4_CLUSTER_CONFIG = ["cluster_partition_handling = pause_minority"]
# The 4.x clusters run the streams' smaller replication buffers that docs/operating.md offers
# (What a prefix costs the broker), so every promise below holds with them; 3.10's keeps the
# broker's default (a buffer of about 4 MB per follower of each stream).
SMALL_BUFFERS = "{osiris, [{replica_recbuf, 262144}, {replica_buffer, 524288}]}"
RABBITMQ4_ADVANCED = "[{kernel, [{net_ticktime, 10}]}, " + SMALL_BUFFERS + "]."
# What a stream follower's replication socket buffers (inet `buffer`), per cluster: the
# broker's default is replica_recbuf 2,041,500 and twice that as the buffer.
REPLICA_BUFFER = {"rmq3.10": 4_083_000, "rmq4.3": 524_288, "rmq4.0": 524_288}
REPLICA_BUFFERS = ("lists:usort([B || P <- erlang:ports(), {name, \"tcp_inet\"} =:= erlang:port_info(P, name), "
                   "{connected, Pid} <- [erlang:port_info(P, connected)], "
                   "element(1, proc_lib:translate_initial_call(Pid)) =:= osiris_replica, "
                   "{ok, [{buffer, B}]} <- [inet:getopts(P, [buffer])]]).")

CLUSTERS = [("rmq3.10", "mnesia"), ("rmq4.3", "khepri"), ("rmq4.0", "mnesia"), ("rmq4.0", "khepri")]
FAULTS = ["stop", "kill9", "partition"]


def wanted(params) -> bool:
    """The cases that run (tests/conftest.py deselects the others, and the brokers the run
    leaves out): on 4.3 every fault; on 4.0 every fault with Mnesia, and the abrupt ones with
    Khepri (kill -9 and a partition: a clean stop hands leadership over, and 4.3 covers it on
    Khepri); on 3.10 the stopped leader only (its expected failure), in the long run that
    includes 4.0 (80 s of a 3-node cluster for a known broker bug: the default run stays
    under 20 minutes)."""
    label, store = params["cluster"]
    fault = params["fault"]
    if label == "rmq3.10":
        return fault == "stop" and "rmq4.0" in brokers_wanted()
    return not (label == "rmq4.0" and store == "khepri" and fault == "stop")


_RUNNING = {}  # broker label -> Cluster: the 4.0 Khepri cases reuse the 4.0 cluster


@pytest.fixture(scope="module")
def _clusters():
    yield _RUNNING
    for c in _RUNNING.values():
        c.close()
    _RUNNING.clear()


def restore(cluster) -> None:
    """Whatever a failed case before left broken: links up, every node running."""
    if cluster.lan is not None:
        for i in range(len(cluster.nodes)):
            cluster.lan.heal(i)
    for node in cluster.nodes:
        if node.process is None or node.process.poll() is not None:
            node.start()


@pytest.fixture(scope="module")
def cluster(request, _clusters):
    """One 3-node cluster per broker version; 4.3 has Khepri from its first boot; the 4.0
    Khepri cases run on the 4.0 cluster after its Mnesia cases (CLUSTERS order), once
    enabling the flag has moved it to Khepri (what a 4.0-4.2 user does to a live cluster)."""
    label, store = request.param
    c = _clusters.get(label)
    if c is None:
        runtime = checked_runtime(label)
        if runtime is HOST_RUNTIME:
            c = Cluster(unique_names(3, "cluster"), runtime=HOST_RUNTIME)
        else:
            c = Cluster(unique_names(3, "cluster"), runtime=runtime, lan=Lan(3),
                        extra_config=RABBITMQ4_CLUSTER_CONFIG, advanced_config=RABBITMQ4_ADVANCED)
        c.start_or_fail(f"a 3-node {label} cluster")
        c.version_text = c.version
        _clusters[label] = c
    restore(c)
    wait_whole(c)
    if store == "khepri" and c.metadata_store() != "khepri":
        c.enable_khepri()
    assert c.metadata_store() == store, "a Mnesia case after the Khepri ones: keep CLUSTERS order"
    c.store = store
    return c


def replica_buffers(node) -> Optional[str]:
    """The buffers of the node's stream replication sockets, as Erlang prints the list; None
    while it has none."""
    out = node.ctl("eval", REPLICA_BUFFERS).stdout.strip()
    return None if out == "[]" else out


def quorum_queues(node, prefix: str) -> dict:
    """name -> (leader, members) for the chain's queues."""
    out = node.ctl("list_queues", "-q", "--no-table-headers", "name", "leader", "members").stdout
    found = {}
    for line in out.splitlines():
        name, leader, members = line.split("\t")
        if name.startswith(prefix + "."):
            found[name] = (leader, members)
    return found


def running(node) -> int:
    """How many nodes `node` sees running (0 while it is paused or down)."""
    r = node.ctl("cluster_status", "--formatter", "json", check=False, timeout=30)
    try:
        return len(json.loads(r.stdout)["running_nodes"]) if r.returncode == 0 else 0
    except (ValueError, KeyError):
        return 0


def wait_whole(cluster, timeout: float = 90, nodes=None) -> float:
    """Until every node (of `nodes`) sees all three running; returns the moment (epoch ms)."""
    wait_until(lambda: all(running(n) == len(cluster.nodes) for n in nodes or cluster.nodes), timeout, 0.5,
               "the cluster whole again")
    return now_ms()


def wait_apart(survivor, timeout: float = 40) -> float:
    """Until the majority has noticed that one node is gone; returns the seconds it took."""
    started = time.monotonic()
    wait_until(lambda: running(survivor) == 2, timeout, 0.5, "the partition noticed by the majority")
    return time.monotonic() - started


class Fault:
    """Start and end one fault on the victim node."""

    def __init__(self, kind: str, cluster: Cluster, victim) -> None:
        self.kind, self.cluster, self.victim = kind, cluster, victim
        self.noticed_s = self.moved_s = None

    def begin(self, survivor, gateway) -> None:
        if self.kind == "stop":
            self.victim.stop()
        elif self.kind == "kill9":
            self.victim.kill()
        else:
            started = time.monotonic()
            connected = len(gateway.events("connected"))
            self.cluster.lan.cut(self.cluster.nodes.index(self.victim))
            self.noticed_s = round(wait_apart(survivor), 1)
            if self.cluster.store == "khepri":
                # Khepri has no partition handling strategy: the lone node stays up, and
                # the gateway with it (nothing makes it move). The partition lasts 5 s more (a
                # chosen length, not a wait).
                time.sleep(5)
                return
            # Mnesia, pause_minority: the partition lasts until the lone node has paused and
            # the gateway, whose connection that closed, has moved to the majority.
            if not wait_until(lambda: len(gateway.events("connected")) > connected, 60, 0.2, fail=False):
                raise AssertionError("the cut-off node did not pause (or the gateway did not move) within "
                                     f"60 s:\n{self.victim.log_lines('partition', 'minority', 'pause')}\n"
                                     f"gateway: {''.join(gateway.raw[-30:])}")
            self.moved_s = round(time.monotonic() - started, 1)

    def end(self) -> None:
        if self.kind == "partition":
            self.cluster.lan.heal(self.cluster.nodes.index(self.victim))
        else:
            self.victim.start()


def overdue(sent, sink, by_ms: int = 1000) -> int:
    """Messages due more than `by_ms` ago and not delivered yet."""
    with sink._lock:
        delivered = set(sink.arrivals)
    now = now_ms()
    return sum(1 for s in sent if s.message_id not in delivered and s.not_before_ms + by_ms < now)


def stall_figures(sent, sink, fault_ms: int, whole_ms: int) -> dict:
    """stalled: not delivered within STALL_BOUND_S of max(due, whole again).
    max_late_s: the latest any message arrived after it was due.
    recover_s: from the fault until the last arrival more than a second late (0: none was);
    what a user of the cluster would see as the outage."""
    with sink._lock:
        first = {k: min(v) for k, v in sink.arrivals.items()}
    stalled, max_late, last_late = 0, 0, None
    for s in sent:
        arrived = first.get(s.message_id)
        if arrived is None or arrived > max(s.not_before_ms, whole_ms) + STALL_BOUND_S * 1000:
            stalled += 1
        if arrived is not None and arrived > fault_ms:
            late = arrived - s.not_before_ms
            max_late = max(max_late, late)
            if late > 1000:
                last_late = max(last_late or 0, arrived)
    return {"stalled": stalled, "max_late_s": round(max_late / 1000, 1),
            "recover_s": round((last_late - fault_ms) / 1000, 1) if last_late else 0.0}


@pytest.mark.parametrize("fault", FAULTS)
@pytest.mark.parametrize("cluster", CLUSTERS, ids=["-".join(c) for c in CLUSTERS], indirect=True, scope="module")
def test_cluster_survives_losing_the_leader(cluster, fault, fault_report):
    label = cluster.runtime.label
    restore(cluster)
    wait_whole(cluster, nodes=cluster.nodes[:1])  # the fault before is over
    chain = declared(ChainSettings(prefix=unique_prefix(), max_level=4, resolution_ms=200), cluster.urls[0])
    queues = quorum_queues(cluster.nodes[1], chain.prefix)
    levels = {n: q for n, q in queues.items() if ".level." in n}
    assert levels and all(members.count("@") == 3 for _, members in levels.values()), queues
    # the follower's stream replicas buffer what this cluster's settings say
    buffers = wait_until(lambda: replica_buffers(cluster.nodes[1]), 30, 0.5, "the stream replicas")
    assert buffers == f"[{REPLICA_BUFFER[label]}]", buffers
    # The leader of what the distributor holds: the queue the shorter path fills.
    leader = queues[chain.names.distributor][0]
    victim = next(n for n in cluster.nodes if n.node == leader)
    survivors = [n for n in cluster.nodes if n is not victim]
    # The leader's URL first: the gateway is connected to the node that will go away.
    urls = [victim.url] + [n.url for n in survivors]
    sink = Sink(urls, chain)
    # Each message travels alone (no carriers), so the broker's count of what a queue holds is
    # a count of messages: on 3.10 the stalled ones sit where no client can read them, and
    # only that count tells held from lost.
    gateway = GatewayProcess(chain, "--carrier-messages", "1", url=",".join(urls)).wait_ready()
    action = Fault(fault, cluster, victim)
    try:
        sent = publish(urls, chain, mixed_delays(1500, 4000, seed=11))
        # the fault once the distributor holds a good number (its deliveries from the victim)
        held = wait_until(lambda: (n := gateway.metric("delay_gateway_held_messages")) >= 50 and n, 30, 0.01,
                          "the distributor holding 50")
        fault_at, fault_ms = time.monotonic(), now_ms()
        action.begin(survivors[0], gateway)
        # Traffic goes on while the node is away (new messages through the others).
        for i in range(8):
            sent += publish([n.url for n in survivors], chain, mixed_delays(40, 4000, seed=100 + i))
            time.sleep(0.5)  # (the publishers' pace)
        new_leader = quorum_queues(survivors[0], chain.prefix)[chain.names.distributor][0]
        overdue_at_end = overdue(sent, sink)
        # Before the node is back: what the gateway's distributor held from it goes out from the
        # gateway's memory once the broker has not handed it back within seconds (RabbitMQ 4.3
        # keeps it for consumer_disconnected_timeout, 60 s). What check-in had read and not yet
        # sent on waits for that timeout (a few messages, in some runs). Measured after a kill -9
        # only: a node stopped cleanly closes its connections (the broker hands everything back),
        # and a partition with Khepri leaves the gateway on the cut-off node until it heals.
        caught_up = fault == "kill9" and wait_until(lambda: overdue(sent, sink) == 0, CAUGHT_UP_S, 0.2, fail=False)
        caught_up_s = round(time.monotonic() - fault_at, 1)
        action.end()
        whole_at = wait_whole(cluster)
        away_s = round(time.monotonic() - fault_at, 1)
        last_due = max(s.not_before_ms for s in sent)
        delivered = sink.wait_for([s.message_id for s in sent],
                                  timeout=max(0, (max(last_due, whole_at) - now_ms()) / 1000) + STALL_BOUND_S)
        whereabouts = {} if delivered else where_are_they(urls, chain)
        # `messages` counts what a quorum queue holds, ready or not (passive declare would not).
        depths = queue_depths(survivors[0], chain.prefix)
        held = sum(n for q, n in depths.items() if not q.endswith(".test-sink"))
        version = cluster.version_text
        reconnected = int(gateway.metric("delay_gateway_connections_total"))
        problems = [e for e in gateway.lines if e.get("level") in ("warning", "error")]
    finally:
        victim_log = victim.log_lines("partition", "minority", "pause", "Partial", "nodedown", "node down")
        code = gateway.terminate()
        sink.close()
        sink.delete()
    figures = count(f"cluster-{label}-{cluster.store}-{fault}", sent, sink, 1, nodes=3,
                    version=version, away_s=away_s, held_at_fault=int(held),
                    **({"noticed_s": action.noticed_s, "gateway_moved_s": action.moved_s} if action.noticed_s else {}),
                    reconnects=reconnected - 1,
                    **stall_figures(sent, sink, fault_ms, whole_at), overdue_before_heal=overdue_at_end,
                    caught_up_before_heal_s=caught_up_s if caught_up else None,
                    released_from_memory=sum(e.get("messages", 0) for e in gateway.events("released_from_memory")))
    # Report lost as destroyed (neither delivered nor held by the chain's queues), and the
    # rest of the undelivered as what it is: still in the broker.
    destroyed = max(0, figures.lost - held)
    figures = fault_report(dataclasses.replace(figures, lost=destroyed, extra={
        **figures.extra, "undelivered_held_in_broker": figures.lost - destroyed}))
    # Every fault but a Khepri partition takes the gateway's node away from it.
    moved = reconnected >= 2 or (fault == "partition" and cluster.store == "khepri")
    assert new_leader != leader and moved and code == 0, (new_leader, reconnected, code, victim_log, problems[-5:],
                                                                  "".join(gateway.raw)[-3000:])
    assert figures.early == 0, figures.early_ids
    if version.startswith("4.3.") and fault == "kill9":  # (the broker keeps the dead node's deliveries back)
        assert figures.extra["released_from_memory"] > 0, figures.extra
    if not delivered:
        # Not delivered is not lost: the broker still holds each one in the chain's queues.
        assert held >= figures.extra["undelivered_held_in_broker"], (figures.lost_ids, whereabouts, problems[-20:])
        if version.startswith("3.10."):
            pytest.xfail(f"RabbitMQ {version}: {figures.extra['undelivered_held_in_broker']} messages stalled in "
                         f"quorum dead-lettering after the leader moved (held, not lost: {depths})")
    assert delivered and figures.lost == 0, (figures.lost_ids, whereabouts, problems[-20:])
    assert figures.extra["stalled"] == 0, figures.extra
