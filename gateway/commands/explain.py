"""`delay-gateway explain DELAY_MS`: the route a delay takes through the chain (pure)."""

import argparse
from typing import List

from topology import ChainSettings, Enter, Meditate, build, plan
from topology.routing import trace

from gateway.times import duration
from gateway.core import limits
from gateway.settings import Settings, UsageError


def laps(delay_ms: int, chain: ChainSettings, lead_ms: int, hold_within_ms: int = 0) -> int:
    """How many times a message of this delay passes the meditation queue: the fewest laps
    after which the rest fits the level chain, or the distributor's hold (a binary search:
    a long delay on a short chain laps billions of times)."""
    lap = chain.meditation_ms

    def meditates(remaining_ms: int) -> bool:
        return remaining_ms > hold_within_ms and isinstance(plan(remaining_ms, chain, lead_ms), Meditate)

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


def lines(delay_ms: int, chain: ChainSettings, lead_ms: int, hold_within_ms: int = 0) -> List[str]:
    names = chain.names
    out = [f"delay {delay_ms} ms; chain of {chain.max_level} levels x {chain.resolution_ms} ms "
           f"(up to {chain.meditation_ms} ms), lead {lead_ms} ms, hold within {hold_within_ms} ms"]
    exit_queue = names.exit_distributor(chain.queue_type)
    if delay_ms <= 0:
        out.append(f"  due now (a delay of 0 or less): check-in sends it to {exit_queue}, which publishes it "
                   f"to {names.pick_up} at once")
        return out
    n = laps(delay_ms, chain, lead_ms, hold_within_ms)
    total = n * chain.meditation_ms
    if n == 1:
        out.append(f"  {chain.meditation:<44} wait {chain.meditation_ms} ms, then check in again")
    elif n > 1:
        out.append(f"  {chain.meditation:<44} wait {chain.meditation_ms} ms, {n} times ({duration(total)}), "
                   "checking in again after each lap")
    if delay_ms - total <= hold_within_ms:
        out.append(f"  {exit_queue:<44} hold {delay_ms - total} ms (due within {hold_within_ms} ms: straight "
                   f"from {'returning' if n else 'check-in'}), then publish to {names.pick_up}")
        return out
    route = plan(delay_ms - total, chain, lead_ms)
    if isinstance(route, Enter):
        out.append(f"  publish to {names.level(route.level)} with key {route.key!r}")
        for hop in trace(build(chain), names.level(route.level), route.key, exit_queue):
            out.append(f"  {hop.queue:<44} wait {hop.wait_ms} ms")
            total += hop.wait_ms
    out.append(f"  {exit_queue:<44} hold {delay_ms - total} ms, then publish to {names.pick_up}")
    return out


# -- the verb ----------------------------------------------------------------------------------
def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("delay_ms", type=int, metavar="DELAY_MS", help="the delay to explain, in ms")


def main(settings: Settings, delay_ms: int) -> int:
    try:
        checked = limits.delay_ms(delay_ms, "DELAY_MS")
    except limits.Refused as exc:
        raise UsageError(str(exc)) from None
    print("\n".join(lines(checked, settings.chain, settings.lead_ms, settings.hold_within_ms)))
    return 0
