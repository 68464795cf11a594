"""The publishing channel's side of a consumer (pure): sequence numbers, publishes sent and
not yet confirmed, and the one-at-a-time resending after the broker closed the channel.

Publisher confirms number a channel's publishes from 1; a confirm (basic.ack or basic.nack,
possibly `multiple`) settles every publish up to its number. When the broker closes the
channel over one message it refuses, the publishes it had not confirmed are *suspects*:
they are sent again one at a time, each alone on the new channel until confirmed, so that
the next close names the guilty one (deliveries.Deliveries says what that means for the
deliveries they stand for).
"""

from collections import deque
from dataclasses import dataclass, field
from typing import Deque, Dict, Generic, List, Optional, Tuple, TypeVar

P = TypeVar("P")  # what a publication carries (opaque here)


@dataclass(eq=False)
class Publication(Generic[P]):
    tags: Tuple[int, ...]  # the deliveries it stands for
    payload: P  # what to publish
    seq: int = 0  # the channel's publish sequence number, once sent
    refused: int = 0  # how often the broker refused it (basic.nack)
    returned: bool = False  # came back unroutable
    parking: bool = False  # it is already a parked copy
    # A record beside the messages (the index of what waits): returned or refused by the
    # broker, it is dropped, and its deliveries go on as if it had been confirmed.
    side: bool = False
    sent_ms: int = 0  # when it was sent (set by whoever has the clock)


@dataclass
class Outcome(Generic[P]):
    """The confirm window's answer to one call, for the core (flow.Flow) and never for the
    adapter: the publications to send now, in order (each with its sequence number
    assigned), and the ones the broker settled, sorted by how. The core decides what each
    means for its deliveries (an ack, a retry, a parked copy) and says so in `effects.Effects`."""

    send: List[Publication[P]] = field(default_factory=list)
    refused: List[Publication[P]] = field(default_factory=list)  # retry later (`retry`)
    returned: List[Publication[P]] = field(default_factory=list)  # publish a parked copy instead
    guilty: List[Publication[P]] = field(default_factory=list)  # refused by the broker: park it
    reject: List[int] = field(default_factory=list)  # nack without requeue: the broker dead-letters them
    confirmed: List[Publication[P]] = field(default_factory=list)  # acknowledged by the broker
    dropped: List[Publication[P]] = field(default_factory=list)  # side records the broker would not take

    @property
    def settled(self) -> bool:
        """Whether any publication was settled (anything but `send`)."""
        return bool(self.confirmed or self.refused or self.returned or self.guilty or self.reject or self.dropped)


class Window(Generic[P]):
    def __init__(self) -> None:
        self._inflight: Dict[int, Publication[P]] = {}  # seq -> sent, not yet confirmed
        self._waiting: Deque[Publication[P]] = deque()  # to send when the channel allows
        self._suspects: Deque[Publication[P]] = deque()  # to send one at a time
        self._isolated: Optional[Publication[P]] = None  # the one suspect on the channel
        self._seq = 0
        self._open = False

    @property
    def unconfirmed(self) -> int:
        return len(self._inflight)

    @property
    def unsent(self) -> int:
        return len(self._waiting) + len(self._suspects)

    def inflight(self) -> List[Publication[P]]:
        return list(self._inflight.values())

    def unconfirmed_all(self) -> List[Publication[P]]:
        """Every publication not confirmed: sent, waiting to be sent, or suspected."""
        return [*self._inflight.values(), *self._waiting, *self._suspects]

    def oldest(self) -> Optional[Publication[P]]:
        return next(iter(self._inflight.values()), None)

    def add(self, pub: Publication[P]) -> Outcome[P]:
        self._waiting.append(pub)
        return Outcome(send=self._pump())

    def add_all(self, pubs: List[Publication[P]]) -> Outcome[P]:
        """`add` for each, in order, in one answer."""
        self._waiting.extend(pubs)
        return Outcome(send=self._pump())

    def returned(self, seq: int) -> None:
        pub = self._inflight.get(seq)
        if pub is not None:
            pub.returned = True

    def confirmed(self, seq: int, multiple: bool, ack: bool) -> Outcome[P]:
        out: Outcome[P] = Outcome()
        for pub in self._take(seq, multiple):
            if self._isolated is pub:
                self._isolated = None
            if not ack:
                pub.refused += 1
                out.refused.append(pub)
                continue
            if pub.returned and pub.side:
                out.dropped.append(pub)
            elif pub.returned and not pub.parking:
                out.returned.append(pub)  # the consumer publishes a parked copy for its tags
            out.confirmed.append(pub)
        out.send = self._pump()
        return out

    def _take(self, seq: int, multiple: bool) -> List[Publication[P]]:
        if not multiple:
            pub = self._inflight.pop(seq, None)
            return [pub] if pub else []
        # In sequence order (each is added above the others: `open` starts from 1 again only
        # once every one of the old channel is settled), so the first above `seq` ends it: a
        # confirm costs what it settles, not the whole window.
        taken = []
        for s in self._inflight:
            if s > seq:
                break
            taken.append(s)
        return [self._inflight.pop(s) for s in taken]

    def open(self) -> Outcome[P]:
        self._open = True
        self._seq = 0  # a new channel numbers its publishes from 1
        return Outcome(send=self._pump())

    def shut(self) -> None:
        self._open = False

    def closed(self) -> Outcome[P]:
        """The broker closed the channel: one publish alone on it is guilty (in `guilty`,
        parked copies included); several become suspects."""
        self._open = False
        out: Outcome[P] = Outcome()
        inflight = sorted(self._inflight.values(), key=lambda p: p.seq)
        self._inflight.clear()
        self._isolated = None
        if len(inflight) == 1:
            out.guilty.append(inflight[0])
        else:
            self._suspects.extendleft(reversed(inflight))
        return out

    def forget(self) -> None:
        self._inflight.clear()
        self._waiting.clear()
        self._suspects.clear()
        self._isolated = None
        self._open = False

    def _pump(self) -> List[Publication[P]]:
        if not self._open or self._isolated is not None:
            return []
        if self._suspects:
            pub = self._suspects.popleft()
            self._isolated = pub
            return [self._send(pub)]
        sent = [self._send(p) for p in self._waiting]
        self._waiting.clear()
        return sent

    def _send(self, pub: Publication[P]) -> Publication[P]:
        self._seq += 1
        pub.seq = self._seq
        pub.returned = False
        self._inflight[pub.seq] = pub
        return pub
