"""Moving what waits to another cluster (pure): what `delay-gateway move --to` makes of the
messages it takes from the old cluster's queues, for the new cluster's gateway.

A message in the gateway's format (the chain's levels, meditation, the returning and
distributor exits) keeps its due time, routing key, properties, body and read time exactly,
and enters the new chain where check-in would send it now: a level, meditation or the
distributor, by the time it has left, many going the same way in one carrier. A TTL queue
cannot be told how long a message has waited in it, so a message is never moved into a
queue of the same level "where it was": it starts the level its remaining time gives, which
is never early and late by nothing more than the chain's usual hop.

What waits for a gateway as its sender sent it goes to the new cluster the way it came to the
old one, so that the new gateway reads it as the old one would have:
- check-in: to the exchange it was published to (check-in, cancel or rules), routing key,
  properties and body as sent (without `user_id`, which the broker checks against the move's
  own login): a cancel still behind the messages published before it, as publishers see it;
- retry: to the retry exchange, its queue named by `x-retry-queue` (the broker's own
  dead-letter history is not carried: RabbitMQ 4 drops a client's `x-death`); one the old
  gateway would have parked (not a rejection, no queue) is parked, with the same reason;
- parking: parked, with the reason the old gateway would have given;
- parked (on request): to the parked queue as it is.

A message a cancel or rule of the old cluster holds is not moved (`cancelled`); the cancels
themselves are carried by the shell (commands/move_to.py), with their own times.
"""

from dataclasses import dataclass, field
from enum import Enum
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from topology import ChainSettings
from topology.names import Names

from gateway.core import envelope, handlers, index_records, retries, wire
from gateway.core.actions import Action, Forward
from gateway.core.carrier import Damaged, Entry
from gateway.core.handlers import Routes
from gateway.core.inputs import Delivery
from gateway.core.routes import Way
from gateway.core.wire import Properties


class Source(Enum):
    """How a queue of the old cluster holds its messages."""

    HELD = "held"  # the gateway's format: levels, meditation, the returning and distributor exits
    CHECK_IN = "check-in"  # as publishers sent them: messages, cancels and rules
    RETRY = "retry"  # failed messages, as their queues dead-lettered them
    PARKING = "parking"  # dead-lettered by the gateway's own queues, to be parked
    PARKED = "parked"  # parked: moved only on request


# a queue's role (topology.model.build) -> how it holds its messages; other roles hold none
SOURCES = {"delay": Source.HELD, "pass": Source.HELD, "meditation": Source.HELD, "returning": Source.HELD,
           "distributor": Source.HELD, "check-in": Source.CHECK_IN, "retry": Source.RETRY,
           "parking": Source.PARKING, "parked": Source.PARKED}
# The order the move reads them in: what falls due soonest first (the distributor exits, then
# what is back from meditation or not read yet, then the levels from the lowest up, meditation
# last), parked after everything that still has a time.
ORDER = {"distributor": 0, "returning": 1, "check-in": 2, "retry": 3, "pass": 4, "delay": 4, "meditation": 5,
         "parking": 6, "parked": 7}

Publish = Tuple[str, bytes, Properties, bytes]  # exchange, routing key, properties, body


@dataclass
class Moved:
    """What one batch taken from the old cluster becomes."""

    publishes: List[Publish] = field(default_factory=list)  # to the new cluster, in this order
    entries: List[Entry] = field(default_factory=list)  # moved in the gateway's format, by due time
    cancelled: List[Entry] = field(default_factory=list)  # held by a cancel or rule: not moved
    as_sent: int = 0  # moved as their senders sent them (check-in, retry), or parked

    @property
    def messages(self) -> int:
        return len(self.entries) + self.as_sent


