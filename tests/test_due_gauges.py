"""The due-time gauges (`--due-gauges-every`: gateway/broker/run/due_gauges.py) against a
real broker: what a gateway says of what waits, by when it falls due, is what `pending count`
says, bytes included; the next due time and the most overdue message's age are exact; and
the readings keep to their CPU budget."""

import json
import subprocess
import sys

import pika
import pytest

from gateway.broker.run.due_gauges import BUDGET, rest_s

from .launcher import ROOT, chain_args
from .support import GatewayProcess, broker_url, connect, now_ms, wait_until

SIZES = {"overdue": 7, "1h": 100, "1d": 50, "7d": 10}


def test_the_readings_keep_to_a_hundredth_of_a_core_however_long_they_take():
    assert rest_s(60, 0.05) == 60  # a small index: every --due-gauges-every
    assert rest_s(60, 20.0) == pytest.approx(20.0 * 99)  # ten million: 20 s of CPU, then 33 min of rest
    assert rest_s(60, 20.0, readers=4) == pytest.approx(20.0 * 399)  # four vhosts share the budget
    for cpu in (0.01, 1.0, 30.0):
        assert cpu / (cpu + rest_s(1, cpu)) <= BUDGET + 1e-12


def test_the_gauges_say_what_pending_count_says(make_chain):
    chain = make_chain(max_level=8, resolution_ms=1000)
    # check-in alone: what falls due stays overdue (no distributor), as in an outage
    gateway = GatewayProcess(chain, "--role", "check-in", "--due-gauges-every", "1").wait_ready()
    try:
        start = now_ms()
        dues = {"overdue": [start + 1000 + n for n in range(10)],
                "1h": [start + 600_000 + n for n in range(30)],
                "1d": [start + 7_200_000 + n for n in range(20)],
                "7d": [start + 3 * 86_400_000 + n for n in range(10)]}
        with connect() as c:
            ch = c.channel()
            ch.confirm_delivery()
            for label, times in dues.items():
                for n, due in enumerate(times):
                    ch.basic_publish(chain.names.check_in, f"g.{label}", b"x" * SIZES[label], pika.BasicProperties(
                        message_id=f"{label}-{n}", delivery_mode=2, headers={"x-deliver-at": due}), mandatory=True)
            for n in range(5):  # cancelled: counted nowhere
                ch.basic_publish(chain.names.cancel, "", b"", pika.BasicProperties(message_id=f"1d-{n}"))
        expected = {"overdue": 10, "1m": 0, "1h": 30, "1d": 15, "7d": 10, "30d": 0, "1y": 0, "later": 0}

        def waiting(label: str) -> float:
            return gateway.metric("delay_gateway_waiting_messages", due=label)
        # a reading after everything was written down and the first ten fell due
        wait_until(lambda: gateway.metric("delay_gateway_waiting_read_timestamp_seconds") * 1000
                   > max(dues["overdue"]) + 1000 and {label: waiting(label) for label in expected} == expected,
                   60, 0.1, "the gauges counting what waits")
        read_ms = gateway.metric("delay_gateway_waiting_read_timestamp_seconds") * 1000
        for label, n in expected.items():
            assert gateway.metric("delay_gateway_waiting_bytes", due=label) == n * SIZES.get(label, 0), label
        assert gateway.metric("delay_gateway_next_due_timestamp_seconds") == min(dues["1h"]) / 1000
        oldest = gateway.metric("delay_gateway_oldest_overdue_seconds")
        assert oldest == pytest.approx((read_ms - min(dues["overdue"])) / 1000, abs=0.01)
        assert 0 < gateway.metric("delay_gateway_waiting_read_cpu_seconds") < 10
        # what `pending count` says, range by range
        r = subprocess.run([sys.executable, "-m", "gateway", "pending", "count", "--json", "--url", broker_url(),
                            *chain_args(chain)], cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        counted = json.loads(r.stdout)
        assert counted["total"] == sum(expected.values())
        assert [counted["ranges"][k] for k in counted["ranges"]] == [expected[k] for k in expected]
    finally:
        gateway.terminate()
