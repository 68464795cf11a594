"""kill -9 of the check-in and distributor processes, again and again, with thousands of
messages of mixed delays in flight: every message is delivered, none early."""

import random
import threading
import time

from ..support import GatewayProcess, broker_url
from .load import Sink, count, mixed_delays, publish

MESSAGES = 3000
KILLS = 12


def test_kill9_repeatedly_loses_nothing(make_chain, fault_report):
    # Meditation is 1.5 s: the longest delays meditate once or twice before the chain.
    chain = make_chain(max_level=4, resolution_ms=100)
    url = broker_url()
    sink = Sink([url], chain)
    roles = {"check-in": [], "distributor": []}
    procs = {role: GatewayProcess(chain, "--role", role).wait_ready()
             for role in roles}
    sent = []
    publisher = threading.Thread(target=lambda: sent.extend(
        publish([url], chain, mixed_delays(MESSAGES, 4000))))
    publisher.start()
    rng = random.Random(9)
    kills = 0
    try:
        while kills < KILLS:
            time.sleep(rng.uniform(0.3, 0.8))  # a kill at a random moment: the test's point, not a wait
            role = ("check-in", "distributor")[kills % 2]
            procs[role].kill()  # SIGKILL: no goodbye, unacked deliveries go back to their queue
            kills += 1
            procs[role] = GatewayProcess(chain, "--role", role).wait_ready()
        publisher.join()
        delivered = sink.wait_for([s.message_id for s in sent], timeout=60)
    finally:
        for p in procs.values():
            p.terminate()
        sink.close()
        sink.delete()
    figures = fault_report(count("kill9", sent, sink, kills))
    assert len(sent) == MESSAGES
    assert delivered and figures.lost == 0, figures.lost_ids
    assert figures.early == 0, figures.early_ids
