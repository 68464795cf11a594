"""The gateway's three consumers, as functions from a delivery to a Forward.

check-in:    read the due time, pick meditation, a level of the chain, or the distributor.
distributor: hold until due, restore the user's routing key and properties, publish to
             pick-up.
parking:     say why a message could not go on, and park it.
"""

from typing import Callable, Optional

from topology import ChainSettings, Enter, Meditate, plan
from topology.names import Names

from . import envelope
from .actions import Delivery, Forward

Clock = Callable[[], int]


def park(names: Names, d: Delivery, reason: str, due_ms: Optional[int] = None) -> Forward:
    return Forward(names.parked, envelope.user_routing_key(d.properties.headers, d.routing_key),
                   envelope.internal(d.properties, d.routing_key, due_ms=due_ms, error=reason),
                   d.body, "parked", reason=reason)


class CheckIn:
    def __init__(self, chain: ChainSettings, lead_ms: int, clock: Clock) -> None:
        self.chain, self.lead_ms, self.clock = chain, lead_ms, clock

    def __call__(self, d: Delivery) -> Forward:
        names = self.chain.names
        now = self.clock()
        try:
            due = envelope.due_at(d.properties.headers, now)
        except envelope.Unreadable as exc:
            return park(names, d, str(exc))
        properties = envelope.internal(d.properties, d.routing_key, due_ms=due)
        route = plan(due - now, self.chain, self.lead_ms)
        if isinstance(route, Meditate):
            return Forward(names.meditation, "", properties, d.body, "meditation")
        if isinstance(route, Enter):
            return Forward(names.level(route.level), route.key, properties, d.body, "chain")
        return Forward(names.distributor, "", properties, d.body, "distributor")


class Distributor:
    def __init__(self, chain: ChainSettings, lead_ms: int, clock: Clock) -> None:
        self.names, self.clock = chain.names, clock
        # A message should reach us at most one unit (plus the lead) before it is due. One
        # much earlier (clocks far apart, or published here by hand) goes back to check-in
        # instead of sitting in our memory.
        self.max_hold_ms = max(10 * (chain.resolution_ms + lead_ms), 60_000)

    def __call__(self, d: Delivery) -> Forward:
        now = self.clock()
        try:
            due = envelope.fixed_due_at(d.properties.headers, now)
        except envelope.Unreadable as exc:
            return park(self.names, d, str(exc))
        if due - now > self.max_hold_ms:
            return Forward(self.names.check_in, d.routing_key, envelope.internal(d.properties, d.routing_key),
                           d.body, "recheck")
        key, properties = envelope.external(d.properties, d.routing_key)
        return Forward(self.names.pick_up, key, properties, d.body, "delivered", not_before_ms=due)


def park_unencodable(names: Names, action: Forward) -> Forward:
    """A Forward whose headers could not be encoded again (a value pika decodes but cannot
    write), parked instead, with the reason and those values as text."""
    problem = envelope.unencodable(action.properties) or "its properties cannot be encoded again"
    readable = Delivery(action.exchange, action.routing_key, envelope.printable_headers(action.properties),
                        action.body)
    return park(names, readable, problem)


DEATH_REASONS = {
    "delivery_limit": "redelivered too often (a consumer kept failing on it)",
    "expired": "its own expiration ran out before the gateway read it",
    "rejected": "rejected by a consumer",
    "maxlen": "the queue was full",
}


def why_parked(d: Delivery) -> str:
    deaths = (d.properties.headers or {}).get("x-death")
    if isinstance(deaths, list) and deaths and isinstance(deaths[0], dict):
        last = deaths[0]  # the broker puts the most recent death first
        reason = str(last.get("reason", "?"))
        return f"dead-lettered from queue {last.get('queue', '?')}: {DEATH_REASONS.get(reason, reason)}"
    return f"unroutable: no queue bound to exchange {d.exchange!r} matches routing key {d.routing_key!r}"


class Parking:
    def __init__(self, names: Names, clock: Optional[Clock] = None) -> None:
        self.names, self.clock = names, clock

    def __call__(self, d: Delivery) -> Forward:
        # Unroutable at pick-up means it was already due, and the distributor stripped the
        # due time with the other internal headers. Mark it due now, so a replay through
        # check-in delivers it at once instead of applying its x-delay a second time.
        due = self.clock() if self.clock and d.exchange == self.names.pick_up else None
        return park(self.names, d, why_parked(d), due_ms=due)
