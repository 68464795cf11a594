"""Cancelling scheduled messages by message id (pure: no pika, the clock passed in).

A cancel is a message published to `<prefix>.cancel`, which is bound to the check-in
queue: it queues behind every message published before it, so the order the check-in
consumer reads them in is the order the broker took them in, on every broker version,
whatever the backlog and without comparing clocks. The check-in consumer turns it into a
*record* (the id and its times) appended to the stream `<prefix>.cancellations`; every
gateway follows that stream into a `Store`.

Every message and every cancel has two times, and a comparison uses one clock only:
- its *read time* (µs): when the check-in consumer read it, strictly increasing within a
  process and started above every cancel held (`Sequencer`), so that a cancel read after a
  message has the later time, and a message read after a cancel (a reschedule) the later
  one too. Check-in fences its acknowledgements around each cancel (flow.Flow): a record
  is written only once every message before the cancel is acknowledged, so what a crash
  hands back is read again, in its first order, before the cancel behind it is recorded;
- its *arrival stamp* (ms), when the broker stamps arrivals (RabbitMQ 3.12+ with the
  interceptor: `timestamp_in_ms`), read raw from the message's headers: the broker's clock,
  the same for every reader, so several check-in consumers agree.

A message is cancelled iff a cancel held for its id came after it: by the stamps when both
have one (the same millisecond: by the read times), else by the read times. A message with
no read time (in a queue since before this version) is cancelled by any cancel held for its
id: it was accepted before any cancel could be.
"""

import base64
import struct
import zlib
from collections import deque
from dataclasses import dataclass
from typing import Deque, Dict, Optional, Tuple

from gateway.core import wire
from gateway.core.wire import Properties, Table

MAX_ID_BYTES = 255
# On a record in the stream: the id cancelled (its bytes), the cancel's read time (µs) and
# its arrival stamp (ms) if the broker stamped it.
RECORD_ID = "x-gateway-message-id"
RECORD_AT = "x-gateway-cancelled-us"
RECORD_ARRIVED = "x-gateway-cancel-arrived-ms"
# On a record a gateway appends to find the stream's end (see broker/run/cancelling.py).
RECORD_MARK = "x-gateway-mark"
# On a record a gateway appends before it hands out read times up to this (`Sequencer`).
RECORD_RESERVED = "x-gateway-reserved-us"


def checksum(routing_key: bytes, props: bytes, body: bytes) -> int:
    """What tells two messages read in the same microsecond apart (two processes' read times
    can meet): a CRC-32 of the message's routing key, properties and body."""
    return zlib.crc32(body, zlib.crc32(props, zlib.crc32(routing_key)))


def handle(read_us: int, crc: int) -> str:
    """What `delay-gateway pending` lists a message by when it has no message id, and what a
    cancel names to cancel exactly that message (any message, id or not): its read time and
    its `checksum`, as '@' and 20 letters and digits."""
    raw = _HANDLE.pack(read_us, crc)
    return "@" + base64.b32encode(raw).decode("ascii").rstrip("=").lower()


def handle_read_us(text: bytes) -> Optional[int]:
    """The read time a handle names; None if `text` is not a handle."""
    if not text.startswith(b"@") or len(text) != HANDLE_BYTES:
        return None
    try:
        raw = base64.b32decode(text[1:].upper() + b"====")
    except ValueError:
        return None
    return int(_HANDLE.unpack(raw)[0])


_HANDLE = struct.Struct(">qI")
HANDLE_BYTES = 21


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


# A gateway reserves read times this far ahead of what it hands out, and renews once it
# comes within RENEW_US of them; a new process starts OVERFLOW_US above every reservation: what
# one that could not renew handed out past its own, one µs a read (a million reads).
LEASE_US = 30_000_000
RENEW_US = 10_000_000
OVERFLOW_US = 1_000_000


class Sequencer:
    """Microseconds from a millisecond clock, strictly increasing from `floor` on: two reads
    of one process never get the same time, so the order they were read in decides.

    Started above every read time its prefix has recorded (every cancel and rule held, and
    every other process's reservation), a process reads after them even if its clock is behind
    theirs: a replacement cannot put a message after a cancel published after it. That holds
    for what a process that died had handed out too, because a process with a `ceiling` hands
    out no time above what it reserved in the stream (`wanted`, `reserved`; broker/run/
    cancelling.Follower writes them): past it, one µs a read until the reservation is renewed."""

    def __init__(self, floor: int = 0, ceiling: Optional[int] = None) -> None:
        self._last = floor
        self.ceiling = ceiling  # None: unbounded (a process that records nothing others read)

    def __call__(self, now_ms: int) -> int:
        t = max(now_ms * 1000, self._last + 1)
        if self.ceiling is not None and t > self.ceiling:
            t = max(self.ceiling, self._last + 1)
        self._last = t
        return t

    def above(self, floor: int) -> "Sequencer":
        """From now on, times above `floor` too."""
        self._last = max(self._last, floor)
        return self

    def wanted(self, now_ms: int) -> Optional[int]:
        """The reservation to record now, if the times handed out come near the ceiling."""
        if self.ceiling is None or self._last <= self.ceiling - RENEW_US:
            return None
        return max(now_ms * 1000, self._last) + LEASE_US

    def reserved(self, until_us: int) -> None:
        """A reservation was recorded (confirmed): times up to it may be handed out."""
        self.ceiling = until_us if self.ceiling is None else max(self.ceiling, until_us)


@dataclass(frozen=True)
class Time:
    """When a message or a cancel was taken in: its read time (µs), its arrival stamp (ms)."""

    read_us: int
    arrived_ms: Optional[int] = None


