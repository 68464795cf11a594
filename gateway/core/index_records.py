"""The index of what waits (pure): the records the gateways write as messages pass them, and
the recorder that writes them (what `delay-gateway pending` makes of them: listing.py).

A message waits in queues the gateway cannot look into (a TTL queue hands out only its
head), so the gateways write down what they send there. Every time a consumer sends a
publisher's message on to wait (into the chain, round meditation, to the distributor, a
retry), it appends an *entry* to a waiting stream: its read time and id, routing key, due
time, size, retry attempt, properties, and until when it waits there (`until_ms`: its due
time, or the end of a meditation lap, after which it passes a gateway again and gets a new
entry). Then, in the `done` stream:
- a *done* key when it leaves (delivered, sent back to its queue, parked, or cancelled);
- every few seconds each gateway's *beat*: its roles, how many consumers it runs of each
  kind, whether it writes entries, the earliest due time its distributor holds, and what it
  sees of the queues where messages wait for a gateway (ready messages and consumers of
  check-in and retry, the returning and the distributor queues: a passive declare each,
  which a reader with read permission only cannot make).
Done keys go out within DONE_FLUSH_MS (at once where none would join them: flow.Flow), and
the deliveries they speak of are acknowledged only once the broker confirmed them (like the
entries): a crash hands the delivery back, to be sent on and written down again, so no key
is lost with a process.

Entries go to one of several streams by how long the message waits there (topology/index_bands.py:
band b holds waits up to 4^b s). A message is identified by its read time and a checksum of
its routing key, properties and body (`key_of`; two processes' read times can meet), the
same wherever it is. One with no message id is listed by its *handle* (`cancels.handle`),
which `cancel` accepts.

Formats (never changed in place: a new one gets a new magic, and readers take every one):
entries DGW1, done keys DGD1, beats DGB1 (until 1.0), DGB2 (until the queue counts) and
DGB3. (DGW1 was once: its entries gained their checksum under the same magic, and the first
layout is told from today's by its lengths: `first_layout`.) Since 1.0 every record is signed
(the AMQP `user_id` of the gateway that wrote it: gateway/core/writers.py), which its bytes
here do not show.
"""

import struct
import zlib
from dataclasses import dataclass
from typing import Dict, Iterable, Iterator, List, Optional, Sequence, Tuple

from topology.index_bands import band, band_key

from gateway.core import cancels, retries
from gateway.core.carrier import Entry
from gateway.core.wire import Properties

ENTRIES = b"DGW1"
DONE_KEYS = b"DGD1"
BEAT = b"DGB1"
BEAT_V2 = b"DGB2"
BEAT_V3 = b"DGB3"
# read time (us), checksum (cancels.checksum), due (ms), until (ms), body size, retry attempt
# (0: not a retry), flags, and the lengths of the message id, routing key and properties that follow
FIXED = struct.Struct(">qIqqIHBBBI")
_COUNT = struct.Struct(">I")
KEY = struct.Struct(">qI")
_BEAT = struct.Struct(">16sBqq")
# gateway, roles, low, at; consumers of check-in (and retry), returning, distributor; flags
_BEAT_V2 = struct.Struct(">16sBqqHHHB")
# DGB2's, then what it saw of the queues: ready messages and consumers of check-in (and
# retry), of every returning exit and of every distributor exit (meaningful with SEEN)
_BEAT_V3 = struct.Struct(">16sBqqHHHBIIIIII")
RETRY = 1  # flags: a retry (the routing key names its queue)
HAS_ID = 2  # flags: the message has a message id
ROLE_CHECK_IN, ROLE_DISTRIBUTOR = 1, 2  # a beat's roles, as bits
INDEXES = 1  # a beat's flags: this gateway writes entries (not --no-pending-index)
SEEN = 2  # a beat's flags: it carries what the gateway saw of the queues (`Seen`)
READING = 4  # a beat's flags: its check-in holds messages it read and has not sent on yet (unlisted)
BLOCKED = 8  # a beat's flags: the broker blocks its publishes (a resource alarm)


