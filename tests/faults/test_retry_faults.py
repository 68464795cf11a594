"""Retries through faults, on the private node of each suite version: the gateway killed with
SIGKILL while retries wait in the retry queue, in carriers not yet sent and held by the
distributor (the defaults: a retry due within 10 s goes there from the retry queue, as the
first attempts of the default policy do), then the broker restarted: every rejected message
comes back to its queue, none sooner than its policy's delay after its rejection, none lost."""

import json
from typing import Dict, List

import pika

from gateway.core import retries

from ..support import GatewayProcess, connect, now_ms, report_figures, wait_until

POLICY = [{"queue": "*", "base_ms": 1500, "factor": 1, "jitter": 0, "attempts": 3}]


def messages(node, queue: str) -> int:
    """What `queue` holds, ready or not (a passive declare would not count the unacknowledged)."""
    out = node.ctl("list_queues", "-q", "--no-table-headers", "name", "messages").stdout
    return sum(int(line.rpartition("\t")[2]) for line in out.splitlines() if line.rpartition("\t")[0] == queue)


def test_retries_waiting_survive_a_gateway_kill_and_a_broker_restart(own_node, node_chain):
    chain = node_chain(max_level=5, resolution_ms=200)
    args = ("--retry-policies", json.dumps(POLICY), "--lead-ms", "800")
    queue = f"{chain.prefix}.work"
    ids = [f"job-{n}" for n in range(60)]
    rejected_at: Dict[str, int] = {}
    back: Dict[str, List[int]] = {}
    gateway = GatewayProcess(chain, *args, url=own_node.url).wait_ready()
    try:
        with connect(own_node.url) as c:
            ch = c.channel()
            ch.queue_declare(queue, durable=True, arguments={"x-queue-type": "quorum",
                                                             "x-dead-letter-exchange": chain.names.retry})
            ch.confirm_delivery()
            for mid in ids:
                ch.basic_publish("", queue, mid.encode(), pika.BasicProperties(message_id=mid, delivery_mode=2))
            for n in range(len(ids)):
                method, props, _ = ch.basic_get(queue, auto_ack=False)
                ch.basic_reject(method.delivery_tag, requeue=False)
                rejected_at[props.message_id] = now_ms()
                if n == 30:  # half rejected with the gateway up, half while it is down
                    held = wait_until(lambda: (h := gateway.metric("delay_gateway_held_messages")) >= 10 and h, 10,
                                      0.005, "the distributor holding 10 retries")
                    gateway.kill()
        # The restart once every rejection has left the work queue, and the retry queue holds
        # at least those rejected while no gateway ran (with what the killed one held).
        wait_until(lambda: messages(own_node, queue) == 0 and messages(own_node, chain.names.retry) >= len(ids) - 31,
                   15, 0.1, "the rejected messages dead-lettered into the retry queue")
        own_node.restart()
        gateway = GatewayProcess(chain, *args, url=own_node.url).wait_ready(timeout=60)
        with connect(own_node.url) as c:
            ch = c.channel()
            # A sentinel failure, as a consumer that publishes it itself reports one: its
            # retry is due 1.5 s from now, after every other (overdue since the restart), so
            # once it and every id are back in the queue, every copy that was coming is too.
            ch.confirm_delivery()
            ch.basic_publish(chain.names.retry, "", b"sentinel", pika.BasicProperties(
                message_id="sentinel", delivery_mode=2, headers={retries.QUEUE: queue}), mandatory=True)
            sentinel: List[int] = []

            def read() -> bool:
                while True:
                    method, props, _ = ch.basic_get(queue, auto_ack=True)
                    if method is None:
                        return bool(sentinel) and set(ids) <= back.keys()
                    assert (props.headers or {}).get(retries.ATTEMPT) == 1, props.headers
                    (sentinel if props.message_id == "sentinel" else back.setdefault(props.message_id, [])).append(
                        now_ms())
            wait_until(read, 40, sleep=c.sleep, fail=False)  # (what did not come back is counted below)
            ch.queue_delete(queue)
    finally:
        if gateway.proc.poll() is None:
            gateway.terminate()
    lost = sorted(set(ids) - set(back))
    early = sorted(mid for mid, times in back.items() if min(times) < rejected_at[mid] + 1500)
    duplicates = sum(len(t) - 1 for t in back.values())
    report_figures("retry figures", f"retry-kill-and-restart broker={own_node.runtime.label} rejected={len(ids)} "
                                    f"held_at_kill={held:g} lost={len(lost)} early={len(early)} "
                                    f"duplicates={duplicates}")
    assert not lost and not early, (lost, early)
