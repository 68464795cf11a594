"""The broker's answers to a consumer's publishes, turned into what to do next (pure).

Part of the consumer's core (flow.Flow): sends go out in order; a refused publish
(basic.nack) is retried later, or after too many refusals the connection starts over; a
returned one (unroutable) and the one the broker closed the channel over are parked
instead; a delivery whose parked copy is refused too is given up (the broker
dead-letters it). Also the values the core and its adapter exchange.
"""

from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Protocol, Sequence, Tuple

from topology.names import Names

from gateway.core import handlers
from gateway.core.actions import Action, Delivery, Forward, Way
from gateway.core.carrier import Entry
from gateway.core.deliveries import Deliveries, Outcome, Publication

ACK_FLUSH_MS = 5  # acknowledgements wait this long for others to share one frame
ACK_BATCH = 500  # ... or until this many are due
# A publish the broker refuses (basic.nack: a quorum queue without a leader during a
# failover) is retried after this long while we keep the delivery. Requeueing it instead
# would spin: each requeue counts against the queue's delivery limit, which a failover of a
# few seconds exhausts, and the message would be parked for nothing.
RETRY_REFUSED_MS = 1000
# After this many refusals of one message, start over on a new connection: in a cluster
# failover a channel opened while a quorum queue's leader was moving can keep being refused
# while a fresh channel is accepted (seen on 3.10.8 with a 3-node cluster).
REFUSED_RECONNECT = 3

Member = Tuple[int, Optional[Entry]]  # a delivery tag, and the publisher's message if it is one
Handler = Callable[[Delivery, int], List[Action]]  # a delivery, and the time it came (epoch ms)


@dataclass
class Out:
    """What one publication is: the frame to send, and whose messages it holds."""

    forward: Forward
    members: Sequence[Member]


Sent = Publication[Out]


@dataclass
class Actions:
    """What the adapter must do after an event, in this order."""

    publish: List[Sent] = field(default_factory=list)  # send each `payload.forward`, in order
    ack: List[Tuple[int, bool]] = field(default_factory=list)  # (delivery tag, multiple)
    reject: List[int] = field(default_factory=list)  # nack without requeue: the broker dead-letters it
    reconnect: bool = False  # start over on a new connection
    # After the acks: a round trip on the consuming channel (basic.qos), answered by
    # Flow.synced, so the broker has taken every ack sent before it.
    sync: bool = False
    finished: bool = False  # stopping, and nothing is left to wait for


class Observer(Protocol):
    """Metrics and logs: told what was decided; they decide nothing."""

    def forwarded(self, action: Action) -> None: ...

    def batched(self, way: Way, messages: int) -> None: ...

    def late(self, ms: int) -> None: ...

    def note(self, level: str, event: str, **fields: object) -> None: ...


class Answers:
    """Owns the refused publications waiting for their retry, and why the broker last
    closed the publishing channel."""

    def __init__(self, ledger: Deliveries[Out, Forward], names: Names, park: Callable[[Delivery, str], List[Forward]],
                 delivered: Dict[int, Delivery], observer: Observer, give_up: Callable[[int], None]) -> None:
        self._ledger, self._names, self._park, self._delivered = ledger, names, park, delivered
        self._observer, self._give_up = observer, give_up
        self._retries: List[Tuple[int, Sent]] = []  # (when, a refused publication)
        self.refusal = "?"

    def next_retry(self) -> Optional[int]:
        return min((at for at, _ in self._retries), default=None)

    def retry_due(self, now: int, out: "Actions") -> None:
        due = [pub for at, pub in self._retries if at <= now]
        if due:
            self._retries = [(at, pub) for at, pub in self._retries if at > now]
            for pub in due:
                self.apply(self._ledger.retry(pub), now, out)

    def clear(self) -> None:
        self._retries.clear()

    def apply(self, outcome: Outcome[Out], now: int, out: Actions) -> None:
        for pub in outcome.send:
            pub.sent_ms = now
        out.publish.extend(outcome.send)
        for pub in outcome.refused:
            if pub.refused > REFUSED_RECONNECT:
                self._observer.note("error", "broker_keeps_refusing", refusals=pub.refused)
                out.reconnect = True
            else:
                self._observer.note("warning", "publish_nacked_by_broker", after_s=RETRY_REFUSED_MS / 1000)
                self._retries.append((now + RETRY_REFUSED_MS, pub))
        for pub in outcome.returned:
            self._park_publication(pub, lambda e: handlers.unroutable(self._names, e), "", now, out)
        reason = f"the broker refused to take it: {self.refusal}"
        for pub in outcome.guilty:
            self._park_publication(pub, lambda e: handlers.park_entry(self._names, e, reason), reason, now, out)
        for tag in outcome.reject:
            self._observer.note("error", "rejected_to_dead_letter", delivery_tag=tag)
            self._give_up(tag)
            out.reject.append(tag)

    def _park_publication(self, pub: Sent, parked: Callable[[Entry], Forward], reason: str, now: int,
                          out: Actions) -> None:
        """Publish a parked copy of each message of a publication that cannot go on."""
        for tag, entry in pub.payload.members:
            if tag not in self._ledger:
                continue
            copies = [parked(entry)] if entry is not None else self._park(self._delivered[tag], reason)
            for copy in copies:
                self._observer.forwarded(copy)
                self.apply(self._ledger.publish((tag,), Out(copy, [(tag, copy.entry)]), (), parking=True), now, out)
