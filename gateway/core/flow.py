"""One consumer's core (pure): every decision about its deliveries, and all their state.

The pika adapter (broker.consumer.Pipe) turns frames into the events below and does what
the returned `Actions` say, nothing more. The core keeps:

- the outstanding deliveries and the publishes they became (`Deliveries`, with the
  publishing channel's confirm window inside it): what may be acknowledged when;
- each outstanding delivery as it arrived, to park it whole if what it became cannot go on;
- per delivery, how many of its messages are not yet in a sent publish;
- the held messages (`Holds`), released at their due time: `held` is their count, the one
  the held-messages gauge reads;
- the open batches (`Batcher`), closed by count, bytes or age;
- the refused publishes waiting to be retried, and when acknowledgements are due.

Time comes in with each event (epoch ms); `next_wake()` says when the core wants a `tick`.
"""

from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Protocol, Sequence, Tuple

from topology.names import Names

from gateway.core import envelope, handlers
from gateway.core.actions import Action, Delivery, Enqueue, Forward
from gateway.core.carrier import Batch, Batcher, Entry, Holds
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
Handler = Callable[[Delivery], List[Action]]


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
    finished: bool = False  # stopping, and nothing is left to wait for


class Observer(Protocol):
    """Metrics and logs: told what was decided; they decide nothing."""

    def forwarded(self, action: Action) -> None: ...

    def batched(self, outcome: str, messages: int) -> None: ...

    def late(self, ms: int) -> None: ...

    def note(self, level: str, event: str, **fields: object) -> None: ...


