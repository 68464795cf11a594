"""`delay-gateway explain` shows the route check-in takes (pure): for random delays, chains,
leads, carrier waits, shorter-path settings and rates, its route is what the consumers
themselves do with a message of that delay. They are driven as the `run` process drives
them: check-in (`handlers.CheckIn`) reads a publisher's message with `x-delay`, and after
each meditation lap the returning consumer (`handlers.Returning`) reads it back, each
consumer having read `rate` messages in the second before (real deliveries, not explain's
shortcut)."""

import re
from typing import List, Tuple

from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.cli import main
from gateway.commands import explain
from gateway.core import carrier, handlers
from gateway.core.actions import Enqueue
from gateway.core.carrier import Entry
from gateway.core.inputs import Delivery
from gateway.core.routes import Way
from gateway.core.wire import Properties, Table, long
from topology import ChainSettings

from .support import examples

NOW = 1_700_000_000_000  # (a whole second, and not explain's own time)
HOP = re.compile(r"^  \S+ +wait (\d+) ms$")  # a queue of the chain, as explain shows it


def published(chain: ChainSettings, delay_ms: int) -> Delivery:
    return Delivery(chain.names.check_in, b"orders.1", Properties.build(headers=Table([long("x-delay", delay_ms)])),
                    b"body")


def busy(consumer: handlers.CheckIn, chain: ChainSettings, rate: int, now: int) -> None:
    """`rate` messages read in the second before `now`: publishers' ones at check-in, a
    carrier of them at returning."""
    if not rate:
        return
    if isinstance(consumer, handlers.Returning):
        back = [Entry(b"k", Properties.build(), b"x", now + 5_000, now * 1000) for _ in range(rate)]
        consumer(Delivery(chain.names.returning, b"", carrier.properties(back), carrier.pack(back)), now - 1000)
        return
    for i in range(rate):
        consumer(published(chain, 5_000), now - 1000 + i * 1000 // rate)


def what_the_gateway_does(chain: ChainSettings, lead_ms: int, wait_ms: int, within_ms: int, messages: int,
                          rate: int, delay_ms: int) -> Tuple[int, Enqueue]:
    """The meditation laps a message of this delay takes, and where it then goes."""
    def consumer(kind):
        return kind(chain, lead_ms, wait_ms, hold_within_ms=within_ms, hold_messages=messages)

    now = NOW
    check_in = consumer(handlers.CheckIn)
    busy(check_in, chain, rate, now)
    [action] = check_in(published(chain, delay_ms), now)
    laps = 0
    while isinstance(action, Enqueue) and action.way is Way.MEDITATION:
        laps += 1
        now += chain.meditation_ms  # the meditation queue's TTL
        returning = consumer(handlers.Returning)
        busy(returning, chain, rate, now)
        e = action.entry
        [action] = returning(Delivery(chain.names.returning, b"", handlers.next_hop(e), e.body), now)
    assert isinstance(action, Enqueue)
    return laps, action


@st.composite
def cases(draw):
    chain = ChainSettings(prefix="x", max_level=draw(st.integers(1, 20)), resolution_ms=draw(st.integers(1, 2000)),
                          queue_type=draw(st.sampled_from(["quorum", "classic"])),
                          zero_bits=draw(st.sampled_from(["queue", "exchange"])))
    lead_ms = draw(st.integers(0, 500))
    wait_ms = draw(st.integers(0, 1000))
    within_ms = draw(st.sampled_from([0, 10_000]) | st.integers(0, 60_000))
    messages = draw(st.sampled_from([1000]) | st.integers(1, 5000))
    rate = draw(st.sampled_from([0, 1, 100, 101, 500, 1000]) | st.integers(0, 2000))
    # up to a few laps (each one simulated), the rest around where the routes change
    lap = chain.meditation_ms
    edge = lead_ms + wait_ms + chain.resolution_ms
    delay_ms = draw(st.integers(-5, 5) | st.integers(0, 4 * lap + within_ms + 2 * edge)
                    | st.sampled_from([within_ms, within_ms + 1, edge, edge + 1, lap + edge, lap + edge + 1]))
    # (at most about 8 laps, each simulated: a lap is as short as 1 ms)
    return chain, lead_ms, wait_ms, within_ms, messages, rate, min(delay_ms, 8 * lap + edge + chain.resolution_ms)


@settings(max_examples=examples(300))
@given(cases())
def test_explains_the_route_check_in_takes(case):
    chain, lead_ms, wait_ms, within_ms, messages, rate, delay_ms = case
    laps, sent = what_the_gateway_does(*case)
    planner = explain.Planner(chain, lead_ms, wait_ms, within_ms, messages, rate)
    n, step = explain.route(delay_ms, planner)
    assert (n, step.exchange, step.routing_key, step.way) == (laps, sent.exchange, sent.routing_key, sent.way)
    if delay_ms <= 0:
        return
    said = explain.lines(delay_ms, planner)
    if sent.way is Way.CHAIN:
        assert f"  publish to {sent.exchange} with key {sent.routing_key.decode()!r}" in said
    else:
        assert said[-1].split()[0] == chain.names.distributor  # the distributor exchange's queue
    # the route adds up to the delay: the laps, the chain's waits and the distributor's hold
    waits = sum(int(m.group(1)) for m in map(HOP.match, said) if m)
    held = int(said[-1].split(" hold ")[1].split(" ms")[0])
    assert laps * chain.meditation_ms + waits + held == delay_ms


def shown(argv: List[str], capsys) -> List[str]:
    assert main(["explain", *argv], environ={}) == 0
    return capsys.readouterr().out.splitlines()


def test_the_carrier_wait_is_planned_in_as_check_in_plans_it(capsys):
    """12,100 ms: 11 units to the distributor with the lead and the carrier wait (the lead
    alone would make it 12, and the carrier's wait could make it late)."""
    assert "key '1.1.0.1'" in shown(["12100"], capsys)[1]
    assert "key '0.0.1.1'" in shown(["12100", "--carrier-wait-ms", "0"], capsys)[1]


def test_at_a_higher_rate_less_takes_the_shorter_path(capsys):
    assert "straight from check-in" in shown(["5000"], capsys)[-1]
    assert "straight from check-in" in shown(["5000", "--rate", "100"], capsys)[-1]  # 1,000 / 100: 10 s
    busy_lines = shown(["5000", "--rate", "500"], capsys)  # 1,000 / 500: 2 s
    assert busy_lines[0].endswith("hold within 10000 ms (at 500 msg/s: 2000 ms)")
    assert "key '0.0.1'" in busy_lines[1]
    assert "due within 2000 ms at 500 msg/s" in shown(["1500", "--rate", "500"], capsys)[-1]
    off = shown(["5000", "--hold-within-ms", "0", "--rate", "500"], capsys)
    assert off[0].endswith("hold within 0 ms") and "key '0.0.1'" in off[1]


def test_a_negative_rate_is_refused(capsys):
    assert main(["explain", "5000", "--rate", "-1"], environ={}) == 2
    assert "--rate: -1 is out of range (from 0 up)" in capsys.readouterr().err
