"""Per-consumer bookkeeping: which deliveries may be acknowledged, and what to publish when.

Pure: no pika, no clock. The consumer's core (flow.Flow) reports what happened on its two
channels, one that consumes and acknowledges and one that publishes with confirms
(confirms.Window), and does what the answers say. The rules:

- A delivery is acknowledged only once it is *finished* (the consumer has made every
  publish it will become) and every one of those publishes is confirmed. So at every
  moment a message is owned by a queue: a crash means a redelivery, never a loss.
- Acknowledgements go out as one `multiple` ack up to the longest run of done deliveries
  from the oldest outstanding one, and single acks for done ones behind a delivery still
  in progress. A `multiple` ack never covers a delivery that is not done.
- A *fence* (a cancel, at check-in) orders acknowledgements around it: it is acknowledged
  only after every delivery before it, and no delivery after it is acknowledged before it.
  With RabbitMQ's redelivery order (what a dead consumer held comes back in the order it
  was first delivered, before anything newer: verified on 3.10 and 4.3, classic and
  quorum), what a crash hands back is read again in its first order around every cancel.
- A delivery that records will speak of (the index's done keys, published a little later
  for company) is acknowledged only once they are published and confirmed too.
- Every delivery ends exactly once: acknowledged, or rejected (handed back or dead-lettered).
- A publish the broker refuses (basic.nack) is handed back to be retried later.
- A publish that comes back unroutable (basic.return, mandatory) is reported when its
  confirm arrives, so the consumer can publish a parked copy instead.
- If the broker closes the publishing channel, the publishes it had not confirmed are sent
  again one at a time, each alone on the channel until confirmed, and nothing else is sent
  meanwhile. A publish that was alone on the channel when the broker closed it is *guilty*:
  the broker refuses that message; it is handed back to be parked (and if its parking is
  refused too, the delivery is rejected, so the broker dead-letters it). One message the
  broker refuses therefore costs one or two channel closes, never a loop, and no other
  message is handed back to its queue.
"""

from dataclasses import dataclass
from typing import Dict, Generic, Iterable, List, Mapping, Optional, Sequence, Set, Tuple, TypeVar

from gateway.core.carrier import Holds
from gateway.core.confirms import Outcome, P, Publication, Window

H = TypeVar("H")  # a message held until its time (opaque here)

__all__ = ["Deliveries", "Outcome", "Publication"]


@dataclass
class _Delivery:
    finished: bool = False
    pending: int = 0  # publishes made for it and not yet confirmed
    holds: int = 0  # its messages among the held ones (a carrier holds several)
    fence: bool = False  # acknowledged in order (see the module doc)
    owed: int = 0  # records that speak of it, not yet published (the index's done keys)


