"""The index of what waits (pure): what the gateways record as messages pass them, and what
`delay-gateway pending` makes of it.

A message waits in queues the gateway cannot look into (a TTL queue hands out only its
head), so the gateways write down what they send there. Every time a consumer sends a
publisher's message on to wait (into the chain, round meditation, to the distributor, a
retry), it appends an *entry* to a waiting stream: its read time and id, routing key, due
time, size, retry attempt, properties, and until when it waits there (`until_ms`: its due
time, or the end of a meditation lap, after which it passes a gateway again and gets a new
entry). When it leaves (delivered, sent back to its queue, parked) the distributor appends
a *done* record: its key. Cancels are in the cancellations stream already.

Entries go to one of several streams by how long the message waits there (`band`): band b
holds waits up to 4^b s. A reader wants the entries of messages that may still wait:
those written since `horizon - 4^b s` in band b, where the horizon is how far back a
message may be overdue (a minute when the gateways keep up: `Horizon`). So a listing reads
what waits, and of what has passed through only a band's span plus a minute; a message
that waits for years is written once per meditation lap, and each stream keeps no more
than its span plus a margin (`RETENTION_SLACK_MS`).

A message is identified by its read time and a checksum of its routing key, properties and
body (`key_of`; two processes' read times can meet), the same wherever it is: a meditation
lap's entry and the next one's are one message, the later one wins; a redelivery after a
crash has a read time of its own, and is listed as the copy it is. One with no message id
is listed by its *handle* (`cancels.handle`), which `cancel` accepts: a cancel of a handle
cancels exactly that message.

Nothing here does I/O: gateway/broker/waiting.py reads the streams, flow.Flow writes them.
"""

import heapq
import re
import struct
from dataclasses import dataclass, field
from typing import Callable, Dict, Iterable, Iterator, List, Optional, Sequence, Set, Tuple

from topology.waiting import RETENTION_SLACK_MS, band, band_key, span_ms

from gateway.core import cancels, envelope, retries
from gateway.core.carrier import Entry
from gateway.core.wire import Properties, Table

# -- records (the streams, by band: topology/waiting.py) -------------------------------------
ENTRIES = b"DGW1"
DONE_KEYS = b"DGD1"
BEAT = b"DGB1"
# read time (us), checksum (cancels.checksum), due (ms), until (ms), body size, retry attempt
# (0: not a retry), flags, and the lengths of the message id, routing key and properties that follow
_FIXED = struct.Struct(">qIqqIHBBBI")
_COUNT = struct.Struct(">I")
_KEY = struct.Struct(">qI")
_BEAT = struct.Struct(">16sBqq")
RETRY = 1  # flags: a retry (the routing key names its queue)
HAS_ID = 2  # flags: the message has a message id
ROLE_CHECK_IN, ROLE_DISTRIBUTOR = 1, 2  # a beat's roles, as bits


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
    return _FIXED.pack(e.accepted_us, checksum(e), e.due_ms, until_ms, len(e.body), attempt, flags, len(mid_raw),
                       len(e.routing_key), len(raw)) + mid_raw + e.routing_key + raw


def pack_entries(records: Sequence[bytes]) -> bytes:
    fixed = b"".join(r[:_FIXED.size] for r in records)
    rest = b"".join(r[_FIXED.size:] for r in records)
    return ENTRIES + _COUNT.pack(len(records)) + fixed + rest


def done_key(e: Entry) -> Optional[bytes]:
    """What a done record says of one message (None: not indexed, it has no read time)."""
    return None if e.accepted_us is None else _KEY.pack(e.accepted_us, checksum(e))


def pack_done(keys: Sequence[bytes]) -> bytes:
    return DONE_KEYS + _COUNT.pack(len(keys)) + b"".join(keys)


def pack_beat(gateway: bytes, roles: int, low_ms: int, now_ms: int) -> bytes:
    """A gateway says it is alive: its roles, and the earliest due time of what it holds
    unpublished (now, when nothing)."""
    return BEAT + _BEAT.pack(gateway, roles, low_ms, now_ms)


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


