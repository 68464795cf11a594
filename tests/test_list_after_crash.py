"""The list of what waits after a crash, on every suite broker: two gateways share the queues,
and while they deliver (300 messages at 300 msg/s, delays of 1-5 s) one is SIGKILLed, or its
connections are cut, the moment it has delivered a few dozen (done keys waiting for company,
carriers half released); another takes its place. Once everything has arrived the list
empties (a delivered message leaves it within about 2 s: the done keys are confirmed before
the delivery is acknowledged), and `pending count` says whether it is exact, and why not.
On a quorum chain, a classic chain (two exits a gateway), a live change from quorum to
classic, and with the new gateway writing no entries (--no-pending-index: it still notes
what leaves)."""

import json
import subprocess
import sys
import threading
import time
from typing import List

import pika
import pytest

from .faults.proxy import Proxy
from .support import GatewayProcess, ROOT, Receiver, broker_url, chain_args, connect, now_ms, report_figures, \
    wait_until

CASES = {  # the fault; the chain's queue type, the one of the gateway that takes its place, its flags
    "quorum-kill": ("kill", "quorum", "quorum", ()),
    "quorum-cut": ("cut", "quorum", "quorum", ()),
    "classic-kill": ("kill", "classic", "classic", ()),
    "change-kill": ("kill", "quorum", "classic", ()),
    "no-index-kill": ("kill", "quorum", "quorum", ("--no-pending-index",)),
}
MESSAGES, RATE = 300, 300.0


def cli(chain, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gateway", *args, *chain_args(chain), "--url", broker_url()],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)


def listed(chain) -> List[dict]:
    r = cli(chain, "pending", "list", "--json", "--limit", "0")
    assert r.returncode == 0, r.stderr
    return [json.loads(line) for line in r.stdout.splitlines()]


@pytest.mark.parametrize("case", list(CASES))
def test_a_delivered_message_leaves_the_list_after_a_kill(make_chain, case, request):
    fault, chain_type, then_type, flags = CASES[case]
    chain = make_chain(max_level=4, resolution_ms=500, queue_type=chain_type)  # holds 7.5 s: no laps
    then = chain if then_type == chain_type else make_chain(prefix=chain.prefix, max_level=4, resolution_ms=500,
                                                             queue_type=then_type)
    proxy = Proxy(broker_url())
    receiver = Receiver(chain)
    victim = GatewayProcess(chain, url=proxy.url).wait_ready()
    gateways = [victim, GatewayProcess(chain).wait_ready()]
    sent = threading.Event()
    t0 = now_ms()

    def publisher() -> None:
        with connect() as c:
            ch = c.channel()
            ch.confirm_delivery()
            for n in range(MESSAGES):
                ch.basic_publish(chain.names.check_in, f"flow.{n % 5}", b"x", pika.BasicProperties(
                    message_id=f"m-{n}", delivery_mode=2, headers={"x-delay": 1000 + (n * 37) % 4000}),
                    mandatory=True)
                ahead = t0 + (n + 1) * 1000 / RATE - now_ms()
                if ahead > 0:
                    time.sleep(ahead / 1000)  # (pacing the load, as a publisher does: not a wait)
        sent.set()

    thread = threading.Thread(target=publisher, daemon=True)
    thread.start()
    try:
        # the worst moment: the victim delivers, its done keys wait for company, carriers are
        # half released (acknowledged only once all of theirs left and the keys are confirmed)
        wait_until(lambda: victim.metric("delay_gateway_messages_total", outcome="delivered") >= 30, 60, 0.005,
                   "the victim delivering")
        if fault == "kill":
            victim.kill()
        else:
            assert proxy.cut() >= 1
        wait_until(sent.is_set, 60, 0.1, "the flow published")
        gateways.append(GatewayProcess(then, *flags).wait_ready())
        # (taken every 2 ms: the last arrival's time is a figure below)
        wait_until(lambda: len({m.properties.message_id for m in receiver.take()}) >= MESSAGES, 60, 0.002,
                   f"all {MESSAGES} delivered", sleep=receiver.connection.sleep)
        last = max(m.at_ms for m in receiver.messages)
        looked: List[int] = []

        def empty() -> bool:
            looked.append(now_ms())  # (when this listing started: it reads the done keys first)
            return listed(chain) == []
        wait_until(empty, 30, 0.2, "the list empty once everything arrived")
        emptied_s = (looked[-1] - last) / 1000
        count = json.loads(cli(chain, "pending", "count", "--json").stdout)
        assert count["total"] == 0
        if case.startswith("no-index"):
            assert not count["exact"] and any("--no-pending-index" in n for n in count["notes"]), count
        else:
            assert count["exact"], count  # every consumer accounted for: a classic chain's two exits too
        duplicates = len(receiver.messages) - MESSAGES
        report_figures("list after a kill", f"{case} broker={request.node.callspec.params['broker']} "
                                            f"sent={MESSAGES} duplicates={duplicates} "
                                            f"empty_in_a_listing_started_s_after_the_last_arrival={emptied_s:.1f} "
                                            f"exact={count['exact']}")
    finally:
        for g in gateways:
            if g.proc.poll() is None:
                g.terminate()
        receiver.close()
        proxy.close()