def key_of(read_us: int, crc: int) -> int:
    """A message's identity in the index: its read time (unique within a process) and its
    checksum (cancels.checksum), which tells apart two processes' messages read in the same
    microsecond."""
    return (read_us << 32) | crc


def checksum(e: Entry) -> int:
    return cancels.checksum(e.routing_key, e.user.raw, e.body)


def entry_record(e: Entry, until_ms: int) -> bytes:
    """One entry's fixed part and its variable part, for `pack_entries`."""
    assert e.accepted_us is not None  # (callers index only messages with a read time)
    mid = e.user.get("message_id")
    mid_raw = mid.encode("utf-8") if isinstance(mid, str) else mid if isinstance(mid, bytes) else b""
    attempt = 0
    flags = HAS_ID if mid_raw else 0
    if e.exchange == "":
        flags |= RETRY
        found = e.user.headers.get(retries.ATTEMPT)
        attempt = found if isinstance(found, int) and not isinstance(found, bool) and 0 < found < 65536 else 0
    raw = e.user.raw
    return FIXED.pack(e.accepted_us, checksum(e), e.due_ms, until_ms, len(e.body), attempt, flags, len(mid_raw),
                      len(e.routing_key), len(raw)) + mid_raw + e.routing_key + raw


def pack_entries(records: Sequence[bytes]) -> bytes:
    fixed = b"".join(r[:FIXED.size] for r in records)
    rest = b"".join(r[FIXED.size:] for r in records)
    return ENTRIES + _COUNT.pack(len(records)) + fixed + rest


def done_key(e: Entry) -> Optional[bytes]:
    """What a done record says of one message (None: not indexed, no read time)."""
    return None if e.accepted_us is None else KEY.pack(e.accepted_us, checksum(e))


def by_band(entries: Iterable[Entry], bands: int, now_ms: int) -> Dict[str, bytes]:
    """Entries (each with a read time) written where nobody sent them on to wait (a move): a
    record per band of a chain of `bands`, each waiting until due (a wait longer than the top
    band's span is kept there until the message's first lap gives it an entry of its own)."""
    records: Dict[str, List[bytes]] = {}
    for e in entries:
        records.setdefault(band_key(min(band(max(0, e.due_ms - now_ms)), bands - 1)), []).append(
            entry_record(e, e.due_ms))
    return {key: pack_entries(found) for key, found in records.items()}


def pack_done(keys: Sequence[bytes]) -> bytes:
    return DONE_KEYS + _COUNT.pack(len(keys)) + b"".join(keys)


@dataclass(frozen=True)
class Consumers:
    """How many consumers a gateway runs of each kind of queue a reader asks the broker about."""

    check_in: int = 0  # check-in and retry
    returning: int = 0  # every returning exit
    distributor: int = 0  # every distributor exit


@dataclass(frozen=True)
class Place:
    """A kind of queue where messages wait for a gateway: what the broker says of it."""

    ready: int  # messages no consumer has read
    consumers: int


_COUNT_MAX = 0xFFFFFFFF


@dataclass(frozen=True)
class Seen:
    """What a gateway saw of the queues where messages wait for a gateway (a passive declare
    of each), which readers with read permission only cannot see themselves."""

    check_in: Place  # check-in and retry
    returning: Place  # every returning exit
    distributor: Place  # every distributor exit

    def places(self) -> Dict[str, Place]:
        return {"check_in": self.check_in, "returning": self.returning, "distributor": self.distributor}