def entries(body: bytes) -> Iterator[Listed]:
    """The entries of one record; nothing if it is not one (a mark, another version's)."""
    if not body.startswith(ENTRIES) or len(body) < 8:
        return
    (count,) = _COUNT.unpack_from(body, 4)
    start = 8
    end = start + count * _FIXED.size
    if end > len(body):
        return
    offset = end
    for read_us, crc, due, until, size, attempt, flags, id_len, key_len, props_len in \
            _FIXED.iter_unpack(body[start:end]):
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
    data = body[8:8 + count * _KEY.size]
    return [(read_us << 32) | crc for read_us, crc in _KEY.iter_unpack(data)] if len(data) == count * _KEY.size \
        else []


@dataclass(frozen=True)
class Beat:
    gateway: bytes
    roles: int
    low_ms: int
    at_ms: int


def beat(body: bytes) -> Optional[Beat]:
    if not body.startswith(BEAT) or len(body) != len(BEAT) + _BEAT.size:
        return None
    return Beat(*_BEAT.unpack_from(body, len(BEAT)))


# -- how far back a reader looks ---------------------------------------------------------------
GRACE_MS = 60_000  # what a message may be overdue while the gateways keep up
LIVE_MS = 20_000  # a gateway that beat within this is alive (it beats every BEAT_EVERY_MS)
BEAT_EVERY_MS = 5_000


@dataclass(frozen=True)
class Horizon:
    """How far back a message may be overdue and still wait, as a reader finds it."""

    at_ms: int
    exact: bool  # the gateways keep up: within GRACE_MS of the earliest due time they hold
    why: str  # when not: why everything kept is read


def horizon(now_ms: int, beats: Iterable[Beat], waiting: Dict[str, Tuple[int, int]]) -> Horizon:
    """From the gateways' beats and the (ready messages, consumers) of the queues where a
    message waits for a gateway (`distributor`, `returning`): every consumer of them beat
    lately and nothing waits unread there, so nothing is overdue by more than GRACE_MS past
    the earliest due time they hold. Else the reader looks as far back as the streams keep."""
    latest: Dict[bytes, Beat] = {}
    for b in beats:
        if now_ms - b.at_ms <= LIVE_MS and (b.gateway not in latest or b.at_ms > latest[b.gateway].at_ms):
            latest[b.gateway] = b
    everything = now_ms - RETENTION_SLACK_MS
    for place, role in (("distributor", ROLE_DISTRIBUTOR), ("returning", ROLE_CHECK_IN)):
        ready, consumers = waiting.get(place, (0, 0))
        alive = sum(1 for b in latest.values() if b.roles & role)
        if ready:
            return Horizon(everything, False, f"{ready} message(s) wait unread in the {place} queue")
        if consumers == 0:
            return Horizon(everything, False, f"no gateway consumes the {place} queue")
        if alive < consumers:
            return Horizon(everything, False, f"{consumers - alive} consumer(s) of the {place} queue said nothing "
                                              f"for {LIVE_MS // 1000} s (an older gateway, or one blocked)")
    low = min([now_ms] + [b.low_ms for b in latest.values()])
    return Horizon(low - GRACE_MS, True, "")


def read_from_ms(b: int, at: Horizon) -> int:
    """Where a reader starts reading band b (by the time entries were written)."""
    return at.at_ms - span_ms(b)


# -- selecting ---------------------------------------------------------------------------------
def topic_pattern(pattern: str) -> Callable[[bytes], bool]:
    """An AMQP topic pattern ('*' one word, '#' zero or more) as a test of routing keys
    (bytes), as RabbitMQ matches them: an empty key has no words."""
    words = pattern.encode("utf-8").split(b".") if pattern else []
    parts = [b"(?:\\.[^.]*)*" if w == b"#" else b"\\.[^.]*" if w == b"*" else b"\\." + re.escape(w) for w in words]
    regex = re.compile(b"".join(parts), re.DOTALL)
    # every word of the key after a dot: a pattern's word is then always "a dot and a word"
    return lambda key: regex.fullmatch(b"." + key if key else b"") is not None


