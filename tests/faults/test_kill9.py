"""kill -9 of the check-in and the distributor processes, and their connections cut, again
and again, while thousands of messages of mixed delays flow: every message is delivered,
none early.

The processes run the defaults: what is due within the hold (10 s, and at this rate 1,000
messages' worth: 5 s) goes from check-in straight to the distributor, which holds it; the
rest goes round the chain and meditation. Each fault of the distributor comes once it holds
some, and the flow goes on until the last fault."""

import random
import threading
import time
from typing import Dict, Iterator, List, Tuple

from ..support import GatewayProcess, broker_url, wait_until
from .load import Sink, count, publish
from .proxy import Proxy

MESSAGES, RATE, LONGEST_MS = 3000, 200.0, 8000  # at least this many, at this rate, due within this
FAULTS = [("check-in", "kill"), ("distributor", "kill"), ("check-in", "cut"), ("distributor", "cut")] * 3
HELD_AT_FAULT = 20  # a fault of the distributor once it holds at least this many


def flow(stop: threading.Event) -> Iterator[int]:
    """Delays from 0 to LONGEST_MS (a tenth immediate), at least MESSAGES, until `stop`."""
    rng = random.Random(4)
    n = 0
    while n < MESSAGES or not stop.is_set():
        yield 0 if rng.random() < 0.1 else rng.randint(1, LONGEST_MS)
        n += 1


def forwarded(check_in: GatewayProcess) -> Tuple[float, float]:
    """(to the distributor, in all) of what this check-in process sent on."""
    ways = {labels["outcome"]: value for labels, value in check_in.samples("delay_gateway_messages_total")
            if labels.get("queue", "").endswith(".check-in")}
    return ways.get("distributor", 0.0), sum(ways.values())


def test_kill9_and_cuts_of_each_role_repeatedly_lose_nothing(make_chain, fault_report):
    # Meditation is 1.5 s: what the shorter path does not take meditates before the chain.
    chain = make_chain(max_level=4, resolution_ms=100)
    url = broker_url()
    sink = Sink([url], chain)
    proxies = {role: Proxy(url) for role in ("check-in", "distributor")}
    procs = {role: GatewayProcess(chain, "--role", role, url=proxies[role].url).wait_ready() for role in proxies}
    sent: list = []
    stop = threading.Event()
    publisher = threading.Thread(target=lambda: sent.extend(publish([url], chain, flow(stop), rate=RATE)),
                                 daemon=True)
    publisher.start()
    rng = random.Random(9)
    held: List[int] = []
    shorter: Dict[str, float] = {"distributor": 0.0, "all": 0.0}

    def tally(check_in: GatewayProcess) -> None:
        to_distributor, everything = forwarded(check_in)
        shorter["distributor"] += to_distributor
        shorter["all"] += everything
    try:
        for role, fault in FAULTS:
            time.sleep(rng.uniform(0.3, 0.8))  # a fault at a random moment: the test's point, not a wait
            victim = procs[role]
            if role == "distributor":
                def holding(v: GatewayProcess = victim) -> float:
                    n = v.metric("delay_gateway_held_messages")
                    return n if n >= HELD_AT_FAULT else 0
                held.append(int(wait_until(holding, 30, 0.01, f"the distributor holding {HELD_AT_FAULT}")))
            if fault == "kill":
                if role == "check-in":
                    tally(victim)
                victim.kill()  # SIGKILL: no goodbye, unacked deliveries go back to their queue
                procs[role] = GatewayProcess(chain, "--role", role, url=proxies[role].url).wait_ready()
            else:
                before = len(victim.events("connected"))
                assert proxies[role].cut() >= 1  # every connection of the process, at once
                wait_until(lambda v=victim, n=before: len(v.events("connected")) > n and v.ready, 30, 0.05,
                           f"the {role} process connected again")
        tally(procs["check-in"])
        stop.set()
        publisher.join()
        delivered = sink.wait_for([s.message_id for s in sent], timeout=60)
    finally:
        stop.set()
        for p in procs.values():
            p.terminate()
        for proxy in proxies.values():
            proxy.close()
        sink.close()
        sink.delete()
    figures = fault_report(count("kill9+cuts", sent, sink, len(FAULTS), held_at_distributor_faults=held,
                                 shorter_path_pct=round(100 * shorter["distributor"] / max(1.0, shorter["all"]))))
    assert len(sent) >= MESSAGES
    assert delivered and figures.lost == 0, figures.lost_ids
    assert figures.early == 0, figures.early_ids
