"""What each consumer does with a delivery: pure functions from a Delivery to the actions it
becomes (messages to publish now or later, or to send on in a carrier).

check-in:    a publisher's message: read its due time once, and send it on to the level of
             the chain, meditation, or the distributor (in a carrier with others going the
             same way: carrier.py); one due soon straight to the distributor (the
             shorter path: shorter_path.py).
returning:   back from meditation (the gateway's format; only the broker can put messages
             there): send each message on by its due time, as check-in would.
distributor: hold each message until due, then publish the publisher's routing key,
             properties and body to pick-up; one that comes back unroutable is parked.
retry:       a message a consumer rejected from a queue that dead-letters to the retry
             exchange: back to that queue after its policy's delay, through the chain
             like any delayed message, or parked after the last attempt.
parking:     say why a message could not go on, and park it.

Which queue a message came from decides how it is read. Only the check-in queue holds
messages as publishers sent them, and there every header, `x-gateway-*` included, is the
publisher's data; the other queues can only be reached through the gateway's own publishes
and the broker's dead-lettering (with the least-privilege permissions of docs/security.md).
"""

import random
from typing import Any, Callable, Dict, List, Optional, Protocol, Sequence, Tuple

from topology import ChainSettings, Enter, Meditate, plan
from topology.encoding import units_for
from topology.names import Names

from gateway.core import cancels, carrier, envelope, retries, rules
from gateway.core.actions import Action, Drop, Enqueue, Forward
from gateway.core.inputs import Delivery
from gateway.core.routes import Way
from gateway.core.shorter_path import ShorterPath
from gateway.core.carrier import Damaged, Entry
from gateway.core.envelope import Inside, Unreadable
from gateway.core.wire import Properties

Json = Dict[str, Any]  # a JSON object


class Cancelled(Protocol):
    """Whether a publisher's message was cancelled (and, if so, counts and logs its drop):
    broker/run/cancelling.py's Judge, over the cancels this gateway follows."""

    def __call__(self, entry: Entry, where: str) -> bool: ...


def park(names: Names, user: Properties, routing_key: bytes, body: bytes, reason: str,
         due_ms: Optional[int] = None, exchange: Optional[str] = None) -> Forward:
    """Park a message: to the parked queue, keyed by the publisher's routing key. `exchange`:
    where its publisher sent it when that was not check-in (a cancel), for `parked replay`."""
    return Forward(names.parked, routing_key, envelope.inside(user, routing_key, due_ms, reason, exchange=exchange),
                   body, Way.PARKED, reason=reason)


def park_entry(names: Names, entry: Entry, reason: str) -> Forward:
    return Forward(names.parked, entry.routing_key,
                   envelope.inside(entry.user, entry.routing_key, entry.due_ms, reason, entry.accepted_us,
                                   entry.exchange), entry.body, Way.PARKED, reason=reason, entry=entry)


def entries(d: Delivery) -> List[Entry]:
    """The publishers' messages in a delivery in the gateway's format: a carrier's, or the
    one (in today's format, or the first: envelope.first_format). Raises Damaged for anything
    else."""
    if d.props.headers.get(carrier.COUNT) is not None:
        return carrier.unpack(d.body, carrier.accepted_times(d.props), envelope.destination(d.props.headers))
    inside = Inside(d.props)
    if not inside.complete:
        inside = envelope.first_format(d.props) or inside
    if inside.routing_key is None or inside.user is None or inside.due_ms is None:
        raise Damaged("not in the gateway's format (no due time)")
    return [Entry(inside.routing_key, inside.user, d.body, inside.due_ms, inside.accepted_us, inside.exchange)]


def park_delivery(names: Names, d: Delivery, reason: str) -> List[Forward]:
    """Park each message of a delivery in the gateway's format, or the delivery itself as it
    is when that format is damaged."""
    try:
        return [park_entry(names, e, reason) for e in entries(d)]
    except Damaged as exc:
        inside = Inside(d.props)
        inside = inside if inside.complete else envelope.first_format(d.props) or inside
        if inside.user is not None and inside.routing_key is not None:
            # a parked message's own format (no due time): keep what it has
            return [park(names, inside.user, inside.routing_key, d.body, reason)]
        return [park(names, d.props, d.routing_key, d.body, f"{reason} ({exc})")]