def after(cancel: Time, message: Time) -> bool:
    """Whether the cancel came after the message (see the module doc): one clock at a time."""
    if cancel.arrived_ms is not None and message.arrived_ms is not None and cancel.arrived_ms != message.arrived_ms:
        return cancel.arrived_ms > message.arrived_ms
    return cancel.read_us >= message.read_us


def record(message_id: bytes, at: Time) -> Properties:
    """The properties of a record (its body is empty)."""
    entries = [wire.longstr(RECORD_ID, message_id), wire.long(RECORD_AT, at.read_us)]
    if at.arrived_ms is not None:
        entries.append(wire.long(RECORD_ARRIVED, at.arrived_ms))
    return Properties.build(delivery_mode=2, headers=Table(entries))


def mark(token: bytes) -> Properties:
    return Properties.build(delivery_mode=2, headers=Table([wire.longstr(RECORD_MARK, token)]))


def reservation(until_us: int) -> Properties:
    return Properties.build(delivery_mode=2, headers=Table([wire.long(RECORD_RESERVED, until_us)]))


def read_reservation(headers: Table) -> Optional[int]:
    """The read time a reservation record reserves up to; None if it is not one."""
    until = headers.get(RECORD_RESERVED)
    return until if _integer(until) else None


def read_mark(headers: Table) -> Optional[bytes]:
    token = headers.get(RECORD_MARK)
    return token.encode("utf-8") if isinstance(token, str) else token if isinstance(token, bytes) else None


def read_record(headers: Table) -> Optional[Tuple[bytes, Time]]:
    """(id, time) of a record; None if it is not one (a mark, or not ours). The id is read
    as text or bytes: RabbitMQ 4 with the arrival stamp re-encodes a binary header as text.
    A record of an earlier version has one time, which counts as its read time."""
    mid, at, arrived = headers.get(RECORD_ID), headers.get(RECORD_AT), headers.get(RECORD_ARRIVED)
    if isinstance(mid, str):
        mid = mid.encode("utf-8")
    if isinstance(mid, bytes) and mid and _integer(at):
        return mid, Time(at, arrived if _integer(arrived) else None)
    return None


def _integer(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class Held:
    """The cancels held for one id, as much of them as any decision needs: the newest read
    time, the latest stamped cancel (by stamp, then read time), the newest unstamped one."""

    __slots__ = ("newest_read_us", "stamped", "unstamped_read_us")

    def __init__(self) -> None:
        self.newest_read_us = -1
        self.stamped: Optional[Time] = None
        self.unstamped_read_us = -1

    def add(self, at: Time) -> None:
        self.newest_read_us = max(self.newest_read_us, at.read_us)
        if at.arrived_ms is None:
            self.unstamped_read_us = max(self.unstamped_read_us, at.read_us)
        elif self.stamped is None or (at.arrived_ms, at.read_us) > (self.stamped.arrived_ms, self.stamped.read_us):
            self.stamped = at

    def cancels(self, message: Optional[Time]) -> bool:
        """Whether a cancel held came after a message taken in at this time (None: unknown)."""
        if message is None:
            return True
        if message.arrived_ms is None:
            return self.newest_read_us >= message.read_us
        return (self.stamped is not None and after(self.stamped, message)) \
            or self.unstamped_read_us >= message.read_us


class Store:
    """id -> the cancels held for it (`Held`), for the cancels of the last `window_us`.

    Memory is bounded by the cancels inside the window: `prune` forgets what is older (by
    read time). One thread adds (the stream's follower), others look up; a lookup is one
    dict read.
    """

    def __init__(self, window_ms: int) -> None:
        self.window_us = window_ms * 1000
        self._held: Dict[bytes, Held] = {}
        self._order: Deque[Tuple[int, bytes]] = deque()  # as added: (read time, id)
        # the read times the handles among the ids name (a message is looked up by its
        # handle only when its read time is one of them: cheap for all the others)
        self.handle_times: Dict[int, int] = {}
        self.added = 0
        self.newest_read_us = 0  # of every cancel held: where a new Sequencer starts

    def __len__(self) -> int:
        return len(self._held)

    def add(self, message_id: bytes, at: Time, now_ms: int) -> bool:
        """Hold a cancel; False if it is already outside the window (nothing to hold)."""
        if at.read_us < now_ms * 1000 - self.window_us:
            return False
        self.added += 1
        held = self._held.get(message_id)
        if held is None:
            held = self._held[message_id] = Held()
            named = handle_read_us(message_id)
            if named is not None:
                self.handle_times[named] = self.handle_times.get(named, 0) + 1
        held.add(at)
        self.newest_read_us = max(self.newest_read_us, at.read_us)
        self._order.append((at.read_us, message_id))
        return True

    def get(self, message_id: Optional[bytes]) -> Optional[Held]:
        return None if message_id is None else self._held.get(message_id)

    def holds(self, recorded: Dict[bytes, int]) -> bool:
        """Whether these cancels (id -> read time) are all held (or newer ones of their ids)."""
        return all((held := self._held.get(mid)) is not None and held.newest_read_us >= at
                   for mid, at in recorded.items())

    def prune(self, now_ms: int) -> int:
        """Forget cancels older than the window; how many ids were forgotten. Records come in
        about time order; one a little out of order is forgotten a little late."""
        cutoff, gone = now_ms * 1000 - self.window_us, 0
        while self._order and self._order[0][0] < cutoff:
            at, mid = self._order.popleft()
            held = self._held.get(mid)
            if held is not None and held.newest_read_us == at:
                del self._held[mid]
                gone += 1
                named = handle_read_us(mid)
                if named is not None:
                    left = self.handle_times.pop(named) - 1
                    if left:
                        self.handle_times[named] = left
        return gone

    @property
    def oldest_us(self) -> Optional[int]:
        return self._order[0][0] if self._order else None
