"""`delay-gateway explain DELAY_MS`: the route a delay takes through the chain (pure).

The route is the one check-in takes: each step asks check-in's own code (`handlers.CheckIn`'s
`enqueue`) where a message with that long to go goes, so explain plans as check-in does,
the chain with the lead *and* the carrier wait left to the distributor, the shorter path
with --hold-within-ms, and the rate rule of --hold-messages at the rate given (`--rate`).
After each meditation lap the returning consumer plans it again the same way
(`handlers.Returning` is a CheckIn)."""

import argparse
from typing import List, Optional, Tuple

from topology import ChainSettings, build
from topology.routing import trace

from gateway.times import duration
from gateway.core import limits
from gateway.core.actions import Enqueue
from gateway.core.carrier import Entry
from gateway.core.handlers import CheckIn
from gateway.core.routes import Way
from gateway.core.shorter_path import ShorterPath
from gateway.core.wire import Properties
from gateway.settings import Settings, UsageError, argument, integer

NOW_MS = 1_800_000_000_000  # any time: a route depends only on the time to go and the rate
_PROPERTIES = Properties.build()  # (a route does not depend on the message's own)


class Planner:
    """Where check-in sends a message with this long to go (`handlers.CheckIn.enqueue`), its
    consumer reading `rate` messages a second (0: a trickle)."""

    def __init__(self, chain: ChainSettings, lead_ms: int, wait_ms: int = 0, hold_within_ms: int = 0,
                 hold_messages: int = 1000, rate: int = 0) -> None:
        self.chain, self.lead_ms, self.wait_ms = chain, lead_ms, wait_ms
        self.hold_within_ms, self.hold_messages, self.rate = hold_within_ms, hold_messages, rate
        # how long to go the shorter path takes at that rate (None: off)
        self.reach_ms = ShorterPath(hold_within_ms, hold_messages).reach_ms(rate)

    @classmethod
    def of(cls, settings: Settings, rate: int = 0) -> "Planner":
        return cls(settings.chain, settings.lead_ms, settings.carrier_wait_ms, settings.hold_within_ms,
                   settings.hold_messages, rate)

    def __call__(self, remaining_ms: int) -> Enqueue:
        # a new CheckIn each time: its shorter path counts every message it sees
        check_in = CheckIn(self.chain, self.lead_ms, self.wait_ms, hold_within_ms=self.hold_within_ms,
                           hold_messages=self.hold_messages)
        check_in.shorter.at_rate(self.rate, NOW_MS)
        return check_in.enqueue(Entry(b"", _PROPERTIES, b"", NOW_MS + remaining_ms), NOW_MS)


def laps(delay_ms: int, planner: Planner) -> int:
    """How many times a message of this delay passes the meditation queue: the fewest laps
    after which check-in (returning) sends the rest elsewhere (a binary search: a long delay
    on a short chain laps billions of times; what meditates is all that has more than some
    time to go)."""
    lap = planner.chain.meditation_ms

    def meditates(remaining_ms: int) -> bool:
        return planner(remaining_ms).way is Way.MEDITATION

    if not meditates(delay_ms):
        return 0
    low, high = 0, max(1, delay_ms // lap + 1)  # (delay - high * lap) does not meditate
    while high - low > 1:
        mid = (low + high) // 2
        if meditates(delay_ms - mid * lap):
            low = mid
        else:
            high = mid
    return high


def route(delay_ms: int, planner: Planner) -> Tuple[int, Enqueue]:
    """The meditation laps of a delay, and where check-in (or returning, after them) then
    sends it: into a level of the chain, or straight to the distributor."""
    n = laps(delay_ms, planner)
    return n, planner(delay_ms - n * planner.chain.meditation_ms)


def lines(delay_ms: int, planner: Planner) -> List[str]:
    chain, names = planner.chain, planner.chain.names
    reach = planner.reach_ms
    at_rate = f" (at {planner.rate} msg/s: {reach} ms)" if planner.rate and reach is not None else ""
    out = [f"delay {delay_ms} ms; chain of {chain.max_level} levels x {chain.resolution_ms} ms "
           f"(up to {chain.meditation_ms} ms), lead {planner.lead_ms} ms, carrier wait {planner.wait_ms} ms, "
           f"hold within {planner.hold_within_ms} ms{at_rate}"]
    if delay_ms <= 0:
        out.append(f"  due now (a delay of 0 or less): check-in sends it to {names.distributor}, which publishes "
                   f"it to {names.pick_up} at once")
        return out
    n, step = route(delay_ms, planner)
    total = n * chain.meditation_ms
    if n == 1:
        out.append(f"  {chain.meditation:<44} wait {chain.meditation_ms} ms, then check in again")
    elif n > 1:
        out.append(f"  {chain.meditation:<44} wait {chain.meditation_ms} ms, {n} times ({duration(total)}), "
                   "checking in again after each lap")
    remaining = delay_ms - total
    if step.way is Way.DISTRIBUTOR:  # (through the distributor exchange: its queue, whatever the chain's type)
        why = _straight(remaining, reach, planner)
        out.append(f"  {names.distributor:<44} hold {remaining} ms ({why}: straight from "
                   f"{'returning' if n else 'check-in'}), then publish to {names.pick_up}")
        return out
    key = step.routing_key.decode()
    out.append(f"  publish to {step.exchange} with key {key!r}")
    exit_queue = names.exit_distributor(chain.queue_type)
    for hop in trace(build(chain), step.exchange, key, exit_queue):
        out.append(f"  {hop.queue:<44} wait {hop.wait_ms} ms")
        total += hop.wait_ms
    less = f", less the carrier's wait (up to {planner.wait_ms} ms)" if planner.wait_ms else ""
    out.append(f"  {exit_queue:<44} hold {delay_ms - total} ms{less}, then publish to {names.pick_up}")
    return out


def _straight(remaining_ms: int, reach_ms: Optional[int], planner: Planner) -> str:
    """Why a message goes straight to the distributor."""
    if reach_ms is not None and remaining_ms <= reach_ms:
        return f"due within {reach_ms} ms" + (f" at {planner.rate} msg/s" if planner.rate else "")
    return "within the lead, the carrier wait and one unit"


# -- the verb ----------------------------------------------------------------------------------
def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("delay_ms", type=int, metavar="DELAY_MS", help="the delay to explain, in ms")
    p.add_argument("--rate", type=argument(integer(0)), default=0, metavar="MSG_PER_S",
                   help="the route at this rate: messages a second each check-in consumer reads (returning "
                        "too, after a meditation lap). Above 100 a second (by default) the shorter path takes "
                        "only what is due within --hold-messages / rate seconds, less than --hold-within-ms "
                        "(default 0: a trickle)")


def main(settings: Settings, delay_ms: int, rate: int) -> int:
    try:
        checked = limits.delay_ms(delay_ms, "DELAY_MS")
    except limits.Refused as exc:
        raise UsageError(str(exc)) from None
    print("\n".join(lines(checked, Planner.of(settings, rate))))
    return 0