def parker(names: Names, queue: str) -> Callable[[Delivery, str], List[Forward]]:
    """How a consumer of this queue parks a whole delivery it cannot handle: as the
    publisher sent it at check-in (a cancel or a rule marked as one: replayed, it goes back to
    where it was sent, never to check-in); each of its messages (in the gateway's format)
    elsewhere."""
    if queue in (names.check_in, names.retry):
        return lambda d, reason: [park(names, d.props, d.routing_key, d.body, reason,
                                       exchange=d.exchange if d.exchange in (names.cancel, names.rules) else None)]
    return lambda d, reason: park_delivery(names, d, reason)


def unroutable(names: Names, e: Entry) -> Forward:
    """It came back from pick-up (no queue is bound for its routing key), or a retry from its
    queue's default binding (the queue is gone)."""
    if e.exchange == "":
        return park_entry(names, e, "unroutable: the retry's queue "
                          f"{envelope.readable_key(e.routing_key)!r} does not exist "
                          "(deleted while the retry waited?)")
    return park_entry(names, e, f"unroutable: no queue bound to exchange {names.pick_up!r} matches routing key "
                                f"{envelope.readable_key(e.routing_key)!r}")


def next_hop(e: Entry) -> Properties:
    """The gateway's properties for a message it sends on within the chain."""
    return envelope.inside(e.user, e.routing_key, e.due_ms, None, e.accepted_us, e.exchange)


def hand_back(names: Names, e: Entry) -> Forward:
    """A held message back into the distributor queue, for another gateway to hold."""
    return Forward(names.distributor, b"", next_hop(e), e.body, Way.HANDED_BACK, entry=e)


def route(chain: ChainSettings, remaining_ms: int, lead_ms: int) -> Tuple[str, bytes, Way]:
    """Where a message with this much time to go goes next: (exchange, routing key, way)."""
    step = plan(remaining_ms, chain, lead_ms)
    if isinstance(step, Meditate):
        return chain.meditation, b"", Way.MEDITATION
    if isinstance(step, Enter):
        return chain.names.level(step.level), step.key.encode(), Way.CHAIN
    return chain.names.distributor, b"", Way.DISTRIBUTOR


class Routes:
    """`route` for one chain and lead, remembered by whole units: a message's way depends
    only on them, and a workload meets few (a check-in consumer asks for every message)."""

    KEEP = 4096

    def __init__(self, chain: ChainSettings, lead_ms: int) -> None:
        self.chain, self.lead_ms = chain, lead_ms
        self._known: Dict[int, Tuple[str, bytes, Way]] = {}

    def __call__(self, remaining_ms: int) -> Tuple[str, bytes, Way]:
        # (every number of units past the chain's means meditation: one key for them all)
        units = min(units_for(remaining_ms, self.chain.resolution_ms, self.lead_ms), self.chain.max_units + 1)
        found = self._known.get(units)
        if found is None:
            if len(self._known) >= self.KEEP:
                self._known.clear()
            found = self._known[units] = route(self.chain, units * self.chain.resolution_ms, 0)
        return found


def carry(exchange: str, routing_key: bytes, way: Way, batch: List[Entry]) -> Forward:
    """One publish for the messages of a batch: alone in the plain format, or a carrier."""
    if len(batch) == 1:
        e = batch[0]
        return Forward(exchange, routing_key, next_hop(e), e.body, way, entry=e)
    return Forward(exchange, routing_key, carrier.properties(batch), carrier.pack(batch), way)