def pack_beat(gateway: bytes, roles: int, low_ms: int, now_ms: int, consumers: Consumers, flags: int,
              seen: Optional[Seen] = None) -> bytes:
    """A gateway says it is alive: its roles, the earliest due time of what it holds
    unpublished (now, when nothing), its consumers, whether it writes entries, and what it
    saw of the queues (None: it could not look)."""
    counts = [min(_COUNT_MAX, max(0, n)) for p in (seen.check_in, seen.returning, seen.distributor)
              for n in (p.ready, p.consumers)] if seen is not None else [0] * 6
    flags = (flags | SEEN) if seen is not None else (flags & ~SEEN)
    return BEAT_V3 + _BEAT_V3.pack(gateway, roles, low_ms, now_ms, consumers.check_in, consumers.returning,
                                   consumers.distributor, flags, *counts)


@dataclass(frozen=True)
class Listed:
    """One message that waits, as `pending` shows it."""

    read_us: int
    crc: int  # cancels.checksum
    due_ms: int
    until_ms: int
    size: int
    retry_attempt: Optional[int]  # a retry: its attempt
    retry: bool  # a retry: the routing key is the queue it goes back to
    message_id: Optional[bytes]
    routing_key: bytes
    props: bytes  # the publisher's properties (their wire bytes)

    @property
    def key(self) -> int:
        return key_of(self.read_us, self.crc)

    @property
    def handle(self) -> str:
        return cancels.handle(self.read_us, self.crc)

    @property
    def ident(self) -> bytes:
        """What identifies it to a person: its message id, or its handle."""
        return self.message_id if self.message_id is not None else self.handle.encode("ascii")

    @property
    def properties(self) -> Properties:
        return Properties.parse(self.props)


# The first layout of an entry (written by 345936a..bc3eba0, 2026-11-25 22:28..23:01): today's
# without the checksum, under the same magic DGW1. A message's key and handle then used the
# CRC-32 of its routing key alone (`first_checksum`); its entries are read with that one, so
# that the done keys and the cancels by handle of that time still name them.
FIRST_FIXED = struct.Struct(">qqqIHBBBI")
_LENGTHS = struct.Struct(">BBI")  # the end of either fixed part: id, routing key and properties lengths
_FIRST_HEAD = struct.Struct(">4xI31xBBI")  # a record's count, and its first entry's lengths in the first layout


def first_checksum(routing_key: bytes) -> int:
    """The checksum a message had in the index's first layout: the CRC-32 of its routing key."""
    return zlib.crc32(routing_key)


def _adds_up(body: bytes, count: int, fixed: struct.Struct) -> bool:
    """Whether `count` entries with this fixed part fill the record exactly."""
    size, total = fixed.size, 8 + count * fixed.size
    if total > len(body):
        return False
    for at in range(8 + size - _LENGTHS.size, 8 + count * size, size):
        id_len, key_len, props_len = _LENGTHS.unpack_from(body, at)
        total += id_len + key_len + props_len
    return total == len(body)


def first_layout(body: bytes) -> bool:
    """Whether a DGW1 record is of the first layout (FIRST_FIXED): its lengths add up exactly
    under it, and not under today's (so no record reads under both)."""
    return entries_layout(body)[1]


def entries_layout(body: bytes) -> Tuple[int, bool]:
    """A DGW1 record's count of entries, and whether it is of the first layout (`first_layout`).
    Cheap for today's records: the lengths of its first and last entry read under the first
    layout must fit in what follows the fixed parts (for one entry: fill it), which today's
    bytes there (a message id's flag, a retry's attempt, a timestamp's bytes) almost never do."""
    if len(body) < _FIRST_HEAD.size:
        return (_COUNT.unpack_from(body, 4)[0] if len(body) >= 8 else 0), False
    count, id_len, key_len, props_len = _FIRST_HEAD.unpack_from(body)
    room = len(body) - 8 - count * FIRST_FIXED.size
    if count == 1:
        return 1, id_len + key_len + props_len == room and not _adds_up(body, 1, FIXED)
    if not count or room < 0 or id_len + key_len + props_len > room:
        return count, False
    id_len, key_len, props_len = _LENGTHS.unpack_from(body, 8 + count * FIRST_FIXED.size - _LENGTHS.size)
    return count, id_len + key_len + props_len <= room and _adds_up(body, count, FIRST_FIXED) \
        and not _adds_up(body, count, FIXED)


