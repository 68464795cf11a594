"""What each consumer does with a delivery: pure functions from a Delivery to a Forward.

check-in:    a publisher's message: read its due time once, put it in the gateway's format,
             send it to the level of the chain, meditation, or the distributor.
returning:   back from meditation (the gateway's format, and only the broker can put
             messages there): send it on by its due time, as check-in would.
distributor: hold until due, then publish the publisher's routing key, properties and body
             to pick-up; one that comes back unroutable is parked.
parking:     say why a message could not go on, and park it.

Which queue a message came from decides how it is read. Only the check-in queue holds
messages as publishers sent them, and there every header, `x-gateway-*` included, is the
publisher's data; the other queues can only be reached through the gateway's own publishes
and the broker's dead-lettering (with the least-privilege permissions in the README).
"""

from typing import Callable, Optional

from topology import ChainSettings, Enter, Meditate, plan
from topology.names import Names

from . import envelope
from .actions import Delivery, Forward
from .envelope import Inside, Unreadable
from .wire import Properties

Clock = Callable[[], int]


def park(names: Names, user: Properties, routing_key: bytes, body: bytes, reason: str,
         due_ms: Optional[int] = None) -> Forward:
    """Park a message: to the parked queue, keyed by the publisher's routing key."""
    return Forward(names.parked, routing_key, envelope.inside(user, routing_key, due_ms, reason), body,
                   "parked", reason=reason)


def park_inside(names: Names, d: Delivery, reason: str) -> Forward:
    """Park a message that is in the gateway's format (keeping its due time), or, where
    that format is damaged, the delivery itself as it is."""
    inside = Inside(d.props)
    if inside.complete:
        return park(names, inside.user, inside.routing_key, d.body, reason, inside.due_ms)
    return park(names, d.props, d.routing_key, d.body, f"{reason} (not in the gateway's format)")


def onward(chain: ChainSettings, props: Properties, body: bytes, remaining_ms: int, lead_ms: int) -> Forward:
    """Into the chain, meditation or the distributor, by the time that remains."""
    names = chain.names
    route = plan(remaining_ms, chain, lead_ms)
    if isinstance(route, Meditate):
        return Forward(chain.meditation, b"", props, body, "meditation")
    if isinstance(route, Enter):
        return Forward(names.level(route.level), route.key.encode(), props, body, "chain")
    return Forward(names.distributor, b"", props, body, "distributor")


class CheckIn:
    def __init__(self, chain: ChainSettings, lead_ms: int, clock: Clock) -> None:
        self.chain, self.lead_ms, self.clock = chain, lead_ms, clock

    def __call__(self, d: Delivery) -> Forward:
        now = self.clock()
        user = envelope.publishers(d.props)
        try:
            due = envelope.due_at(user.headers, now)
        except Unreadable as exc:
            return park(self.chain.names, user, d.routing_key, d.body, str(exc))
        return onward(self.chain, envelope.inside(user, d.routing_key, due), d.body, due - now, self.lead_ms)


class Returning:
    def __init__(self, chain: ChainSettings, lead_ms: int, clock: Clock) -> None:
        self.chain, self.lead_ms, self.clock = chain, lead_ms, clock

    def __call__(self, d: Delivery) -> Forward:
        inside = Inside(d.props)
        if not inside.complete or inside.due_ms is None:
            return park_inside(self.chain.names, d, "came back from meditation without a due time")
        return onward(self.chain, inside.again(), d.body, inside.due_ms - self.clock(), self.lead_ms)


class Distributor:
    def __init__(self, chain: ChainSettings, lead_ms: int, clock: Clock, stamp_due_at: bool = False) -> None:
        self.chain, self.lead_ms, self.clock, self.stamp = chain, lead_ms, clock, stamp_due_at
        # A message should reach us at most one unit (plus the lead) before it is due. One
        # much earlier (clocks far apart, or published here by hand) goes back into the
        # chain instead of sitting in our memory.
        self.max_hold_ms = max(10 * (chain.resolution_ms + lead_ms), 60_000)

    def __call__(self, d: Delivery) -> Forward:
        inside = Inside(d.props)
        if not inside.complete or inside.due_ms is None:
            return park_inside(self.chain.names, d, "reached the distributor without a due time")
        now = self.clock()
        if inside.due_ms - now > self.max_hold_ms:
            recheck = onward(self.chain, inside.again(), d.body, inside.due_ms - now, self.lead_ms)
            return Forward(recheck.exchange, recheck.routing_key, recheck.props, recheck.body, "recheck")
        user = envelope.stamped(inside.user, inside.due_ms) if self.stamp else inside.user
        return Forward(self.chain.names.pick_up, inside.routing_key, user, d.body, "delivered",
                       not_before_ms=inside.due_ms, mandatory=True)

    def unroutable(self, d: Delivery) -> Forward:
        """It came back from pick-up: no queue is bound for its routing key."""
        key = envelope.shown(Inside(d.props).routing_key)
        return park_inside(self.chain.names, d, f"unroutable: no queue bound to exchange "
                                                f"{self.chain.names.pick_up!r} matches routing key {key!r}")


DEATH_REASONS = {
    "delivery_limit": "redelivered too often (a consumer kept failing on it)",
    "expired": "its own expiration ran out before the gateway read it",
    "rejected": "rejected by the gateway (it could not publish it anywhere)",
    "maxlen": "the queue was full",
}


class Parking:
    """Messages dead-lettered by the gateway's queues (routing key: the queue's role) or
    sent by a chain exchange that had no binding for their key."""

    def __init__(self, names: Names) -> None:
        self.names = names

    def __call__(self, d: Delivery) -> Forward:
        death = envelope.death(d.props.headers)
        if death is None:
            reason = (f"unroutable in the chain: no queue bound to exchange {d.exchange!r} "
                      f"matches routing key {envelope.shown(d.routing_key)!r}")
        else:
            why = str(death.get("reason", "?"))
            reason = f"dead-lettered from queue {death.get('queue', '?')}: {DEATH_REASONS.get(why, why)}"
        if d.routing_key == b"check-in":  # as its publisher sent it
            return park(self.names, envelope.publishers(d.props), _first_key(death, d), d.body, reason)
        return park_inside(self.names, d, reason)


def _first_key(death: Optional[dict], d: Delivery) -> bytes:
    """The routing key a message had before the broker dead-lettered it with ours."""
    keys = (death or {}).get("routing-keys")
    if isinstance(keys, list) and keys and isinstance(keys[0], (str, bytes)):
        return envelope.as_bytes(keys[0])
    return d.routing_key
