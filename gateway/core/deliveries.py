"""Per-consumer bookkeeping: which deliveries may be acknowledged, and what to publish when.

Pure: no pika, no clock. The consumer (consumer.Pipe) reports what happened on its two
channels, one that consumes and acknowledges and one that publishes with confirms, and
does what the answers say. The rules:

- A delivery is acknowledged only once it is *finished* (the consumer has made every
  publish it will become) and every one of those publishes is confirmed. So at every
  moment a message is owned by a queue: a crash means a redelivery, never a loss.
- Acknowledgements go out as one `multiple` ack up to the longest run of done deliveries
  from the oldest outstanding one, and single acks for done ones behind a delivery still
  in progress. A `multiple` ack never covers a delivery that is not done.
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

from collections import deque
from dataclasses import dataclass, field
from typing import Any, Deque, Dict, Iterable, List, Optional, Set, Tuple


@dataclass
class Publication:
    tags: Tuple[int, ...]  # the deliveries it stands for
    payload: Any  # what to publish (opaque here)
    seq: int = 0  # the channel's publish sequence number, once sent
    refused: int = 0  # how often the broker refused it (basic.nack)
    returned: bool = False  # came back unroutable
    parking: bool = False  # it is already a parked copy
    sent_ms: int = 0  # when it was sent (set by the consumer, which has the clock)


@dataclass
class Outcome:
    """What the consumer must do after an event: publish these, in order (each with its
    sequence number assigned), and handle these."""

    send: List[Publication] = field(default_factory=list)
    refused: List[Publication] = field(default_factory=list)  # retry later (`retry`)
    returned: List[Publication] = field(default_factory=list)  # publish a parked copy instead
    guilty: List[Publication] = field(default_factory=list)  # refused by the broker: park it
    reject: List[int] = field(default_factory=list)  # nack without requeue: the broker dead-letters them


@dataclass
class _Delivery:
    finished: bool = False
    pending: int = 0  # publishes made for it and not yet confirmed
    holds: int = 0  # its messages held until their time (a carrier holds several)
    done: bool = False


class Deliveries:
    def __init__(self) -> None:
        self._deliveries: Dict[int, _Delivery] = {}  # outstanding, in delivery order
        self._done: Set[int] = set()  # outstanding and done: to acknowledge
        self._inflight: Dict[int, Publication] = {}  # seq -> sent, not yet confirmed
        self._waiting: Deque[Publication] = deque()  # to send when the channel allows
        self._suspects: Deque[Publication] = deque()  # to send one at a time
        self._isolated: Optional[Publication] = None  # the one suspect on the channel
        self._seq = 0
        self._open = False
        self.held = 0  # messages held until their time (a gauge)

    # -- queries --------------------------------------------------------------------------
    def __contains__(self, tag: int) -> bool:
        return tag in self._deliveries

    def __len__(self) -> int:
        return len(self._deliveries)

    @property
    def unconfirmed(self) -> int:
        return len(self._inflight)

    @property
    def unsent(self) -> int:
        return len(self._waiting) + len(self._suspects)

    def inflight(self) -> List[Publication]:
        """Sent and not yet confirmed, in the order sent."""
        return list(self._inflight.values())

    def oldest_unconfirmed(self) -> Optional[Publication]:
        return next(iter(self._inflight.values()), None)

    def held_tags(self) -> List[int]:
        return [t for t, d in self._deliveries.items() if d.holds]

    # -- deliveries -----------------------------------------------------------------------
    def received(self, tag: int) -> None:
        if tag in self._deliveries:
            raise ValueError(f"delivery {tag} is already outstanding")
        self._deliveries[tag] = _Delivery()

    def hold(self, tag: int) -> None:
        """One of its messages waits for its time."""
        self._deliveries[tag].holds += 1
        self.held += 1

    def release(self, tag: int) -> bool:
        """A hold is over; False if the delivery is no longer outstanding (a stale timer)."""
        d = self._deliveries.get(tag)
        if d is None or not d.holds:
            return False
        d.holds -= 1
        self.held -= 1
        return True

    def finish(self, tag: int) -> None:
        """No more publishes will be made for this delivery."""
        d = self._deliveries[tag]
        d.finished = True
        self._settle(tag, d)

    def reject(self, tag: int) -> None:
        """The consumer hands it back (requeue) or gives it up (dead-letter): it is gone."""
        d = self._deliveries.pop(tag)
        self._done.discard(tag)
        self.held -= d.holds

    def acks(self) -> Tuple[Optional[int], List[int], List[int]]:
        """(acknowledge every tag up to this one with `multiple`, these singly, and all the
        tags so acknowledged); they are no longer outstanding afterwards."""
        last, gone = None, []
        for tag, d in self._deliveries.items():
            if not d.done:
                break
            last = tag
            gone.append(tag)
        for tag in gone:
            del self._deliveries[tag]
            self._done.discard(tag)
        singles = sorted(self._done)
        for tag in singles:
            del self._deliveries[tag]
        self._done.clear()
        return last, singles, gone + singles

    @property
    def done_count(self) -> int:
        """Deliveries done and not yet acknowledged."""
        return len(self._done)

    def _settle(self, tag: int, d: _Delivery) -> None:
        if d.finished and d.pending == 0 and not d.holds and not d.done:
            d.done = True
            self._done.add(tag)

    # -- publishes ------------------------------------------------------------------------
    def publish(self, tags: Tuple[int, ...], payload: Any, finishing: Optional[Iterable[int]] = None,
                parking: bool = False) -> Outcome:
        """Publish `payload` for these deliveries; for those in `finishing` (default: all) it
        is the last publish they will become."""
        for tag in tags:
            self._deliveries[tag].pending += 1
        for tag in (tags if finishing is None else finishing):
            self._deliveries[tag].finished = True
        self._waiting.append(Publication(tuple(tags), payload, parking=parking))
        return Outcome(send=self._pump())

    def retry(self, pub: Publication) -> Outcome:
        """Send a refused publication again (its deliveries still wait for it)."""
        if not all(t in self._deliveries for t in pub.tags):
            return Outcome()  # its deliveries were lost with the channel meanwhile
        self._waiting.append(pub)
        return Outcome(send=self._pump())

    def returned(self, seq: int) -> None:
        pub = self._inflight.get(seq)
        if pub is not None:
            pub.returned = True

    def confirmed(self, seq: int, multiple: bool, ack: bool) -> Outcome:
        pubs = self._take(seq, multiple)
        out = Outcome()
        for pub in pubs:
            if self._isolated is pub:
                self._isolated = None
            if not ack:
                pub.refused += 1
                out.refused.append(pub)
                continue
            returned = pub.returned and not pub.parking
            if returned:
                out.returned.append(pub)  # the consumer publishes a parked copy for its tags
            for tag in pub.tags:
                d = self._deliveries.get(tag)
                if d is None:
                    continue
                d.pending -= 1
                if not returned:
                    self._settle(tag, d)
        out.send = self._pump()
        return out

    def _take(self, seq: int, multiple: bool) -> List[Publication]:
        if not multiple:
            pub = self._inflight.pop(seq, None)
            return [pub] if pub else []
        taken = [s for s in self._inflight if s <= seq]
        return [self._inflight.pop(s) for s in taken]

    # -- the publishing channel -----------------------------------------------------------
    def channel_open(self) -> Outcome:
        self._open = True
        self._seq = 0  # a new channel numbers its publishes from 1
        return Outcome(send=self._pump())

    def channel_closed(self) -> Outcome:
        """The broker closed the publishing channel (the connection is still open)."""
        self._open = False
        out = Outcome()
        inflight = sorted(self._inflight.values(), key=lambda p: p.seq)
        self._inflight.clear()
        self._isolated = None
        if len(inflight) == 1:
            pub = inflight[0]
            if pub.parking:  # even its parked copy is refused: let the broker dead-letter it
                out.reject.extend(t for t in pub.tags if t in self._deliveries)
                for tag in out.reject:
                    self.reject(tag)
            else:
                for tag in pub.tags:
                    if tag in self._deliveries:
                        self._deliveries[tag].pending -= 1
                out.guilty.append(pub)
        else:
            self._suspects.extendleft(reversed(inflight))
        return out

    def _pump(self) -> List[Publication]:
        if not self._open or self._isolated is not None:
            return []
        if self._suspects:
            pub = self._suspects.popleft()
            self._isolated = pub
            return [self._send(pub)]
        sent = [self._send(p) for p in self._waiting]
        self._waiting.clear()
        return sent

    def _send(self, pub: Publication) -> Publication:
        self._seq += 1
        pub.seq = self._seq
        pub.returned = False
        self._inflight[pub.seq] = pub
        return pub

    # -- the consuming channel ------------------------------------------------------------
    def lost(self) -> Set[int]:
        """The consuming channel is gone: its deliveries return to the queue by themselves.
        Returns the tags that were held (to cancel their timers)."""
        held = set(self.held_tags())
        self._deliveries.clear()
        self._done.clear()
        self._inflight.clear()
        self._waiting.clear()
        self._suspects.clear()
        self._isolated = None
        self.held = 0
        self._open = False
        return held