def first_fixed(body: bytes, count: int) -> Iterator[Tuple[int, int, int, int, int, int, int, int, int, int]]:
    """The fixed parts of a record of the first layout, as today's (with `first_checksum`)."""
    offset = 8 + count * FIRST_FIXED.size
    for read_us, due, until, size, attempt, flags, id_len, key_len, props_len in \
            FIRST_FIXED.iter_unpack(body[8:offset]):
        rk_at = offset + id_len
        offset = rk_at + key_len + props_len
        yield (read_us, first_checksum(body[rk_at:rk_at + key_len]), due, until, size, attempt, flags, id_len,
               key_len, props_len)


def entries(body: bytes) -> Iterator[Listed]:
    """The entries of one record; nothing if it is not one (a mark, another version's). A
    record of the first layout (`first_layout`) is read with its checksum (`first_checksum`)."""
    if not body.startswith(ENTRIES) or len(body) < 8:
        return
    (count,) = _COUNT.unpack_from(body, 4)
    start = 8
    first = first_layout(body)
    end = start + count * (FIRST_FIXED.size if first else FIXED.size)
    if end > len(body):
        return
    offset = end
    for read_us, crc, due, until, size, attempt, flags, id_len, key_len, props_len in \
            (first_fixed(body, count) if first else FIXED.iter_unpack(body[start:end])):
        mid = body[offset:offset + id_len] if flags & HAS_ID else None
        offset += id_len
        rk = body[offset:offset + key_len]
        offset += key_len
        props = body[offset:offset + props_len]
        offset += props_len
        if offset > len(body):
            return
        yield Listed(read_us, crc, due, until, size, attempt or None if flags & RETRY else None, bool(flags & RETRY),
                     mid, rk, props)


def done_keys(body: bytes) -> List[int]:
    """The keys (key_of) of a done record; [] if it is not one."""
    if not body.startswith(DONE_KEYS) or len(body) < 8:
        return []
    (count,) = _COUNT.unpack_from(body, 4)
    data = body[8:8 + count * KEY.size]
    return [(read_us << 32) | crc for read_us, crc in KEY.iter_unpack(data)] if len(data) == count * KEY.size \
        else []


@dataclass(frozen=True)
class Beat:
    gateway: bytes
    roles: int
    low_ms: int
    at_ms: int
    consumers: Consumers = Consumers()
    flags: int = INDEXES
    seen: Optional[Seen] = None  # what it saw of the queues (DGB3 with SEEN)
    first_layout: bool = False  # a DGB1 beat: a gateway of 0.1.0 (it takes a rule for a message)

    @property
    def indexes(self) -> bool:
        return bool(self.flags & INDEXES)

    @property
    def reading(self) -> bool:
        return bool(self.flags & READING)

    @property
    def blocked(self) -> bool:
        return bool(self.flags & BLOCKED)


def beat(body: bytes) -> Optional[Beat]:
    """A beat of any version. One before 1.0 (DGB1) does not count its consumers: it stands
    for one of each kind its roles consume, and it always wrote entries. One before the queue
    counts (DGB1, DGB2) says nothing of the queues."""
    if body.startswith(BEAT_V3) and len(body) == len(BEAT_V3) + _BEAT_V3.size:
        gateway, roles, low, at, check_in, returning, distributor, flags, *counts = \
            _BEAT_V3.unpack_from(body, len(BEAT_V3))
        seen = Seen(Place(counts[0], counts[1]), Place(counts[2], counts[3]), Place(counts[4], counts[5])) \
            if flags & SEEN else None
        return Beat(gateway, roles, low, at, Consumers(check_in, returning, distributor), flags, seen)
    if body.startswith(BEAT_V2) and len(body) == len(BEAT_V2) + _BEAT_V2.size:
        gateway, roles, low, at, check_in, returning, distributor, flags = _BEAT_V2.unpack_from(body, len(BEAT_V2))
        return Beat(gateway, roles, low, at, Consumers(check_in, returning, distributor), flags)
    if body.startswith(BEAT) and len(body) == len(BEAT) + _BEAT.size:
        gateway, roles, low, at = _BEAT.unpack_from(body, len(BEAT))
        check_in = 1 if roles & ROLE_CHECK_IN else 0
        return Beat(gateway, roles, low, at, Consumers(check_in, check_in, 1 if roles & ROLE_DISTRIBUTOR else 0),
                    first_layout=True)
    return None


