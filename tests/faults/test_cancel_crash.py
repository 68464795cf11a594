"""A confirmed cancel wins through a gateway killed with SIGKILL, or whose connection the
broker closes, at the worst moment: right after the cancels are confirmed, while the
messages they cancel are in open carriers (not yet acknowledged) and held by the distributor
(the default path: due within 10 s, they go there from check-in), or, on the chain path,
in the chain and lapping meditation too. A rescheduled id arrives once, with its new body.

On every suite broker: the private node without the arrival stamp (3.10, and 4.3 with the
interceptor off, as a broker has it by default), and the session's 4.3 node with the stamp
on. About 12 s a case."""

import subprocess
from typing import Dict, List

import pika
import pytest

from topology import ChainSettings

from ..support import CHAIN_PATH, GatewayProcess, Receiver, connect, now_ms, publish_sentinel, report_figures, \
    wait_until
from .proxy import Proxy
from ..support import RMQ4

# 4 levels of 200 ms: the chain holds up to 3 s; longer delays lap meditation first.
CHAIN = dict(max_level=4, resolution_ms=200)
LEAD_MS = 1500  # on the chain path, the distributor holds what is due within 1.5 s (plus a unit)
# Messages wait up to 1 s in an open carrier for company: the fresh ones are still there,
# unacknowledged, when their cancels are read (which close the carriers at once).
WAIT_MS = 1000
# On the default path all three kinds are held by the distributor from check-in on; on the
# chain path (a case of its own) they are held, in the chain, lapping meditation.
KINDS = {"held": 2000, "chain": 3200, "meditating": 6000}
FRESH_MS = 4000


def publish(url: str, chain: ChainSettings, messages: List[tuple]) -> None:
    """(message id, delay ms, body) each, confirmed, on one channel (in this order)."""
    with connect(url) as c:
        ch = c.channel()
        ch.confirm_delivery()
        for mid, delay, body in messages:
            ch.basic_publish(chain.names.check_in, "k", body, pika.BasicProperties(
                message_id=mid, headers={"x-delay": delay}, delivery_mode=2), mandatory=True)


def cancel_and_publish(url: str, chain: ChainSettings, items: List[tuple]) -> None:
    """('cancel', id) or ('publish', id, delay, body), in this order on one channel, each
    confirmed before the next (a reschedule waits for its cancel's confirm)."""
    with connect(url) as c:
        ch = c.channel()
        ch.confirm_delivery()
        for item in items:
            if item[0] == "cancel":
                ch.basic_publish(chain.names.cancel, "", b"", pika.BasicProperties(message_id=item[1]),
                                 mandatory=True)
            else:
                _, mid, delay, body = item
                ch.basic_publish(chain.names.check_in, "k", body, pika.BasicProperties(
                    message_id=mid, headers={"x-delay": delay}, delivery_mode=2), mandatory=True)


def wait_forwarded(gateways: List[GatewayProcess], chain: ChainSettings, count: int) -> None:
    """Until check-in has published `count` messages on (their carriers closed): then they
    are in the chain, in meditation or with the distributor, no longer in check-in."""
    def forwarded() -> float:
        return sum(g.metric("delay_gateway_batched_messages_total", queue=chain.names.check_in) for g in gateways)
    wait_until(lambda: forwarded() >= count, 15, what=f"check-in forwarding {count} messages")


def consumers(url: str, queues: List[str]) -> int:
    """How many consumers the broker counts on these queues (0 once it has noticed that a
    killed gateway's connections are gone, and handed back what it held)."""
    with connect(url) as c:
        ch = c.channel()
        return sum(ch.queue_declare(q, passive=True).method.consumer_count for q in queues)