class CheckIn:
    def __init__(self, chain: ChainSettings, lead_ms: int, wait_ms: int = 0,
                 cancelled: Optional[Cancelled] = None, sequence: Optional[cancels.Sequencer] = None,
                 hold_within_ms: int = 0, hold_messages: int = 1000, held_rules: Optional[rules.Rules] = None
                 ) -> None:
        # A message may wait up to wait_ms for others going the same way: the chain leaves
        # that much more to the distributor, so waiting never makes it late (one going to
        # the distributor directly may wait only until its lead: `enqueue`).
        self.chain, self.lead_ms = chain, lead_ms + wait_ms
        self.hand_over_ms = lead_ms  # the distributor's lead: what a message direct to it may not wait into
        self.route = Routes(chain, self.lead_ms)
        # The shorter path: a message due within hold_within_ms (less at higher rates) goes
        # straight to the distributor, which holds it until due, rather than through the
        # chain's queues (one queue write instead of one a level: shorter_path.py).
        self.shorter = ShorterPath(hold_within_ms, hold_messages)
        self.cancelled = cancelled
        self.rules = held_rules  # the live rules (a rule beyond their limits is refused: Rules.room_for)
        # read times: one sequence per process, started above every cancel held
        self.sequence = sequence if sequence is not None else cancels.Sequencer()
        # The cancels this consumer recorded (("id", message id) or ("rule", name) -> read time)
        # while someone asks (broker/run/session.Session, until the gateway follows them all): None when
        # nobody does.
        self.recorded: Optional[Dict[Tuple[str, bytes], int]] = None

    def __call__(self, d: Delivery, now: int) -> List[Action]:
        user = envelope.for_pick_up(d.props)
        if d.exchange in (self.chain.names.cancel, self.chain.names.rules):
            return self.record(d, user, now)
        try:
            due = envelope.due_at(user.headers, now)
        except Unreadable as exc:
            return [park(self.chain.names, user, d.routing_key, d.body, str(exc))]
        entry = Entry(d.routing_key, user, d.body, due, self.sequence(now))
        if self.cancelled is not None and self.cancelled(entry, "check-in"):
            return [Drop(entry)]
        return [self.enqueue(entry, now)]

    def enqueue(self, e: Entry, now: int) -> Enqueue:
        if self.shorter.takes(e.due_ms - now, now):
            exchange, key, way = self.chain.names.distributor, b"", Way.DISTRIBUTOR
        else:
            exchange, key, way = self.route(e.due_ms - now)
        if way is Way.DISTRIBUTOR:
            return Enqueue(exchange, key, way, e, e.due_ms - self.hand_over_ms)
        return Enqueue(exchange, key, way, e)

    def record(self, d: Delivery, user: Properties, now: int) -> List[Action]:
        """A cancel (it came through `<prefix>.cancel`): by id, or a rule (rules.py), or the
        withdrawal of one. Append it to the cancellations stream once every delivery before it
        is acknowledged (a fence: flow.Flow); it is acknowledged once the broker confirmed the
        record."""
        names = self.chain.names
        body = b""
        try:
            if d.exchange == names.rules:
                asked = rules.requested(user.headers)
                if isinstance(asked, rules.Request) and self.rules is not None:
                    refused = self.rules.room_for(asked.select)
                    if refused is not None:
                        raise cancels.BadCancel(refused)
                read_us = self.sequence(now)
                at = cancels.Time(read_us, envelope.broker_stamp(user.headers, read_us // 1000))
                if isinstance(asked, rules.Withdrawing):
                    name, props = asked.name, rules.withdrawal_record(rules.Withdrawal(asked.name, at))
                else:
                    name = asked.name or rules.default_name(asked.select, asked.everything)
                    props, body = rules.record(rules.Rule(name, asked.select, at, asked.everything))
                recorded = ("rule", name)
            else:
                if rules.is_rule(user.headers):
                    raise cancels.BadCancel(f"a group cancel (x-cancel-* headers) goes to {names.rules!r}, not "
                                            f"{names.cancel!r}: publishing there is a right of its own "
                                            "(docs/security.md); nothing was cancelled")
                message_id = cancels.checked_id(user.get("message_id"))
                read_us = self.sequence(now)
                at = cancels.Time(read_us, envelope.broker_stamp(user.headers, read_us // 1000))
                props, recorded = cancels.record(message_id, at), ("id", message_id)
        except cancels.BadCancel as exc:  # (replayed, it goes back to the exchange it was sent to: parked again)
            return [park(names, user, d.routing_key, d.body, str(exc), exchange=d.exchange)]
        if self.recorded is not None:
            self.recorded[recorded] = at.read_us
        return [Forward(names.cancellations, b"", props, body, Way.CANCEL, mandatory=True, fence=True)]


class Retry(CheckIn):
    """A failed message a consumer rejected (or sent itself): back to its queue after its
    policy's delay, through the chain like any delayed message, or parked after the last
    attempt (retries.py)."""

    def __init__(self, chain: ChainSettings, lead_ms: int, policies: Sequence[retries.Policy],
                 rng: random.Random, wait_ms: int = 0, cancelled: Optional[Cancelled] = None,
                 sequence: Optional[cancels.Sequencer] = None, queues: str = "*", hold_within_ms: int = 0,
                 hold_messages: int = 1000) -> None:
        super().__init__(chain, lead_ms, wait_ms, cancelled, sequence, hold_within_ms, hold_messages)
        self.policies, self.rng, self.queues = policies, rng, queues

    def __call__(self, d: Delivery, now: int) -> List[Action]:
        failed = retries.failure(d.props.headers)
        user = envelope.for_pick_up(d.props)  # as the consumer received it, without the dead-letter history
        names = self.chain.names
        if failed.queue is None:
            return [park(names, user, d.routing_key, d.body, "reached the retry exchange with no way to tell its "
                         f"queue: not dead-lettered by a queue, and no {retries.QUEUE} header")]
        if failed.not_retried is not None:
            return [park(names, user, d.routing_key, d.body, failed.not_retried)]
        if not retries.allowed(failed.queue, self.queues):
            return [park(names, user, d.routing_key, d.body, f"retries may not go back to queue {failed.queue!r} "
                         f"(--retry-queues {self.queues})")]
        policy = retries.policy_for(failed.queue, self.policies)
        if failed.attempt > policy.attempts:
            made = failed.attempt - 1
            reason = f"{retries.GAVE_UP}{made} retr{'y' if made == 1 else 'ies'} to queue {failed.queue!r}" + (
                f": {failed.reason}" if failed.reason else "")
            return [park_entry(names, Entry(failed.queue.encode(), user, d.body, now, None, ""), reason)]
        due = now + policy.delay_ms(failed.attempt, self.rng)
        # taken in when it was rejected: a cancel published while it waited unread (no gateway
        # running, a backlog) came after it (by the read times; by the arrival stamps of its
        # first publish and the cancel where the broker stamps: cancelling.Judge)
        read_us = self.sequence(now)
        rejected = retries.rejected_by_us(d.props.headers)
        entry = Entry(failed.queue.encode(), retries.attempted(user, failed.attempt), d.body, due,
                      read_us if rejected is None else min(read_us, rejected), "")
        if self.cancelled is not None and self.cancelled(entry, "retry"):
            return [Drop(entry)]
        return [self.enqueue(entry, now)]


class Returning(CheckIn):
    def __call__(self, d: Delivery, now: int) -> List[Action]:
        try:
            back = entries(d)
        except Damaged as exc:
            return [park(self.chain.names, d.props, d.routing_key, d.body,
                         f"came back from meditation not in the gateway's format ({exc})")]
        return [Drop(e) if self.cancelled is not None and self.cancelled(e, "returning") else self.enqueue(e, now)
                for e in back]


def max_hold_ms(chain: ChainSettings, lead_ms: int) -> int:
    """The longest the distributor holds a message: ten units and leads, at least a minute."""
    return max(10 * (chain.resolution_ms + lead_ms), 60_000)


def crowded_at(prefetch: int) -> Optional[int]:
    """How many deliveries holding messages leave too little of a distributor's prefetch for
    what falls due meanwhile (a tenth of it, at least one, kept free); None: no prefetch limit."""
    return None if prefetch <= 0 else max(1, prefetch - max(1, prefetch // 10))


class Distributor:
    def __init__(self, chain: ChainSettings, lead_ms: int, stamp_due_at: bool = False,
                 cancelled: Optional[Cancelled] = None, crowded: Callable[[], bool] = lambda: False) -> None:
        self.chain, self.lead_ms, self.stamp = chain, lead_ms, stamp_due_at
        self.cancelled = cancelled
        # A message should reach us at most one unit (plus the lead) before it is due. One
        # much earlier (clocks far apart, or published here by hand) goes back into the
        # chain instead of sitting in our memory.
        self.max_hold_ms = max_hold_ms(chain, lead_ms)
        # While what it holds takes nearly all of its prefetch (the shorter path's carriers,
        # held for seconds), a message due later than this goes back into the chain instead:
        # the broker keeps delivering what falls due, rather than waiting for a place.
        self.crowded = crowded
        self.crowded_hold_ms = 2 * (chain.resolution_ms + lead_ms)

    def __call__(self, d: Delivery, now: int) -> List[Action]:
        try:
            arrived = entries(d)
        except Damaged as exc:
            return list(park_delivery(self.chain.names, d, f"reached the distributor {exc}"))
        return [Drop(e) if self.cancelled is not None and self.cancelled(e, "distributor") else self.release(e, now)
                for e in arrived]

    def still_wanted(self, forward: Forward) -> bool:
        """Checked again as a held message is released (consumer.Pipe): a cancel may have
        come while the distributor held it."""
        return forward.entry is None or self.cancelled is None or not self.cancelled(forward.entry, "release")

    def release(self, e: Entry, now: int) -> Forward:
        if e.due_ms - now > self.max_hold_ms or (e.due_ms - now > self.crowded_hold_ms and self.crowded()):
            exchange, key, _ = route(self.chain, e.due_ms - now, self.lead_ms)
            return Forward(exchange, key, next_hop(e), e.body, Way.RECHECK, entry=e)
        if e.exchange is not None:  # a retry, back to its queue (no due-time stamp: not scheduled by its publisher)
            return Forward(e.exchange, e.routing_key, e.user, e.body, Way.RETRIED, not_before_ms=e.due_ms,
                           mandatory=True, entry=e)
        user = envelope.stamped(e.user, e.due_ms) if self.stamp else e.user
        return Forward(self.chain.names.pick_up, e.routing_key, user, e.body, Way.DELIVERED,
                       not_before_ms=e.due_ms, mandatory=True, entry=e)

    def unroutable(self, e: Entry) -> Forward:
        return unroutable(self.chain.names, e)


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

    def __call__(self, d: Delivery, now: int) -> List[Action]:
        death = envelope.last_death(d.props.headers)
        if death is None:
            reason = (f"unroutable in the chain: no queue bound to exchange {d.exchange!r} "
                      f"matches routing key {envelope.readable_key(d.routing_key)!r}")
        else:
            why = str(death.get("reason", "?"))
            reason = f"dead-lettered from queue {death.get('queue', '?')}: {DEATH_REASONS.get(why, why)}"
        if d.routing_key in (b"check-in", b"retry"):  # as its publisher sent it
            sent_to = (death or {}).get("exchange")
            return [park(self.names, envelope.for_pick_up(d.props), _first_key(death, d), d.body, reason,
                         exchange=sent_to if sent_to in (self.names.cancel, self.names.rules) else None)]
        return list(park_delivery(self.names, d, reason))


def _first_key(death: Optional[Json], d: Delivery) -> bytes:
    """The routing key a message had before the broker dead-lettered it with ours."""
    keys = (death or {}).get("routing-keys")
    if isinstance(keys, list) and keys and isinstance(keys[0], (str, bytes)):
        return envelope.as_bytes(keys[0])
    return d.routing_key