@dataclass(frozen=True)
class Selection:
    """What `pending` selects: every filter given must hold."""

    ids: Tuple[bytes, ...] = ()  # exact, or a prefix where it ends with '*'; a handle ('@...') any message's
    key: Optional[str] = None  # an AMQP topic pattern on the routing key it arrives with
    due_after_ms: Optional[int] = None
    due_before_ms: Optional[int] = None
    headers: Tuple[Tuple[str, str], ...] = ()  # (name, value as text)
    retries: bool = False
    _key: Optional[Callable[[bytes], bool]] = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.key is not None:
            object.__setattr__(self, "_key", compiled(self.key))

    def __call__(self, m: Listed) -> bool:
        if self.due_after_ms is not None and m.due_ms < self.due_after_ms:
            return False
        if self.due_before_ms is not None and m.due_ms > self.due_before_ms:
            return False
        if self.retries and not m.retry:
            return False
        if self._key is not None and not self._key(m.routing_key):
            return False
        if self.ids and not any(_id_matches(i, m.handle.encode("ascii") if i.startswith(b"@") else m.ident)
                                for i in self.ids):
            return False
        if self.headers:
            table = m.properties.headers
            return all(header_matches(table, name, value) for name, value in self.headers)
        return True


def _id_matches(wanted: bytes, ident: bytes) -> bool:
    return ident.startswith(wanted[:-1]) if wanted.endswith(b"*") else ident == wanted


_COMPILED: Dict[str, Callable[[bytes], bool]] = {}


def compiled(pattern: str) -> Callable[[bytes], bool]:
    found = _COMPILED.get(pattern)
    if found is None:
        found = _COMPILED[pattern] = topic_pattern(pattern)
    return found


def header_matches(table: Table, name: str, value: str) -> bool:
    """A header's value read as text (a number as its digits, text as it is) equals `value`."""
    found = table.get(name)
    if found is None:
        return False
    if isinstance(found, bytes):
        found = found.decode("utf-8", "replace")
    if isinstance(found, bool):
        return value.lower() == str(found).lower()
    return str(found) == value


# -- the view ----------------------------------------------------------------------------------
Cancelled = Callable[[Listed], bool]


def cancelled_by(store: cancels.Store, now_ms: int) -> Cancelled:
    """Whether a cancel held in `store` cancels a listed message (the gateway's rule: by its
    message id, a cancel after it; by its handle, always)."""
    def judge(m: Listed) -> bool:
        if not len(store):
            return False
        if m.read_us in store.handle_times and store.get(m.handle.encode("ascii")) is not None:
            return True
        held = store.get(m.message_id) if m.message_id is not None else None
        if held is None:
            return False
        stamp = envelope.broker_stamp(m.properties.headers, now_ms) if not m.retry else None
        return held.cancels(cancels.Time(m.read_us, stamp))
    return judge