def run_case(url: str, chain: ChainSettings, how: str, label: str) -> None:
    args = ("--lead-ms", str(LEAD_MS), "--carrier-wait-ms", str(WAIT_MS))
    if how.endswith("on-the-chain"):  # (the kinds in the chain and meditation: where they wait)
        args += CHAIN_PATH
    receiver = Receiver(chain, url=url)
    proxy = Proxy(url)
    gateway = GatewayProcess(chain, *args, url=proxy.url).wait_ready()
    second = None
    try:
        # In place before the cancels: held by the distributor (and on the chain path in the chain, in meditation).
        placed = [(f"{kind}-{n}", delay, b"old") for kind, delay in KINDS.items() for n in range(4)]
        publish(url, chain, placed)
        wait_forwarded([gateway], chain, len(placed))
        forwarded_at = now_ms()  # every placed one was read by then: due by this plus its delay
        # Fresh ones and, behind them, the cancels of half of everything; one id rescheduled
        # at once after its cancel's confirm. Then the kill (or the lost connection) at once.
        fresh = [(f"fresh-{n}", FRESH_MS, b"old") for n in range(8)]
        cancelled = [mid for mid, _, _ in placed + fresh if int(mid.rsplit("-", 1)[1]) % 2 == 0]
        items = [("publish", *m) for m in fresh] + [("cancel", mid) for mid in cancelled]
        items.append(("publish", "fresh-0", FRESH_MS, b"new"))
        cancel_and_publish(url, chain, items)
        if how.endswith("recorded"):  # the cancels read, recorded (in the cancellations stream:
            # the gateway reads them back from it) and acknowledged within ACK_FLUSH_MS of their
            # confirms, either side of the kill; what came before them may still wait in open carriers
            wait_until(lambda: gateway.metric("delay_gateway_cancellations_held") >= len(cancelled), 10,
                       interval=0.01, what=f"{len(cancelled)} cancels recorded in the stream")
        held = gateway.metric("delay_gateway_held_messages")  # (what the crash hands back to the distributor queue)
        if how.startswith("kill"):
            gateway.kill()
            # down until the broker has handed back what it held, as a supervisor would see it
            wait_until(lambda: consumers(url, [chain.names.check_in, chain.names.distributor]) == 0, 15,
                       what="the broker noticing the killed gateway")
        else:
            assert proxy.cut() >= 1  # every connection of the gateway, at once
            wait_until(lambda: gateway.events("connection_lost"), 15, what="the gateway noticing the cut")
        # rescheduled after its cancel while the gateway is down or reconnecting
        cancel_and_publish(url, chain, [("publish", "held-0", 2500, b"new")])
        # Behind everything in check-in (what the gateway held comes back ahead of it), due
        # after the last of the placed ones and of those read again (fresh, held-0) by more
        # than the lead and a unit: once it arrived, a cancelled one could not come any more.
        publish_sentinel(chain, max(FRESH_MS, forwarded_at + KINDS["meditating"] - now_ms()), LEAD_MS, url=url)
        if how.startswith("kill"):
            second = GatewayProcess(chain, *args, url=proxy.url)  # the supervisor restarts it
        expected = {mid for mid, _, _ in placed + fresh} - set(cancelled) | {"fresh-0", "held-0"}
        receiver.until_sentinel(40)
    finally:
        for g in (gateway, second):
            if g is not None and g.proc.poll() is None:
                g.terminate()
        receiver.close()
        proxy.close()
    got: Dict[str, List[bytes]] = {}
    for m in receiver.messages:
        got.setdefault(m.properties.message_id, []).append(m.body)
    through = sorted(mid for mid in cancelled if mid in got and got[mid] != [b"new"])
    lost = sorted(expected - set(got))
    duplicates = sum(len(v) - 1 for v in got.values())
    report_figures("cancel crash figures", f"cancel-{how} broker={label} cancelled={len(cancelled)} "
                                           f"cancelled_delivered={len(through)} lost={len(lost)} "
                                           f"duplicates={duplicates} delivered={len(receiver.messages)} "
                                           f"held_at_fault={held:g}")
    assert held > 0 or how.endswith("on-the-chain"), "the distributor held nothing at the fault: it proved nothing"
    assert not through, f"cancelled but delivered: {through} ({got})"
    assert not lost, f"lost: {lost}"
    assert got["fresh-0"] == [b"new"] and got["held-0"] == [b"new"], got


# SIGKILL as soon as the cancels are confirmed (some read, some not), or once the gateway
# logged them recorded; the connections cut once recorded. Then the first on the chain path.
HOW = ["kill", "kill-recorded", "connection-recorded"]


@pytest.mark.parametrize("how", HOW + ["kill-on-the-chain"])
def test_a_confirmed_cancel_wins_through_a_crash_without_the_arrival_stamp(own_node, node_chain, how):
    run_case(own_node.url, node_chain(**CHAIN), how, own_node.runtime.label + " (no stamp)")


@pytest.mark.parametrize("how", HOW)
@pytest.mark.brokers(*RMQ4, reason="the session's 4.x nodes stamp arrivals; the same test without the stamp runs on "
                                   "every version's private node")
def test_a_confirmed_cancel_wins_through_a_crash_with_the_arrival_stamp(broker, make_chain, how):
    run_case(broker, make_chain(**CHAIN), how, "4.x (stamp)")