class Mover:
    """Turns batches of deliveries from the old cluster into publishes for the new one's chain
    `target` (whose distributor hands messages to pick-up `lead_ms` early, as the settings of
    the gateways there say)."""

    def __init__(self, source: Names, target: ChainSettings, lead_ms: int, carrier_messages: int,
                 carrier_bytes: int, cancelled: Optional[Callable[[Entry], bool]] = None) -> None:
        self.source, self.target = source, target
        self.route = Routes(target, lead_ms)
        self.carrier_messages, self.carrier_bytes = carrier_messages, carrier_bytes
        self.cancelled = cancelled

    def take(self, deliveries: Sequence[Tuple[Source, Delivery]], now_ms: int) -> Moved:
        """A batch: each delivery with how its queue holds messages."""
        moved = Moved()
        held: List[Entry] = []
        for source, d in deliveries:
            if source is Source.HELD:
                try:
                    held += handlers.entries(d)
                except Damaged as exc:  # parked there, as the old gateway would have
                    parked = handlers.park_delivery(self.target.names, d, f"not in the gateway's format ({exc})")
                    moved.publishes += [(f.exchange, f.routing_key, f.props, f.body) for f in parked]
                    moved.as_sent += len(parked)
            else:
                sent = self.as_sent(source, d, now_ms)
                moved.publishes += sent
                moved.as_sent += len(sent)
        for e in sorted(held, key=lambda e: e.due_ms):
            (moved.cancelled if self.cancelled is not None and self.cancelled(e) else moved.entries).append(e)
        moved.publishes += self.carriers(moved.entries, now_ms)
        return moved

    def carriers(self, entries: Sequence[Entry], now_ms: int) -> List[Publish]:
        """Entries (in due order) grouped by where they enter the new chain, in carriers as
        check-in makes them (at most carrier_messages and carrier_bytes; a bigger one alone)."""
        open_: Dict[Tuple[str, bytes, Optional[str]], Tuple[List[Entry], int]] = {}
        out: List[Publish] = []

        def close(way: Tuple[str, bytes, Optional[str]]) -> None:
            batch, _ = open_.pop(way)
            f = handlers.carry(way[0], way[1], Way.CHAIN, batch)
            out.append((f.exchange, f.routing_key, f.props, f.body))

        for e in entries:
            exchange, key, _ = self.route(e.due_ms - now_ms)
            way = (exchange, key, e.exchange)
            batch, size = open_.get(way, ([], 0))
            if batch and (len(batch) >= self.carrier_messages or size + e.size > self.carrier_bytes):
                close(way)
                batch, size = [], 0
            batch.append(e)
            open_[way] = (batch, size + e.size)
        for way in list(open_):
            close(way)
        return out

    def as_sent(self, source: Source, d: Delivery, now_ms: int) -> List[Publish]:
        names = self.target.names
        user = envelope.for_pick_up(d.props)
        if source is Source.CHECK_IN:
            sent_to = {self.source.cancel: names.cancel, self.source.rules: names.rules}.get(d.exchange,
                                                                                            names.check_in)
            return [(sent_to, d.routing_key, user, d.body)]
        if source is Source.PARKED:
            return [(names.parked, d.routing_key, user, d.body)]
        if source is Source.PARKING:
            parked: List[Action] = list(handlers.Parking(names)(d, now_ms))
        else:
            failed = retries.failure(d.props.headers)
            if failed.queue is not None and failed.not_retried is None:
                if retries.QUEUE not in user.headers:
                    user = user.replace(headers=user.headers.with_entry(wire.longstr(retries.QUEUE, failed.queue)))
                return [(names.retry, d.routing_key, user, d.body)]
            parked = [handlers.park(names, user, d.routing_key, d.body, failed.not_retried or (
                "reached the retry exchange with no way to tell its queue: not dead-lettered by a queue, and no "
                f"{retries.QUEUE} header"))]
        return [(f.exchange, f.routing_key, f.props, f.body) for f in parked if isinstance(f, Forward)]


def index_of(entries: Sequence[Entry], bands: int, now_ms: int) -> Dict[str, bytes]:
    """The new cluster's index records of moved entries (each waits until due), by band key."""
    return index_records.by_band([e for e in entries if e.accepted_us is not None], bands, now_ms)


def done_of(entries: Sequence[Entry]) -> Optional[bytes]:
    """The old cluster's done record of entries gone from it (None: none was indexed)."""
    keys = [k for k in map(index_records.done_key, entries) if k is not None]
    return index_records.pack_done(keys) if keys else None


__all__ = ["Damaged", "Moved", "Mover", "ORDER", "SOURCES", "Source", "done_of", "index_of"]
