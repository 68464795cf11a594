"""The catch-up after an outage (`--catch-up-rate`) against real brokers, at its worst
moment: the distributor is down while a thousand messages fall due (some cancelled
meanwhile); one started with a catch-up rate releases them at most that fast while messages
published during the catch-up go out on time; it is SIGKILLed, or its connection cut,
halfway through the backlog, and a new one (or the same one, reconnected) finishes it.
Messages a publisher sends already past their time (`x-deliver-at` a day ago) do not join
the backlog. Nothing is early or lost, no cancelled message arrives, and the backlog took at
least as long as the rate allows. (The order, most overdue first: tests/test_catch_up.py.)"""

import pika
import pytest

from .faults.proxy import Proxy
from .support import GatewayProcess, Receiver, broker_url, connect, now_ms, publish_sentinel, report_figures, \
    wait_until

OVERDUE, RATE, ON_TIME = 1000, 200.0, 20
CANCELLED = {f"late-{n}" for n in range(0, OVERDUE, 50)}
BURST = RATE / 10  # (catch_up.CatchUp: a tenth of a second's worth at once, again after a reconnect)


def publish(chain, prefix: str, count: int, delay_ms: int, sent_at: dict, past: bool = False) -> None:
    """`past`: x-deliver-at `delay_ms` before now instead (a publisher's time long gone)."""
    with connect() as c:
        ch = c.channel()
        ch.confirm_delivery()
        for n in range(count):
            sent_at[f"{prefix}-{n}"] = now_ms()
            headers = {"x-deliver-at": now_ms() - delay_ms} if past else {"x-delay": delay_ms}
            ch.basic_publish(chain.names.check_in, f"{prefix}.{n % 3}", b"x", pika.BasicProperties(
                message_id=f"{prefix}-{n}", delivery_mode=2, headers=headers), mandatory=True)


@pytest.mark.parametrize("fault", ["kill", "cut"])
def test_a_paced_catch_up_through_a_kill_or_a_cut(make_chain, fault, request):
    chain = make_chain(max_level=4, resolution_ms=500)
    receiver = Receiver(chain)
    check_in = GatewayProcess(chain, "--role", "check-in").wait_ready()
    gateways, proxy = [check_in], Proxy(broker_url())
    sent_at: dict = {}
    try:
        # the outage: no distributor while a thousand messages fall due, some cancelled
        publish(chain, "late", OVERDUE, 1000, sent_at)
        with connect() as c:
            ch = c.channel()
            ch.confirm_delivery()
            for message_id in sorted(CANCELLED):
                ch.basic_publish(chain.names.cancel, "", b"", pika.BasicProperties(message_id=message_id,
                                                                                   delivery_mode=2))
        last_due = max(sent_at.values()) + 1000
        wait_until(lambda: check_in.metric("delay_gateway_messages_total", queue=chain.names.check_in)
                   >= OVERDUE and now_ms() > last_due + 1500, 60, 0.05, "every message overdue, unread")
        rate = ["--role", "distributor", "--catch-up-rate", str(RATE)]
        victim = GatewayProcess(chain, *rate, url=proxy.url).wait_ready()
        gateways.append(victim)
        start = now_ms()

        def overdue() -> float:
            return victim.metric("delay_gateway_overdue_messages", queue=chain.names.distributor)
        wait_until(lambda: overdue() > 0, 30, 0.01, "the distributor pacing what is overdue")
        publish(chain, "on-time", ON_TIME, 2000, sent_at)  # due during the catch-up
        # hostile: due a day ago by the publisher's word, it is no backlog and does not wait for the pace
        publish(chain, "past", ON_TIME, 86_400_000, sent_at, past=True)
        # the worst moment: half the backlog released, the rest held unacknowledged in memory
        wait_until(lambda: len(receiver.take()) >= OVERDUE // 2, 60, 0.01, "half the backlog at pick-up")
        waiting = overdue()
        if fault == "kill":
            victim.kill()
            gateways.append(GatewayProcess(chain, *rate).wait_ready())
            back_ms = now_ms()  # (what fell due before, the replacement finds overdue: backlog)
        else:
            assert proxy.cut() >= 1  # (the victim reconnects through the proxy by itself)
            wait_until(lambda: victim.metric("delay_gateway_connections_total") >= 2 and victim.ready, 30, 0.01,
                       "the victim consuming again")
            back_ms = now_ms()
        # A sentinel is on time, not overdue: it would overtake the backlog. Once every
        # message expected arrived and nothing waits for the pace, one catches any straggler.
        wanted = set(sent_at) - CANCELLED
        wait_until(lambda: wanted <= {m.properties.message_id for m in receiver.take()}, 120, 0.01,
                   "every message not cancelled at pick-up")
        wait_until(lambda: gateways[-1].metric("delay_gateway_overdue_messages") == 0, 30, 0.01, "the backlog done")
        publish_sentinel(chain, 500)
        got = receiver.until_sentinel(60)
        ids = {m.properties.message_id for m in got}
        assert not ids & CANCELLED, sorted(ids & CANCELLED)
        assert ids == set(sent_at) - CANCELLED, sorted(set(sent_at) - CANCELLED - ids)
        first = {}
        for m in got:
            first.setdefault(m.properties.message_id, m.at_ms)
        delay = {"late": 1000, "on-time": 2000, "past": -86_400_000}
        early = [i for i, at in first.items() if at < sent_at[i] + delay[i.rsplit("-", 1)[0]]]
        assert not early, early
        late = sorted(at for i, at in first.items() if i.startswith("late"))
        # at most RATE a second (and a tenth of a second's worth at each connection's start):
        # a busy machine only makes the catch-up longer
        allowed = (len(late) - 2 * BURST) / RATE * 1000
        assert late[-1] - start >= allowed, (late[-1] - start, allowed)
        # what fell due during the catch-up did not wait behind the backlog: each due a second
        # or more before its end came before its end (one due later may come after it), but
        # what fell due while no distributor held it (the kill, the cut): found overdue, backlog
        behind = [i for i, at in first.items() if i.startswith(("on-time", "past"))
                  and back_ms < sent_at[i] + delay[i.rsplit("-", 1)[0]] and
                  sent_at[i] + delay[i.rsplit("-", 1)[0]] + 1000 < late[-1] < at]
        assert not behind, (behind, late[-1] - start)
        report_figures("catch-up after an outage", f"{fault} broker={request.node.callspec.params['broker']} "
                                                   f"overdue={len(late)} took_ms={late[-1] - start} "
                                                   f"waiting_at_fault={waiting:.0f} duplicates={len(got) - len(ids)}")
    finally:
        for g in gateways:
            if g.proc.poll() is None:
                g.terminate()
        receiver.close()
        proxy.close()
