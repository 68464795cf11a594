"""A lone message's shorter path against real brokers, at its worst moments: messages due
within `--hold-within-ms` (the default, 10 s) go from check-in straight to the distributor,
cancels arrive for some of them, and the gateway is SIGKILLed, or its connections are cut,
while its distributor holds dozens and has read cancels for them; a new gateway takes over
(or the same one reconnects). Nothing is early or lost, no cancelled message arrives, and
the list is empty and exact once everything arrived."""

import json
import subprocess
import sys
import threading
import time
from typing import Dict

import pika
import pytest

from .faults.proxy import Proxy
from .support import GatewayProcess, ROOT, Receiver, broker_url, chain_args, connect, now_ms, publish_sentinel, \
    report_figures, wait_until

MESSAGES, RATE = 200, 100.0
CANCEL_EVERY, CANCEL_AFTER = 7, 20  # message n with n % 7 == 3 is cancelled after message n + 20


def delay_of(n: int) -> int:
    return 2_000 + (n * 37) % 4_000


@pytest.mark.parametrize("fault", ["kill", "cut"])
def test_the_shorter_path_through_a_kill_or_a_cut(make_chain, fault, request):
    chain = make_chain(max_level=4, resolution_ms=500)
    proxy = Proxy(broker_url())
    receiver = Receiver(chain)
    victim = GatewayProcess(chain, url=proxy.url).wait_ready()
    gateways = [victim]
    sent_at: Dict[str, int] = {}
    cancelled = {f"m-{n}" for n in range(MESSAGES) if n % CANCEL_EVERY == 3}
    published = threading.Event()

    def publisher() -> None:
        t0 = now_ms()
        with connect() as c:
            ch = c.channel()
            ch.confirm_delivery()
            for n in range(MESSAGES + CANCEL_AFTER):
                if n < MESSAGES:
                    sent_at[f"m-{n}"] = now_ms()
                    ch.basic_publish(chain.names.check_in, f"short.{n % 3}", b"x", pika.BasicProperties(
                        message_id=f"m-{n}", delivery_mode=2, headers={"x-delay": delay_of(n)}), mandatory=True)
                if n >= CANCEL_AFTER and (n - CANCEL_AFTER) % CANCEL_EVERY == 3:
                    ch.basic_publish(chain.names.cancel, "", b"", pika.BasicProperties(
                        message_id=f"m-{n - CANCEL_AFTER}", delivery_mode=2))
                ahead = t0 + (n + 1) * 1000 / RATE - now_ms()
                if ahead > 0:
                    time.sleep(ahead / 1000)  # (pacing the load, as a publisher does: not a wait)
        published.set()

    thread = threading.Thread(target=publisher, daemon=True)
    thread.start()
    try:
        # the worst moment: dozens held by the distributor, none of them through the chain,
        # cancels read for some of them, done keys and releases under way
        def holding() -> float:
            return victim.metric("delay_gateway_held_messages", queue=chain.names.distributor)
        wait_until(lambda: holding() >= 40 and len(sent_at) >= MESSAGES // 2, 60, 0.005,
                   "the distributor holding dozens")
        held = holding()
        assert victim.metric("delay_gateway_messages_total", queue=chain.names.check_in, outcome="chain") == 0
        if fault == "kill":
            victim.kill()
            gateways.append(GatewayProcess(chain).wait_ready())
        else:
            assert proxy.cut() >= 1  # (the victim reconnects through the proxy by itself)
        wait_until(published.is_set, 60, 0.1, "the flow published")
        publish_sentinel(chain, max(delay_of(n) for n in range(MESSAGES)))
        got = receiver.until_sentinel(90)
        ids = {m.properties.message_id for m in got}
        assert not ids & cancelled, sorted(ids & cancelled)
        assert ids == set(sent_at) - cancelled, sorted(set(sent_at) - cancelled - ids)
        early = [m.properties.message_id for m in got
                 if m.at_ms < sent_at[m.properties.message_id] + delay_of(int(m.properties.message_id[2:]))]
        assert not early, early

        def count() -> dict:
            r = subprocess.run([sys.executable, "-m", "gateway", "pending", "count", "--json", *chain_args(chain),
                                "--url", broker_url()], cwd=ROOT, capture_output=True, text=True, timeout=120)
            return json.loads(r.stdout)
        # (exact once the killed gateway's last beat, which may say its check-in held what it
        # had read, is older than a beat's reach, 20 s)
        counted = wait_until(lambda: (c := count())["exact"] and c, 40, 0.5, "an exact count")
        assert counted["total"] == 0, counted
        report_figures("shorter path after a fault", f"{fault} broker={request.node.callspec.params['broker']} "
                                                      f"held_at_fault={held:.0f} cancelled={len(cancelled)} "
                                                      f"duplicates={len(got) - len(ids)}")
    finally:
        for g in gateways:
            if g.proc.poll() is None:
                g.terminate()
        receiver.close()
        proxy.close()