LIVE_MS = 20_000  # a gateway that beat within this is alive (it beats every BEAT_EVERY_MS)
BEAT_EVERY_MS = 5_000

# -- what a consumer records -------------------------------------------------------------------
DONE_FLUSH_MS = 250  # done keys wait this long for others to share one record


class Recorder:
    """What one consumer appends to the waiting streams (flow.Flow sends it and holds the
    acknowledgements): an entry for each message it sends on to wait, in the same event as
    the message and right after it on the same channel (so an entry never names a message
    the broker did not take before it); a done key for each message it sends on to leave
    (delivered, back to its queue, parked) or drops (cancelled). With `entries` off
    (--no-pending-index) it writes no entries, but still the keys: another gateway may have
    listed the message."""

    def __init__(self, bands: int, lap_ms: int, entries: bool = True) -> None:
        self.bands, self.lap_ms, self.entries = bands, lap_ms, entries
        self._entries: Dict[int, Tuple[List[int], List[bytes]]] = {}  # band -> (tags, records)
        self._done: List[bytes] = []
        self._owed: List[int] = []  # the deliveries the keys speak of, one tag per key
        self._done_by: Optional[int] = None

    def waits(self, meditation: bool, members: Iterable[Tuple[int, Optional[Entry]]], now_ms: int) -> None:
        """These messages were sent on to wait: in meditation for a lap, else until due."""
        if not self.entries:
            return
        for tag, e in members:
            if e is None or e.accepted_us is None:
                continue
            until = now_ms + self.lap_ms if meditation else e.due_ms
            tags, records = self._entries.setdefault(min(band(until - now_ms), self.bands - 1), ([], []))
            tags.append(tag)
            records.append(entry_record(e, until))

    def left(self, members: Iterable[Tuple[int, Optional[Entry]]], now_ms: int) -> List[int]:
        """These messages left (or were dropped): the tags that now owe a done key."""
        owed: List[int] = []
        for tag, e in members:
            k = done_key(e) if e is not None else None
            if k is not None:
                self._done.append(k)
                owed.append(tag)
        self._owe(owed, now_ms)
        return owed

    def _owe(self, tags: List[int], now_ms: int) -> None:
        if tags:
            self._owed += tags
            if self._done_by is None:
                self._done_by = now_ms + DONE_FLUSH_MS

    def forget_tags(self) -> None:
        """The consuming channel is gone (its deliveries go back to their queue, and new ones
        reuse the tags): the keys are still written, for nobody's acknowledgement."""
        self._owed.clear()

    def take_entries(self) -> List[Tuple[str, List[int], bytes]]:
        """(band key, the deliveries they stand for, the record) for each band written to."""
        out = [(band_key(b), tags, pack_entries(records)) for b, (tags, records) in sorted(self._entries.items())]
        self._entries.clear()
        return out

    def take_done(self, now_ms: int, now: bool = False) -> Optional[Tuple[List[int], bytes]]:
        """(the tags that owed them, the done record), once it has waited its time (or `now`)."""
        if not self._done or (not now and self._done_by is not None and now_ms < self._done_by):
            return None
        owed, keys, self._owed, self._done, self._done_by = self._owed, self._done, [], [], None
        return owed, pack_done(keys)

    def next_deadline(self) -> Optional[int]:
        return self._done_by
