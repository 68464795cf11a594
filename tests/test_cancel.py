"""Cancelling and rescheduling by message id, end to end through the real gateway and broker
(every broker version the suite runs): a cancel wins wherever the message is when it comes,
and nothing else is touched.

A small chain (3 levels x 100 ms: 700 ms at most; longer delays lap meditation) makes every
place a message can be reachable within a few seconds.
"""

import subprocess
import sys
import time
from typing import Dict, Iterable, List, Optional

import pika
import pytest

from gateway.broker import cancelling
from topology import ChainSettings

from .support import ROOT, GatewayProcess, Receiver, connect, now_ms

SMALL = dict(max_level=3, resolution_ms=100)


@pytest.fixture
def chain(make_chain):
    made: List[ChainSettings] = []

    def make(**settings) -> ChainSettings:
        c = make_chain(**{**SMALL, **settings})
        with connect() as connection:
            cancelling.declare(connection.channel(), c.names, cancelling.retention_ms(c))
        made.append(c)
        return c

    yield make
    for c in made:
        try:
            with connect() as connection:
                cancelling.delete(connection.channel(), c.names)
        except pika.exceptions.AMQPError:
            pass


def publish(chain: ChainSettings, messages: Iterable[tuple]) -> None:
    """(message id, delay ms, body) each, confirmed."""
    with connect() as c:
        ch = c.channel()
        ch.confirm_delivery()
        for mid, delay, body in messages:
            ch.basic_publish(chain.names.check_in, "k", body, pika.BasicProperties(
                message_id=mid, headers={"x-delay": delay}, delivery_mode=2), mandatory=True)


def cancel(chain: ChainSettings, ids: Iterable[str]) -> None:
    """As any AMQP client does it: an empty message to <prefix>.cancel, the id as message_id."""
    with connect() as c:
        ch = c.channel()
        ch.confirm_delivery()
        for mid in ids:
            ch.basic_publish(chain.names.cancel, "", b"", pika.BasicProperties(message_id=mid), mandatory=True)


def collect_until(receiver: Receiver, seconds: float) -> Dict[str, List[bytes]]:
    """Everything that arrives within `seconds`, by message id."""
    receiver.collect(10**9, timeout=seconds)
    out: Dict[str, List[bytes]] = {}
    for m in receiver.messages:
        out.setdefault(m.properties.message_id, []).append(m.body)
    return out


def dropped(gateway: GatewayProcess) -> Dict[str, float]:
    return {labels["where"]: value for labels, value in gateway.samples("delay_gateway_cancelled_total")}


def cli(chain: ChainSettings, *args: str, stdin: Optional[str] = None) -> subprocess.CompletedProcess:
    from .support import broker_url
    return subprocess.run([sys.executable, "-m", "gateway", "cancel", "--prefix", chain.prefix,
                           "--max-level", str(chain.max_level), "--resolution-ms", str(chain.resolution_ms),
                           "--url", broker_url(), *args], cwd=ROOT, capture_output=True, text=True, input=stdin,
                          timeout=60)


def test_a_cancel_wins_in_meditation_the_chain_a_carrier_and_the_distributors_hold(chain, run_gateway):
    c = chain()
    gateway = run_gateway(c, "--lead-ms", "1500")
    receiver = Receiver(c)
    # With a lead of 1500 ms: 1700 ms goes to the distributor at once and is held; 2600 ms
    # waits in the chain (in a carrier with its twin); 5000 ms laps meditation first.
    delays = {"held": 1700, "chain": 2600, "meditating": 5000}
    publish(c, [(f"{kind}-{n}", delay, kind.encode()) for kind, delay in delays.items() for n in range(3)])
    time.sleep(0.5)
    cancel(c, [f"{kind}-0" for kind in delays] + [f"{kind}-1" for kind in delays])
    got = collect_until(receiver, 7)
    assert sorted(got) == sorted(f"{kind}-2" for kind in delays), got
    assert all(len(v) == 1 for v in got.values())
    where = dropped(gateway)
    assert where.get("release", 0) + where.get("distributor", 0) >= 2  # held: dropped at release
    assert where.get("returning", 0) >= 2  # back from meditation
    assert sum(where.values()) == 6
    assert gateway.metric("delay_gateway_cancels_total") == 6
    assert not gateway.errors()