@dataclass
class Counts:
    """How many are due within each range (exclusive: due by then, not by the one before)."""

    ranges: List[Tuple[str, Optional[int]]]  # (label, up to ms from now; None: later)
    counts: List[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.counts = [0] * len(self.ranges)

    def add(self, due_in_ms: int) -> None:
        for i, (_, upto) in enumerate(self.ranges):
            if upto is None or due_in_ms <= upto:
                self.counts[i] += 1
                return


RANGES: Tuple[Tuple[str, Optional[int]], ...] = (
    ("overdue", 0), ("within 1 minute", 60_000), ("within 1 hour", 3_600_000), ("within 1 day", 86_400_000),
    ("within 1 week", 7 * 86_400_000), ("within 30 days", 30 * 86_400_000), ("within 1 year", 365 * 86_400_000),
    ("later", None))


class View:
    """What waits, from the entries and done records of the streams (see the module doc).

    Memory: one small int per message that waits (to know one message's entries as one), the
    messages kept for the listing (`limit` of them, soonest due first; all with limit 0),
    and the entries and done keys of the last horizon."""

    def __init__(self, now_ms: int, at: Horizon, cancelled: Cancelled, select: Callable[[Listed], bool],
                 limit: int = 0, each: Optional[Callable[[Listed], object]] = None,
                 ranges: Sequence[Tuple[str, Optional[int]]] = RANGES) -> None:
        """`limit`: keep the soonest due that many (0: all); `each`: told of every one
        instead, in no order (an export of millions keeps none); `ranges`: what to count by
        (`Counts`)."""
        self.now_ms, self.at, self.cancelled, self.select, self.limit = now_ms, at, cancelled, select, limit
        self.each = each
        self.done: Set[int] = set()
        self._current: Set[int] = set()  # keys of entries still waiting where they were written
        self._doubt: Dict[int, Listed] = {}  # entries past their until_ms: moved on, or overdue
        self._kept: List[Tuple[int, int, int, Listed]] = []  # (-due, -seq, ...) a max-heap of the soonest
        self._seq = 0
        self.total = 0
        self.counts = Counts(list(ranges))
        self.read = 0  # entries read

    def add_done(self, keys: Iterable[int]) -> None:
        self.done.update(keys)

    def add(self, m: Listed) -> None:
        self.read += 1
        k = key_of(m.read_us, m.crc)
        if m.until_ms >= self.now_ms:
            if k in self._current:
                return
            self._current.add(k)
            self._doubt.pop(k, None)
            self._consider(k, m)
        elif m.until_ms >= self.at.at_ms and k not in self._current:
            old = self._doubt.get(k)
            if old is None or m.until_ms >= old.until_ms:
                self._doubt[k] = m

    def finish(self) -> None:
        """Count the entries past their time that nothing superseded: overdue, still waiting."""
        doubt, self._doubt = self._doubt, {}
        for k, m in doubt.items():
            if k not in self._current:
                self._consider(k, m)

    def _consider(self, k: int, m: Listed) -> None:
        if k in self.done or not self.select(m) or self.cancelled(m):
            return
        self.total += 1
        self.counts.add(m.due_ms - self.now_ms)
        if self.each is not None:
            self.each(m)
            return
        self._seq += 1
        item = (-m.due_ms, -self._seq, self._seq, m)
        if not self.limit:
            self._kept.append(item)
        elif len(self._kept) < self.limit:
            heapq.heappush(self._kept, item)
        elif item > self._kept[0]:  # due sooner than the latest kept
            heapq.heapreplace(self._kept, item)

    def listed(self) -> List[Listed]:
        """The messages kept, soonest due first (first read first among equals)."""
        return [m for _, _, _, m in sorted(self._kept, key=lambda i: (-i[0], i[2]))]


# -- what a consumer records -------------------------------------------------------------------
DONE_FLUSH_MS = 250  # done keys wait this long for others to share one record


class Recorder:
    """What one consumer appends to the waiting streams (flow.Flow sends it): an entry for
    each message it sends on to wait, in the same event as the message and right after it on
    the same channel (so an entry never names a message the broker did not take before it),
    acknowledged only once both are confirmed; a done key for each message it sends on to
    leave (delivered, back to its queue, parked), within DONE_FLUSH_MS."""

    def __init__(self, bands: int, lap_ms: int) -> None:
        self.bands, self.lap_ms = bands, lap_ms
        self._entries: Dict[int, Tuple[List[int], List[bytes]]] = {}  # band -> (tags, records)
        self._done: List[bytes] = []
        self._done_by: Optional[int] = None

    def waits(self, meditation: bool, members: Iterable[Tuple[int, Optional[Entry]]], now_ms: int) -> None:
        """These messages were sent on to wait: in meditation for a lap, else until due."""
        for tag, e in members:
            if e is None or e.accepted_us is None:
                continue
            until = now_ms + self.lap_ms if meditation else e.due_ms
            tags, records = self._entries.setdefault(min(band(until - now_ms), self.bands - 1), ([], []))
            tags.append(tag)
            records.append(entry_record(e, until))

    def left(self, members: Iterable[Tuple[int, Optional[Entry]]], now_ms: int) -> None:
        for _, e in members:
            k = done_key(e) if e is not None else None
            if k is not None:
                self._done.append(k)
                if self._done_by is None:
                    self._done_by = now_ms + DONE_FLUSH_MS

    def take_entries(self) -> List[Tuple[str, List[int], bytes]]:
        """(band key, the deliveries they stand for, the record) for each band written to."""
        out = [(band_key(b), tags, pack_entries(records)) for b, (tags, records) in sorted(self._entries.items())]
        self._entries.clear()
        return out

    def take_done(self, now_ms: int, now: bool = False) -> Optional[bytes]:
        """The done record, once it has waited its time (or `now`)."""
        if not self._done or (not now and self._done_by is not None and now_ms < self._done_by):
            return None
        keys, self._done, self._done_by = self._done, [], None
        return pack_done(keys)

    def next_deadline(self) -> Optional[int]:
        return self._done_by
