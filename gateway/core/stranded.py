"""What a distributor held when its consuming channel was lost (pure): released from memory
when the broker does not hand it back in time, and never twice by this process.

The broker hands a lost consumer's deliveries back to the queue: at once when its channel or
connection closes, or when the queue's leader sees the consumer's node down; but RabbitMQ
4.3 keeps the deliveries of a consumer whose node it cannot reach for
`consumer_disconnected_timeout` (60 s by default), in case the node comes back. The gateway
is on another node within a second, still holding each message's copy: a message due by
then waits for the broker's timeout. So the process keeps what it held (`lost`), and once
it consumes again (`resumed`) and GRACE_MS have passed without the broker handing a message
back, publishes it itself when due, as a release. A carrier handed back later brings
messages released that way: `claim` drops them (they are acknowledged, not published
again), for REMEMBER_MS after their release.

Nothing is lost (the broker keeps the original until a consumer acknowledges it, and a
message counts as released only once the broker confirmed its publish), none is early (held
on the steady clock, as flow.Flow holds), a cancel still wins (the release asks as any
other). What it can cost: a duplicate, where the broker hands the carrier to another process
after GRACE_MS, or hands it back after REMEMBER_MS.
"""

import hashlib
from collections import OrderedDict
from typing import Dict, List, Optional, Tuple

from gateway.core.actions import Forward
from gateway.core.carrier import Entry

# How long after consuming again the broker has to hand a message back, before this process
# releases it itself: on every broker but a 4.3 cluster that lost a node, what a lost channel
# held comes back at once, ahead of anything else in the queue.
GRACE_MS = 3000
# How long a message released from memory is remembered, to drop its copy when the broker
# hands it back: past RabbitMQ 4.3's default consumer_disconnected_timeout (60 s) with room
# for a node that returns later; and how many at most (the oldest are forgotten first).
REMEMBER_MS = 600_000
REMEMBER_MAX = 200_000

Key = bytes


def key_of(e: Entry) -> Key:
    """A held message's identity, the same in every copy of its carrier (16 bytes)."""
    h = hashlib.blake2b(digest_size=16)
    for part in (e.routing_key, e.user.raw, e.body):
        h.update(len(part).to_bytes(4, "big"))
        h.update(part)
    h.update(e.due_ms.to_bytes(8, "big", signed=True))
    h.update(b"" if e.exchange is None else b"\x01" + e.exchange.encode())
    return h.digest()


class Stranded:
    """One queue's held messages of lost channels (see the module doc); kept by the process
    across its connections."""

    def __init__(self) -> None:
        self._waiting: Dict[Key, Tuple[int, Forward]] = {}  # key -> (due on the steady clock, its release)
        self._sending: Dict[Key, Tuple[int, Forward]] = {}  # published, not yet confirmed
        self._released: OrderedDict[Key, int] = OrderedDict()  # key -> when (steady), oldest first
        self._resumed: Optional[int] = None  # when consuming began again (steady ms)

    def __len__(self) -> int:
        """Messages waiting to be released from memory (or confirmed)."""
        return len(self._waiting) + len(self._sending)

    def lost(self, held: List[Tuple[int, Forward]], now: int) -> None:
        """The consuming channel is gone with these held (steady due, release): the broker
        hands them back, now or later. An unconfirmed release from memory is taken back too."""
        self._resumed = None
        self._waiting.update(self._sending)
        self._sending.clear()
        for due, forward in held:
            if forward.entry is not None:
                self._waiting[key_of(forward.entry)] = (due, forward)
        self._forget(now)

    def resumed(self, now: int) -> None:
        """Consuming again (a new channel): the broker's hand-back comes first."""
        self._resumed = now

    def claim(self, e: Entry) -> bool:
        """A delivery brings this message (handed back by the broker): True when this process
        released it from memory already (drop this copy); otherwise it is no longer ours to
        release, and False."""
        if not (self._waiting or self._sending or self._released):
            return False
        k = key_of(e)
        self._waiting.pop(k, None)
        # (one being published from memory is not confirmed yet: this copy goes on too, a
        # possible duplicate rather than a loss)
        return k in self._released

    def due(self, now: int, wall: int) -> List[Forward]:
        """What to publish now (steady ms, and the wall clock's): due by both clocks, not
        handed back within GRACE_MS of consuming again; each then awaits its confirm
        (`confirmed`, or `lost` again)."""
        if not self._waiting or self._resumed is None or now < self._resumed + GRACE_MS:
            return []
        out = []
        for k, (due, forward) in list(self._waiting.items()):
            if due <= now and (forward.not_before_ms or 0) <= wall:
                del self._waiting[k]
                self._sending[k] = (due, forward)
                out.append(forward)
        return out

    def next_due(self, step: int) -> Optional[int]:
        """When `due` may return something (steady ms; `step`: the wall clock less the steady
        one), if ever without another event."""
        if not self._waiting or self._resumed is None:
            return None
        return max(self._resumed + GRACE_MS,
                   min(max(due, (f.not_before_ms or 0) - step) for due, f in self._waiting.values()))

    def confirmed(self, e: Entry, now: int) -> None:
        """The broker took its release: a copy it hands back later is dropped."""
        k = key_of(e)
        self._sending.pop(k, None)
        self._released[k] = now
        self._forget(now)

    def dropped(self, e: Entry) -> None:
        """Not released after all (cancelled, or the broker would not take it): the broker's
        copy decides."""
        k = key_of(e)
        self._waiting.pop(k, None)
        self._sending.pop(k, None)

    def clear(self) -> None:
        """Stopping: the broker hands every original back to another gateway."""
        self._waiting.clear()
        self._sending.clear()

    def _forget(self, now: int) -> None:
        released = self._released
        while released and (len(released) > REMEMBER_MAX or next(iter(released.values())) < now - REMEMBER_MS):
            released.popitem(last=False)
