"""Cancelling scheduled messages by message id (pure: no pika, the clock passed in).

A cancel is a message published to `<prefix>.cancel`, which is bound to the check-in
queue: it queues behind every message published before it, so the order the check-in
consumer reads them in is the order the broker took them in, on every broker version,
whatever the backlog and without comparing clocks. The check-in consumer turns it into a
*record* (the id and its time) appended to the stream `<prefix>.cancellations`; every
gateway follows that stream into a `Store`.

Times are microseconds. A message's time (`accepted_us`) and a cancel's are the broker's
arrival stamp when it has one (RabbitMQ 3.12+ with the interceptor: `timestamp_in_ms`),
else the moment the check-in consumer read it, made strictly increasing within the
process (`Sequencer`) so that a cancel read after a message always has the later time,
and a message read after a cancel (a reschedule) the later one too.

A message is cancelled iff a cancel for its id has a time >= the message's. A message
with no time (in a queue since before this version) is cancelled by any cancel held for
its id: it was accepted before any cancel could be.
"""

from collections import deque
from typing import Deque, Dict, Optional, Tuple

from gateway.core import wire
from gateway.core.envelope import arrival_stamp
from gateway.core.wire import Properties, Table

MAX_ID_BYTES = 255
# On a record in the stream: the id cancelled (its bytes) and the cancel's time (µs).
RECORD_ID = "x-gateway-message-id"
RECORD_AT = "x-gateway-cancelled-us"
# On a record a gateway appends to find the stream's end (see broker/cancelling.py).
RECORD_MARK = "x-gateway-mark"
# Outcome label of the publish that records a cancel (metrics).
RECORDED = "cancel"


class BadCancel(ValueError):
    """A cancel that cannot be recorded; it is parked with this reason."""


def checked_id(message_id: object) -> bytes:
    """The id a cancel names, as bytes. Raises BadCancel."""
    if message_id is None:
        raise BadCancel("a cancel needs the id of the message to cancel as its message_id property")
    raw = message_id.encode("utf-8") if isinstance(message_id, str) else message_id
    if not isinstance(raw, bytes):
        raise BadCancel(f"a cancel's message_id must be text, not {type(message_id).__name__}")
    if not raw:
        raise BadCancel("a cancel's message_id is empty: give the id of the message to cancel")
    if len(raw) > MAX_ID_BYTES:
        raise BadCancel(f"message id of {len(raw)} bytes: at most {MAX_ID_BYTES} (AMQP's message_id)")
    return raw


class Sequencer:
    """Microseconds from a millisecond clock, strictly increasing: two reads of one process
    never get the same time, so the order they were read in decides."""

    def __init__(self) -> None:
        self._last = 0

    def __call__(self, now_ms: int) -> int:
        self._last = max(now_ms * 1000, self._last + 1)
        return self._last


def stamp_us(headers: Table, now_ms: int, sequence: Sequencer) -> int:
    """A publisher's message's or a cancel's time: the broker's arrival stamp, if there is a
    plausible one, else the next time of this reader."""
    stamp = arrival_stamp(headers, now_ms)
    return sequence(now_ms) if stamp is None else stamp * 1000


def record(message_id: bytes, at_us: int) -> Properties:
    """The properties of a record (its body is empty)."""
    return Properties.build(delivery_mode=2, headers=Table([wire.longstr(RECORD_ID, message_id),
                                                            wire.long(RECORD_AT, at_us)]))


def mark(token: bytes) -> Properties:
    return Properties.build(delivery_mode=2, headers=Table([wire.longstr(RECORD_MARK, token)]))


def read_mark(headers: Table) -> Optional[bytes]:
    token = headers.get(RECORD_MARK)
    return token.encode("utf-8") if isinstance(token, str) else token if isinstance(token, bytes) else None


def read_record(headers: Table) -> Optional[Tuple[bytes, int]]:
    """(id, time) of a record; None if it is not one (a mark, or not ours). The id is read
    as text or bytes: RabbitMQ 4 with the arrival stamp re-encodes a binary header as text."""
    mid, at = headers.get(RECORD_ID), headers.get(RECORD_AT)
    if isinstance(mid, str):
        mid = mid.encode("utf-8")
    if isinstance(mid, bytes) and mid and isinstance(at, int) and not isinstance(at, bool):
        return mid, at
    return None


def cancelled(cancel_us: Optional[int], accepted_us: Optional[int]) -> bool:
    """The decision: a cancel held (its time) against a message's time (None: unknown, old)."""
    return cancel_us is not None and (accepted_us is None or cancel_us >= accepted_us)


class Store:
    """id -> the latest cancel's time, for the cancels of the last `window_us`.

    Memory is bounded by the cancels inside the window: `prune` forgets what is older. One
    thread adds (the stream's follower), others look up; a lookup is one dict read.
    """

    def __init__(self, window_ms: int) -> None:
        self.window_us = window_ms * 1000
        self._latest: Dict[bytes, int] = {}
        self._order: Deque[Tuple[int, bytes]] = deque()  # as added: (time, id)
        self.added = 0

    def __len__(self) -> int:
        return len(self._latest)

    def add(self, message_id: bytes, at_us: int, now_ms: int) -> bool:
        """Hold a cancel; False if it is already outside the window (nothing to hold)."""
        if at_us < now_ms * 1000 - self.window_us:
            return False
        self.added += 1
        if at_us > self._latest.get(message_id, -1):
            self._latest[message_id] = at_us
        self._order.append((at_us, message_id))
        return True

    def get(self, message_id: Optional[bytes]) -> Optional[int]:
        return None if message_id is None else self._latest.get(message_id)

    def prune(self, now_ms: int) -> int:
        """Forget cancels older than the window; how many were forgotten. Records come in
        about time order; one a little out of order is forgotten a little late."""
        cutoff, gone = now_ms * 1000 - self.window_us, 0
        while self._order and self._order[0][0] < cutoff:
            at, mid = self._order.popleft()
            if self._latest.get(mid) == at:
                del self._latest[mid]
                gone += 1
        return gone

    @property
    def oldest_us(self) -> Optional[int]:
        return self._order[0][0] if self._order else None
