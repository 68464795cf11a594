"""Retries through faults, on the private node of each suite version: the gateway killed with
SIGKILL while retries wait everywhere (in the retry queue, in carriers not yet sent, in the
chain, held by the distributor), then the broker restarted: every rejected message comes
back to its queue, none sooner than its policy's delay after its rejection, none lost."""

import json
import time
from typing import Dict, List

import pika

from gateway.core import retries

from ..support import GatewayProcess, connect, now_ms, report_figures

POLICY = [{"queue": "*", "base_ms": 1500, "factor": 1, "jitter": 0, "attempts": 3}]


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
                if n == 30:
                    gateway.kill()  # half rejected with the gateway up, half while it is down
        time.sleep(0.5)
        own_node.restart()
        gateway = GatewayProcess(chain, *args, url=own_node.url).wait_ready(timeout=60)
        deadline = time.monotonic() + 40
        with connect(own_node.url) as c:
            ch = c.channel()
            while len(back) < len(ids) and time.monotonic() < deadline:
                method, props, _ = ch.basic_get(queue, auto_ack=True)
                if method is None:
                    c.sleep(0.02)
                    continue
                assert (props.headers or {}).get(retries.ATTEMPT) == 1, props.headers
                back.setdefault(props.message_id, []).append(now_ms())
            c.sleep(2.0)
            while (got := ch.basic_get(queue, auto_ack=True))[0] is not None:
                back.setdefault(got[1].message_id, []).append(now_ms())
            ch.queue_delete(queue)
    finally:
        if gateway.proc.poll() is None:
            gateway.terminate()
    lost = sorted(set(ids) - set(back))
    early = sorted(mid for mid, times in back.items() if min(times) < rejected_at[mid] + 1500)
    duplicates = sum(len(t) - 1 for t in back.values())
    report_figures("retry figures", f"retry-kill-and-restart broker={own_node.runtime.label} rejected={len(ids)} "
                                    f"lost={len(lost)} early={len(early)} duplicates={duplicates}")
    assert not lost and not early, (lost, early)