class Flow:
    def __init__(self, queue: str, names: Names, handler: Handler, observer: Observer,
                 batcher: Optional[Batcher] = None) -> None:
        self._names, self._handler, self._observer = names, handler, observer
        self._park = handlers.parker(names, queue)
        self._batcher = batcher if batcher is not None else Batcher(1, 1, 0)  # (an empty one is falsy)
        self.ledger: Deliveries[Out] = Deliveries()
        self._delivered: Dict[int, Delivery] = {}  # outstanding deliveries (to park them whole)
        self._left: Dict[int, int] = {}  # tag -> its messages not yet in a sent publication
        self._holds: Holds[int, Forward] = Holds()  # a delivery tag's message, due at its time
        self._retries: List[Tuple[int, Sent]] = []  # (when, a refused publication)
        self._flush_at: Optional[int] = None
        self._refusal = "?"
        self._draining = False

    # -- queries --------------------------------------------------------------------------
    @property
    def held(self) -> int:
        """Messages held until their time (the held-messages gauge)."""
        return len(self._holds)

    def next_wake(self) -> Optional[int]:
        """When the next `tick` is due (epoch ms), if any."""
        times = [t for t in (self._holds.next_due(), self._batcher.next_deadline(), self._flush_at) if t is not None]
        times.extend(at for at, _ in self._retries)
        return min(times, default=None)

    def waiting_for_confirm_ms(self, now_ms: int) -> int:
        """How long the oldest publish not yet confirmed has been waiting (0: none)."""
        pub = self.ledger.oldest_unconfirmed()
        return now_ms - pub.sent_ms if pub is not None else 0

    # -- events ---------------------------------------------------------------------------
    def delivered(self, tag: int, d: Delivery, now: int) -> Actions:
        out = Actions()
        self._release_due(now, out)  # a stream of deliveries must not keep due messages waiting
        self.ledger.received(tag)
        self._delivered[tag] = d
        try:
            actions = self._handler(d)
        except Exception as exc:  # a bug must not stop the gateway, nor lose the message
            self._observer.note("exception", "handler_failed", routing_key=envelope.shown(d.routing_key))
            actions = list(self._park(d, f"the gateway failed on it: {exc!r}"))
        if not actions:
            self.ledger.finish(tag)
        else:
            self._left[tag] = len(actions)
        for action in actions:
            self._observer.forwarded(action)
            if isinstance(action, Enqueue):
                route = (action.exchange, action.routing_key, action.outcome)
                for batch in self._batcher.add(route, tag, action.entry, now):
                    self._flush_batch(batch, now, out)
            elif action.not_before_ms is not None and action.not_before_ms > now:
                self.ledger.hold(tag)
                self._holds.add(action.not_before_ms, tag, action)
            else:
                self._send([tag], action, [(tag, action.entry)], now, out)
        return out

    def publishing_opened(self, now: int) -> Actions:
        out = Actions()
        self._apply(self.ledger.channel_open(), now, out)
        return out

    def publishing_closed(self, refusal: str, now: int) -> Actions:
        """The broker closed the publishing channel over a message (a new one is opening)."""
        self._refusal = refusal
        out = Actions()
        self._apply(self.ledger.channel_closed(), now, out)
        return out

    def publishing_gone(self) -> None:
        """The publishing channel closed and will not be opened again."""
        self.ledger.channel_gone()

    def returned(self, routing_key: bytes, props: bytes, body: bytes) -> None:
        """basic.return: the confirm that follows reports it (then it is parked)."""
        for pub in self.ledger.inflight():
            f = pub.payload.forward
            if f.mandatory and f.routing_key == routing_key and f.body == body and f.props.raw == props:
                self.ledger.returned(pub.seq)
                return
        self._observer.note("error", "unmatched_return", routing_key=envelope.shown(routing_key))

    def confirmed(self, seq: int, multiple: bool, ack: bool, now: int) -> Actions:
        out = Actions()
        self._apply(self.ledger.confirmed(seq, multiple, ack), now, out)
        if self.ledger.done_count >= ACK_BATCH:
            self._flush(out)
        elif self._flush_at is None and self.ledger.done_count:
            self._flush_at = now + ACK_FLUSH_MS
        self._maybe_finished(out)
        return out

    def tick(self, now: int) -> Actions:
        out = Actions()
        self._release_due(now, out)
        for batch in self._batcher.expired(now):
            self._flush_batch(batch, now, out)
        if self._flush_at is not None and now >= self._flush_at:
            self._flush(out)
        due = [pub for at, pub in self._retries if at <= now]
        if due:
            self._retries = [(at, pub) for at, pub in self._retries if at > now]
            for pub in due:
                self._apply(self.ledger.retry(pub), now, out)
        return out

    def drain(self, now: int) -> Actions:
        """Stopping, and no more deliveries come: send on what waits in batches, hand held
        messages back to the distributor queue (for another gateway), wait for confirms."""
        out = Actions()
        self._draining = True
        for batch in self._batcher.drain():
            self._flush_batch(batch, now, out)
        # A held message is due within a unit or so: it goes back into the distributor
        # queue, where another gateway (or this one, restarted) holds it until due. Handing
        # back the delivery instead would repeat those of a carrier already published.
        held = self._holds.drain()
        for tag, release in held:
            self.ledger.release(tag)
            assert release.entry is not None  # (only the distributor holds, one entry each)
            self._send([tag], handlers.hand_back(self._names, release.entry), [(tag, release.entry)], now, out)
        self._observer.note("info", "stopping", returned=len(held), unconfirmed=self.ledger.unconfirmed)
        self._maybe_finished(out)
        return out

    def consuming_lost(self) -> None:
        """The consuming channel is gone: its deliveries return to their queue by themselves."""
        self.ledger.lost()
        self._holds.drain()
        self._batcher.drain()
        self._delivered.clear()
        self._left.clear()
        self._retries.clear()
        self._flush_at = None

    # -- decisions ------------------------------------------------------------------------
    def _release_due(self, now: int, out: Actions) -> None:
        """Publish every held message whose time has come, in due order."""
        if self._holds.next_due() is None:
            return
        for tag, action in self._holds.due(now):
            if self.ledger.release(tag):
                self._send([tag], action, [(tag, action.entry)], now, out)

    def _flush_batch(self, batch: Batch, now: int, out: Actions) -> None:
        exchange, key, outcome = batch.key
        self._observer.batched(outcome, len(batch.items))
        self._send([tag for tag, _ in batch.items],
                   handlers.carry(exchange, key, outcome, [e for _, e in batch.items]), batch.items, now, out)

    def _send(self, tags: List[int], forward: Forward, members: Sequence[Member], now: int, out: Actions) -> None:
        """Publish `forward` for the messages of these deliveries (one tag per message)."""
        if forward.not_before_ms is not None:
            self._observer.late(max(0, now - forward.not_before_ms))
        finishing = []
        for tag, n in Counter(tags).items():
            left = self._left.get(tag, 0) - n
            if left <= 0:
                self._left.pop(tag, None)
                finishing.append(tag)
            else:
                self._left[tag] = left
        outcome = self.ledger.publish(tuple(dict.fromkeys(tags)), Out(forward, members), finishing,
                                      parking=forward.outcome == "parked")
        self._apply(outcome, now, out)

    def _apply(self, outcome: Outcome[Out], now: int, out: Actions) -> None:
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
        reason = f"the broker refused to take it: {self._refusal}"
        for pub in outcome.guilty:
            self._park_publication(pub, lambda e: handlers.park_entry(self._names, e, reason), reason, now, out)
        for tag in outcome.reject:
            self._observer.note("error", "rejected_to_dead_letter", delivery_tag=tag)
            # given up: none of its messages may be sent any more
            self._delivered.pop(tag, None)
            self._left.pop(tag, None)
            self._holds.discard(tag)
            self._batcher.discard(tag)
            out.reject.append(tag)

    def _park_publication(self, pub: Sent, parked: Callable[[Entry], Forward], reason: str, now: int,
                          out: Actions) -> None:
        """Publish a parked copy of each message of a publication that cannot go on."""
        for tag, entry in pub.payload.members:
            if tag not in self.ledger:
                continue
            copies = [parked(entry)] if entry is not None else self._park(self._delivered[tag], reason)
            for copy in copies:
                self._observer.forwarded(copy)
                self._apply(self.ledger.publish((tag,), Out(copy, [(tag, copy.entry)]), (), parking=True), now, out)

    def _flush(self, out: Actions) -> None:
        self._flush_at = None
        last, singles, gone = self.ledger.acks()
        if last is not None:
            out.ack.append((last, True))
        out.ack.extend((tag, False) for tag in singles)
        for tag in gone:
            self._delivered.pop(tag, None)

    def _maybe_finished(self, out: Actions) -> None:
        if self._draining and not self.ledger.unconfirmed:
            self._flush(out)
            out.finished = True