def test_rabbitmq_hands_back_a_dead_consumers_messages_in_their_first_order(own_node):
    """What check-in's fence relies on (gateway/core/deliveries.py), on this version, for
    both queue types: a consumer killed holding messages, some acknowledged out of order
    (and more delivered as acks free its prefetch); the next reader gets what was not
    acknowledged in the order first published, then the rest."""
    import os
    import signal
    import sys
    child = (
        "import sys, time, pika\n"
        "c = pika.BlockingConnection(pika.URLParameters(sys.argv[1])); ch = c.channel()\n"
        "ch.basic_qos(prefetch_count=40); got = []\n"
        "ch.basic_consume(sys.argv[2], lambda ch_, m, p, b: got.append((m.delivery_tag, int(b))))\n"
        "while len(got) < 40: c.process_data_events(0.1)\n"
        "tags = {i: t for t, i in got}\n"
        "ch.basic_ack(tags[4], multiple=True)\n"
        "for i in list(range(6, 40, 3)) + [23, 22]: ch.basic_ack(tags[i])\n"
        "c.process_data_events(0.5); print('ready', flush=True); time.sleep(60)\n")
    for queue_type in ("classic", "quorum"):
        queue = f"redeliver-{queue_type}-{os.getpid()}"
        with connect(own_node.url) as c:
            ch = c.channel()
            ch.queue_declare(queue, durable=True, arguments={"x-queue-type": queue_type})
            ch.confirm_delivery()
            for i in range(60):
                ch.basic_publish("", queue, str(i).encode(), pika.BasicProperties(delivery_mode=2))
            proc = subprocess.Popen([sys.executable, "-c", child, own_node.url, queue], stdout=subprocess.PIPE,
                                    text=True)
            try:
                assert proc.stdout.readline().strip() == "ready"
            finally:
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait()
            acked = set(range(5)) | set(range(6, 40, 3)) | {22, 23}
            order = handed_back(c, queue, 60 - len(acked))
            ch.queue_delete(queue)
        ids = [i for i, _ in order]
        assert ids == sorted(set(range(60)) - acked), (queue_type, order)
        redelivered = [r for _, r in order]
        assert redelivered == sorted(redelivered, reverse=True), (queue_type, order)  # handed back first


def handed_back(connection, queue: str, count: int) -> List[tuple]:
    """(body, redelivered) of the `count` messages a dead consumer left in `queue`, in the
    order the broker hands them out, once it has noticed the dead connection and they are
    all ready again (fewer if they did not come within 20 s: the order is checked after)."""
    channel = connection.channel()
    wait_until(lambda: channel.queue_declare(queue, passive=True).method.message_count >= count, 20,
               sleep=connection.sleep, fail=False)
    order: List[tuple] = []

    def read_all() -> bool:
        while len(order) < count:
            method, _, body = channel.basic_get(queue, auto_ack=True)
            if method is None:
                return False
            order.append((int(body), method.redelivered))
        return True
    wait_until(read_all, 20, sleep=connection.sleep, fail=False)
    return order


def run_replicas(url: str, chain: ChainSettings, after_check_in: bool, label: str) -> None:
    """Two gateways; one killed right after the cancels are confirmed. `after_check_in`: the
    cancels come once check-in forwarded their messages (docs/cancelling.md, Limits: without
    the stamp a cancel must come after that), else right after the messages."""
    args = ("--lead-ms", str(LEAD_MS))
    receiver = Receiver(chain, url=url)
    replicas = [GatewayProcess(chain, *args, url=url).wait_ready() for _ in range(2)]
    try:
        placed = [(f"{kind}-{n}", delay, b"old") for kind, delay in {**KINDS, "fresh": FRESH_MS}.items()
                  for n in range(6)]
        publish(url, chain, placed)
        if after_check_in:
            wait_forwarded(replicas, chain, len(placed))
        cancelled = [mid for mid, _, _ in placed if int(mid.rsplit("-", 1)[1]) % 2 == 0]
        cancel_and_publish(url, chain, [("cancel", mid) for mid in cancelled])
        replicas[0].kill()
        # Every message was read by now (forwarded), or stamped by the broker on arrival: due
        # by now plus its delay. The sentinel after the last of them by more than the lead and
        # a unit: once it arrived, a cancelled one could not come any more.
        publish_sentinel(chain, now_ms() + KINDS["meditating"], LEAD_MS, absolute=True, url=url)
        expected = {mid for mid, _, _ in placed} - set(cancelled)
        receiver.until_sentinel(40)
    finally:
        for g in replicas:
            if g.proc.poll() is None:
                g.terminate()
        receiver.close()
    got: Dict[str, int] = {}
    for m in receiver.messages:
        got[m.properties.message_id] = got.get(m.properties.message_id, 0) + 1
    through, lost = sorted(set(cancelled) & set(got)), sorted(expected - set(got))
    report_figures("cancel crash figures", f"cancel-two-replicas-one-killed broker={label} cancelled={len(cancelled)} "
                                           f"cancelled_delivered={len(through)} lost={len(lost)} "
                                           f"duplicates={sum(got.values()) - len(got)}")
    assert not through and not lost, (through, lost)


def test_two_replicas_one_killed_without_the_stamp_cancels_that_came_after_check_in(own_node, node_chain):
    run_replicas(own_node.url, node_chain(**CHAIN), True, own_node.runtime.label + " (no stamp)")


@pytest.mark.brokers(*RMQ4, reason="the session's 4.x nodes stamp arrivals; without the stamp it runs on every "
                                   "version's private node")
def test_two_replicas_one_killed_with_the_stamp_cancels_right_after_their_messages(broker, make_chain):
    run_replicas(broker, make_chain(**CHAIN), False, "4.x (stamp)")
