"""What a handler decides for a delivery: the publishes a consumer's core carries out (pure).

Each is a NamedTuple rather than a frozen dataclass: one is made for every message at
check-in and again at release, and a NamedTuple costs a sixth of a frozen dataclass to make.
"""

from typing import NamedTuple, Optional, Union

from gateway.core.carrier import Entry
from gateway.core.routes import Way
from gateway.core.wire import Properties


class Forward(NamedTuple):
    """Publish this (with confirms); acknowledge the delivery once the broker confirms."""

    exchange: str
    routing_key: bytes
    props: Properties
    body: bytes
    way: Way
    not_before_ms: Optional[int] = None  # hold until then (epoch ms)
    reason: Optional[str] = None  # why it is parked
    mandatory: bool = False  # pick-up: a message nobody is bound for comes back, to be parked
    entry: Optional[Entry] = None  # the one publisher's message it carries, if it is one
    # Published only once every delivery before the one it comes from is acknowledged, and
    # nothing after that delivery is acknowledged before it (a cancel's record: flow.Flow).
    fence: bool = False


class Enqueue(NamedTuple):
    """Send this publisher's message on this route, in a carrier with others going the same
    way (carrier.Batcher), or alone."""

    exchange: str
    routing_key: bytes
    way: Way  # CHAIN, MEDITATION or DISTRIBUTOR
    entry: Entry
    # To the distributor, due within the carrier wait: it may not wait for company past the
    # distributor's lead (chain routes plan the wait in, and have no limit).
    send_by_ms: Optional[int] = None


class Drop(NamedTuple):
    """A publisher's message that will not be published (it was cancelled): its delivery is
    acknowledged with the rest of it, and the index notes it gone."""

    entry: Entry


Publish = Union[Forward, Enqueue]  # what is published (now, or in a carrier)
Action = Union[Publish, Drop]