class Deliveries(Generic[P, H]):
    """The outstanding deliveries of one consuming channel, the messages of theirs held
    until their time, and the publishes they became."""

    def __init__(self) -> None:
        self._deliveries: Dict[int, _Delivery] = {}  # outstanding, in delivery order
        self._done: Set[int] = set()  # outstanding and done: to acknowledge
        self._fences = 0  # outstanding fences
        self._holds: Holds[int, H] = Holds()  # a delivery's message, due at its time
        self._behind: Holds[int, H] = Holds()  # overdue ones waiting for the catch-up's pace (catch_up.py)
        self._holding = 0  # deliveries with a message held: each keeps a place of the prefetch
        self._window: Window[P] = Window()

    # -- queries --------------------------------------------------------------------------
    def __contains__(self, tag: int) -> bool:
        return tag in self._deliveries

    def __len__(self) -> int:
        return len(self._deliveries)

    @property
    def held(self) -> int:
        """Messages held until their time, overdue ones waiting for the catch-up's pace too."""
        return len(self._holds) + len(self._behind)

    @property
    def behind(self) -> int:
        """Overdue messages waiting for the catch-up's pace."""
        return len(self._behind)

    @property
    def holding(self) -> int:
        """Deliveries with a message held until its time (each one counts against the
        consumer's prefetch until its last message is released)."""
        return self._holding

    def next_due(self) -> Optional[int]:
        """When the first held message is due, if any (on the clock the holds were given in:
        flow.Flow holds on a steady clock); overdue ones waiting for the pace not counted."""
        return self._holds.next_due()

    def first_due(self) -> Optional[int]:
        """When the first held message is due, overdue ones waiting for the pace counted."""
        due, behind = self._holds.next_due(), self._behind.next_due()
        return behind if due is None or (behind is not None and behind < due) else due

    @property
    def fences(self) -> int:
        """Fences not yet acknowledged."""
        return self._fences

    @property
    def unconfirmed(self) -> int:
        return self._window.unconfirmed

    @property
    def unsent(self) -> int:
        return self._window.unsent

    def inflight(self) -> List[Publication[P]]:
        """Sent and not yet confirmed, in the order sent."""
        return self._window.inflight()

    def not_confirmed(self) -> List[Publication[P]]:
        """Every publication the broker has not confirmed (sent or not)."""
        return self._window.unconfirmed_all()

    def waiting_for_confirm_ms(self, now_ms: int) -> int:
        """How long the oldest publish not yet confirmed has been waiting (0: none)."""
        pub = self._window.oldest()
        return now_ms - pub.sent_ms if pub is not None else 0

    # -- deliveries -----------------------------------------------------------------------
    def received(self, tag: int, fence: bool = False) -> None:
        if tag in self._deliveries:
            raise ValueError(f"delivery {tag} is already outstanding")
        self._deliveries[tag] = _Delivery(fence=fence)
        self._fences += fence

    def settled_before(self, tag: int) -> bool:
        """Whether every delivery before this one that is not a fence is acknowledged."""
        for t, d in self._deliveries.items():
            if t >= tag:
                return True
            if not d.fence:
                return False
        return True

    def hold(self, tag: int, due_ms: int, message: H) -> None:
        """One of its messages waits until `due_ms`."""
        d = self._deliveries[tag]
        d.holds += 1
        self._holding += d.holds == 1
        self._holds.add(due_ms, tag, message)

    def hold_behind(self, tag: int, due_ms: int, message: H) -> None:
        """One of its messages is overdue and waits for the catch-up's pace (`take_behind`)."""
        d = self._deliveries[tag]
        d.holds += 1
        self._holding += d.holds == 1
        self._behind.add(due_ms, tag, message)

    def take_behind(self, count: int) -> List[Tuple[int, H]]:
        """Up to `count` of the overdue messages, most overdue first, no longer held."""
        return self._released(self._behind.first(count))

    def due(self, now_ms: int) -> List[Tuple[int, H]]:
        """The held messages whose time has come, in due order, no longer held."""
        return self._released(self._holds.due(now_ms))

    def drain_holds(self) -> List[Tuple[int, H]]:
        """Every held message, overdue ones first, then in due order, no longer held (stopping)."""
        return self._released(self._behind.drain() + self._holds.drain())

    def _released(self, held: List[Tuple[int, H]]) -> List[Tuple[int, H]]:
        for tag, _ in held:
            d = self._deliveries[tag]
            d.holds -= 1
            self._holding -= d.holds == 0
        return held

    def owe(self, tags: Iterable[int]) -> None:
        """A record to be published later will speak of each of these (once per tag given)."""
        for tag in tags:
            d = self._deliveries.get(tag)
            if d is not None:
                d.owed += 1

    def pay(self, counts: Mapping[int, int]) -> None:
        """The records owed were published now, for these deliveries (tag -> how many owed).
        They were published for them (`publish`), so none can settle before their confirms."""
        for tag, n in counts.items():
            d = self._deliveries.get(tag)
            if d is not None:
                d.owed = max(0, d.owed - n)
                self._settle(tag, d)

    def finish(self, tag: int) -> None:
        """No more publishes will be made for this delivery."""
        d = self._deliveries[tag]
        d.finished = True
        self._settle(tag, d)

    def reject(self, tag: int) -> None:
        """The consumer hands it back (requeue) or gives it up (dead-letter): it is gone, and
        none of its held messages will be released."""
        d = self._deliveries.pop(tag)
        self._fences -= d.fence
        if d.holds:
            self._holds.discard(tag)
            self._behind.discard(tag)
            self._holding -= 1
        self._done.discard(tag)

    def acks(self) -> Tuple[Optional[int], List[int], List[int]]:
        """(acknowledge every tag up to this one with `multiple`, these singly, and all the
        tags so acknowledged); they are no longer outstanding afterwards. Done deliveries
        behind a fence that is not acknowledged yet wait for it."""
        last, gone = None, []
        for tag in self._deliveries:
            if tag not in self._done:
                break
            last = tag
            gone.append(tag)
        for tag in gone:
            self._fences -= self._deliveries.pop(tag).fence
            self._done.discard(tag)
        if self._fences:
            singles = []
            for tag, d in self._deliveries.items():
                if d.fence:
                    break  # a fence behind anything outstanding waits, and all after it
                if tag in self._done:
                    singles.append(tag)
        else:
            singles = sorted(self._done)
        for tag in singles:
            del self._deliveries[tag]
            self._done.discard(tag)
        return last, singles, gone + singles

    @property
    def done_count(self) -> int:
        """Deliveries done and not yet acknowledged."""
        return len(self._done)

    def _settle(self, tag: int, d: _Delivery) -> None:
        if d.finished and d.pending == 0 and not d.holds and not d.owed:
            self._done.add(tag)

    # -- publishes ------------------------------------------------------------------------
    def publish(self, tags: Tuple[int, ...], payload: P, finishing: Optional[Iterable[int]] = None,
                parking: bool = False, side: bool = False) -> Outcome[P]:
        """Publish `payload` for these deliveries; for those in `finishing` (default: all) it
        is the last publish they will become. A `side` record (confirms.Publication) is
        dropped if the broker will not take it."""
        for tag in tags:
            self._deliveries[tag].pending += 1
        for tag in (tags if finishing is None else finishing):
            self._deliveries[tag].finished = True
        return self._window.add(Publication(tuple(tags), payload, parking=parking, side=side))

    def publish_each(self, items: Sequence[Tuple[int, P, bool, bool]]) -> Outcome[P]:
        """`publish` for each (tag, payload, finishing, parking), in order, in one answer: the
        releases of one event, each one message of one delivery (a carrier's, often the same)."""
        pubs = []
        for tag, payload, finishing, parking in items:
            d = self._deliveries[tag]
            d.pending += 1
            if finishing:
                d.finished = True
            pubs.append(Publication((tag,), payload, parking=parking))
        return self._window.add_all(pubs)

    def retry(self, pub: Publication[P]) -> Outcome[P]:
        """Send a refused publication again (its deliveries still wait for it)."""
        if not all(t in self._deliveries for t in pub.tags):
            return Outcome()  # its deliveries were lost with the channel meanwhile
        return self._window.add(pub)

    def returned(self, seq: int) -> None:
        self._window.returned(seq)

    def confirmed(self, seq: int, multiple: bool, ack: bool) -> Outcome[P]:
        out = self._window.confirmed(seq, multiple, ack)
        # A delivery with a publish returned here is not done, even if this confirm covers
        # all its others: the parked copy the consumer makes next is still to come.
        returned = {tag for pub in out.returned for tag in pub.tags}
        for pub in out.confirmed:
            for tag in pub.tags:
                d = self._deliveries.get(tag)
                if d is None:
                    continue
                d.pending -= 1
                if tag not in returned:
                    self._settle(tag, d)
        return out

    # -- the publishing channel -----------------------------------------------------------
    def channel_open(self) -> Outcome[P]:
        return self._window.open()

    def channel_gone(self) -> None:
        """The publishing channel closed for good (the connection or the consumer is ending)."""
        self._window.shut()

    def channel_closed(self) -> Outcome[P]:
        """The broker closed the publishing channel (the connection is still open)."""
        out = self._window.closed()
        for pub in out.guilty:
            if pub.side:  # a record the broker refuses: without it, as if confirmed
                out.dropped.append(pub)
                for tag in pub.tags:
                    d = self._deliveries.get(tag)
                    if d is not None:
                        d.pending -= 1
                        self._settle(tag, d)
            elif pub.parking:  # even its parked copy is refused: let the broker dead-letter it
                out.reject.extend(t for t in pub.tags if t in self._deliveries)
                for tag in out.reject:
                    self.reject(tag)
            else:
                for tag in pub.tags:
                    if tag in self._deliveries:
                        self._deliveries[tag].pending -= 1
        out.guilty = [p for p in out.guilty if not p.parking and not p.side]
        return out

    # -- the consuming channel ------------------------------------------------------------
    def lost(self) -> None:
        """The consuming channel is gone: its deliveries return to the queue by themselves,
        and none of their held messages will be released."""
        self._deliveries.clear()
        self._holds.drain()
        self._behind.drain()
        self._holding = 0
        self._done.clear()
        self._fences = 0
        self._window.forget()
