"""What `delay-gateway pending` makes of the index's records (pure; records: index_records.py):
which messages wait, counted and listed, and whether the answer is exact.

A reader first learns how far back a message may be overdue (gateway/core/horizon.py): a
minute past the earliest due time the gateways hold while every consumer of the distributor and returning
queues keeps up, else as far back as the streams keep. It reads the done stream from then
(done keys), then each band from its span before then, the highest band first. An entry
stands for a message that waits, unless a done key says it left (a delivered copy of a
message the broker holds twice is listed once, not twice):
- while its `until_ms` has not passed (it waits where the entry says);
- after it, since the horizon, if it is due: an overdue message;
- a lap's entry (due after its `until_ms`) whose lap had ended when the reader met it: the
  message came back from meditation and has a next entry, or is on its way to one (*in
  transit*). It counts once: as its next entry if the reader meets one (the same key), else as
  this one. A lap's next entry is written after it, in the same band or a lower one (what is
  left of a wait is never longer than a lap), so reading the bands from the highest down
  meets the lap's entry first; a next entry written after the reader passed its band is not
  met, and the lap's entry counts instead.
Each entry is decided as it is read, but laps in transit, so memory is the done keys of the
horizon (8 bytes each), the laps that ended within it and the messages kept for a listing
(`keep` of them); never the messages that wait. Records are read a whole record at a time
(numpy), and an entry becomes a Python object only when a filter, a cancel, the listing or
a transit needs it.

`Gap`s (gateway/core/horizon.py) say what can wait unlisted (messages not read yet, a gateway that does not write
entries or says nothing, messages from before the index, a horizon that is not a minute):
the answer is exact only without any.
"""

import heapq
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from gateway.core import cancels, envelope
from gateway.core.rules import Rules
from gateway.core.horizon import Horizon
from gateway.core.selection import Selection, literal_words
from gateway.core.index_records import DONE_KEYS, ENTRIES, FIXED, HAS_ID, KEY, RETRY, Listed
from gateway.core.index_records import FIRST_FIXED, entries_layout, first_checksum, first_fixed


# -- the view ----------------------------------------------------------------------------------
class Cancels:
    """What a listing leaves out as cancelled, judged as the gateways judge (a cancel by id
    after the message; by its handle, always; a rule that selects it, after it), and which
    entries of a record may be cancelled at all (`suspects`), so that the others are not read
    one by one."""

    def __init__(self, store: cancels.Store, held: Rules, now_ms: int) -> None:
        self.store, self.held, self.now_ms = store, held, now_ms
        self._handle_times = np.array(sorted(set(store.handle_times) | set(held.handle_times())), dtype=np.int64)
        self._prefixes = held.key_prefixes()
        self._ids = bool(len(store)) or held.by_id()

    def __call__(self, m: Listed) -> bool:
        store = self.store
        if len(store) and m.read_us in store.handle_times and (
                store.get(m.handle.encode("ascii")) is not None or store.get(
                    cancels.handle(m.read_us, first_checksum(m.routing_key)).encode("ascii")) is not None):
            return True  # by its handle, or the one the index's first layout gave it (a cancel of that time)
        # (as cancelling.taken_in_at: the stamp judged against the read time; a retry's is its first publish's)
        taken_in = cancels.Time(m.read_us, envelope.broker_stamp(m.properties.headers, m.read_us // 1000))
        found = store.get(m.message_id) if len(store) and m.message_id is not None else None
        if found is not None and found.cancels(taken_in):
            return True
        return self.held.first(m.message_id, m.routing_key, m.due_ms, m.retry, lambda: m.properties.headers,
                               lambda: m.handle.encode("ascii"), m.read_us, taken_in) is not None

    def suspects(self, r: "_Record", among: "np.ndarray") -> "np.ndarray":
        """The entries (of `among`) that a cancel or a rule may cancel: the others are not."""
        if self._prefixes is None:
            return among
        found = np.zeros(len(among), dtype=bool)
        if len(self._handle_times):
            found |= _sorted_member(self._handle_times, r.read_us)
        for prefix in self._prefixes:
            found |= r.key_starts_with(prefix)
        if self._ids:
            for i in np.nonzero(among & ~found)[0].tolist():
                mid = r.message_id(i)
                if mid is not None and (self.store.get(mid) is not None or self.held.names_id(mid)):
                    found[i] = True
        return among & found


def cancelled_by(store: cancels.Store, held: Rules, now_ms: int) -> Optional[Cancels]:
    """The cancels and rules held, as a listing judges by them; None when there are none."""
    if not len(store) and not len(held):
        return None
    return Cancels(store, held, now_ms)


@dataclass
class Counts:
    """How many are due within each range (exclusive: due by then, not by the one before), and
    their bodies' bytes."""

    ranges: List[Tuple[str, Optional[int]]]  # (label, up to ms from now; None: later)
    counts: List[int] = field(default_factory=list)
    bytes: List[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.counts = [0] * len(self.ranges)
        self.bytes = [0] * len(self.ranges)
        self._bounds = np.array([upto for _, upto in self.ranges if upto is not None], dtype=np.int64)

    def add(self, due_in_ms: int, size: int = 0) -> None:
        for i, (_, upto) in enumerate(self.ranges):
            if upto is None or due_in_ms <= upto:
                self.counts[i] += 1
                self.bytes[i] += size
                return

    def add_all(self, due_in_ms: "np.ndarray", sizes: Optional["np.ndarray"] = None) -> None:
        if not len(due_in_ms):
            return
        at = np.searchsorted(self._bounds, due_in_ms, side="left")
        found = np.bincount(at, minlength=len(self.ranges))
        weighed = np.bincount(at, weights=sizes, minlength=len(self.ranges)) if sizes is not None else None
        for i in range(len(self.ranges)):
            self.counts[i] += int(found[i])
            if weighed is not None:
                self.bytes[i] += int(weighed[i])


RANGES: Tuple[Tuple[str, Optional[int]], ...] = (
    ("overdue", 0), ("within 1 minute", 60_000), ("within 1 hour", 3_600_000), ("within 1 day", 86_400_000),
    ("within 1 week", 7 * 86_400_000), ("within 30 days", 30 * 86_400_000), ("within 1 year", 365 * 86_400_000),
    ("later", None))

# the fixed part of an entry (index_records.FIXED), as numpy reads it
_FIXED_DTYPE = np.dtype([("read_us", ">i8"), ("crc", ">u4"), ("due", ">i8"), ("until", ">i8"), ("size", ">u4"),
                         ("attempt", ">u2"), ("flags", "u1"), ("id_len", "u1"), ("key_len", "u1"),
                         ("props_len", ">u4")])
assert _FIXED_DTYPE.itemsize == FIXED.size
_KEY_DTYPE = np.dtype([("read_us", ">i8"), ("crc", ">u4")])
assert _KEY_DTYPE.itemsize == KEY.size
_MIX = np.uint64(0x9E3779B97F4A7C15)  # an odd multiplier: a message's 64-bit key (`mixed`)


def mixed(read_us: "np.ndarray", crc: "np.ndarray") -> "np.ndarray":
    """A message's key (index_records.key_of) in 64 bits: read time x an odd number, plus the
    checksum. Two messages with one checksum never meet; others by chance, 1 in 2^64."""
    out: np.ndarray = np.add(np.multiply(read_us.astype(np.uint64), _MIX), crc.astype(np.uint64))
    return out


def _sorted_member(sorted_values: "np.ndarray", values: "np.ndarray") -> "np.ndarray":
    return _member(sorted_values, values)


class _Record:
    """One record of a band, its entries told apart: numpy columns for whole-record tests,
    Python lists (made when first asked) for the entries read one by one."""

    def __init__(self, body: bytes, fixed: "np.ndarray", end: int) -> None:
        self.body, self.fixed = body, fixed
        self.bytes = np.frombuffer(body, dtype=np.uint8)
        self.read_us = fixed["read_us"].astype(np.int64)
        self.id_len = fixed["id_len"].astype(np.int64)
        self.key_len = fixed["key_len"].astype(np.int64)
        lengths = self.id_len + self.key_len + fixed["props_len"].astype(np.int64)
        self.id_at = end + np.concatenate(([0], np.cumsum(lengths)[:-1]))
        self.key_at = self.id_at + self.id_len
        self.whole = bool(self.id_at[-1] + lengths[-1] <= len(body))  # (else damaged: nothing is read)
        self._lists: Optional[Dict[str, List[int]]] = None

    def _starts_with(self, at: "np.ndarray", length: "np.ndarray", prefix: bytes, exact: bool) -> "np.ndarray":
        n = len(prefix)
        fits = (length == n) if exact else (length >= n)
        if not n or not fits.any():
            return fits
        rows = np.nonzero(fits)[0]
        same = (self.bytes[at[rows, None] + np.arange(n)] == np.frombuffer(prefix, dtype=np.uint8)).all(axis=1)
        found = np.zeros(len(fits), dtype=bool)
        found[rows[same]] = True
        return found

    def key_starts_with(self, prefix: bytes) -> "np.ndarray":
        return self._starts_with(self.key_at, self.key_len, prefix, False)

    def id_is(self, wanted: bytes) -> "np.ndarray":
        """Entries whose message id is `wanted` (or starts with it, where it ends with '*')."""
        has_id: np.ndarray = (self.fixed["flags"] & HAS_ID) != 0
        prefix = wanted.endswith(b"*")
        named = self._starts_with(self.id_at, self.id_len, wanted[:-1] if prefix else wanted, not prefix)
        found: np.ndarray = has_id & named
        return found

    @property
    def lists(self) -> Dict[str, List[int]]:
        if self._lists is None:
            f = self.fixed
            self._lists = {name: f[name].tolist() for name in ("crc", "due", "until", "size", "attempt", "flags")}
            self._lists.update(read_us=self.read_us.tolist(), id_at=self.id_at.tolist(),
                               key_at=self.key_at.tolist(), props_at=(self.key_at + self.key_len).tolist(),
                               props_len=f["props_len"].tolist())
        return self._lists

    def message_id(self, i: int) -> Optional[bytes]:
        c = self.lists
        return self.body[c["id_at"][i]:c["key_at"][i]] if c["flags"][i] & HAS_ID else None

    def key(self, i: int) -> bytes:
        c = self.lists
        return self.body[c["key_at"][i]:c["props_at"][i]]

    def listed(self, i: int) -> Listed:
        c = self.lists
        flags, props_at = c["flags"][i], c["props_at"][i]
        return Listed(c["read_us"][i], c["crc"][i], c["due"][i], c["until"][i], c["size"][i],
                      (c["attempt"][i] or None) if flags & RETRY else None, bool(flags & RETRY),
                      self.message_id(i), self.key(i), self.body[props_at:props_at + c["props_len"][i]])


def _member(sorted_keys: "np.ndarray", keys: "np.ndarray") -> "np.ndarray":
    if not len(sorted_keys):
        return np.zeros(len(keys), dtype=bool)
    at = np.searchsorted(sorted_keys, keys)
    found: np.ndarray = sorted_keys[np.minimum(at, len(sorted_keys) - 1)] == keys
    return found


class View:
    """What waits, from the done stream's keys and the bands' entries (see the module doc):
    `add_keys` for every record of the done stream first, then `add_entries` for every record
    of the bands, the highest band first, then `finish`."""

    def __init__(self, now_ms: int, at: Horizon, cancelled: Optional[Cancels], select: Selection,
                 keep: Optional[int] = None, each: Optional[Callable[[Listed], object]] = None,
                 ranges: Sequence[Tuple[str, Optional[int]]] = RANGES) -> None:
        """`keep`: how many to keep for a listing, the soonest due (None: none, a count; 0:
        all); `each`: told of every one instead, in no order (an export of millions keeps
        none); `ranges`: what to count by (`Counts`)."""
        self.now_ms, self.at, self.cancelled, self.select, self.keep = now_ms, at, cancelled, select, keep
        self.each = each
        self._done_parts: List[np.ndarray] = []
        self._done: Optional[np.ndarray] = None
        self._transit: Dict[int, Listed] = {}  # laps just ended, by their 64-bit key (`mixed`)
        self._kept: List[Tuple[int, int, int, Listed]] = []  # (-due, -seq, ...) a max-heap of the soonest
        self._seq = 0
        self.total = 0
        self.latest_due_ms: Optional[int] = None  # of those counted
        self.earliest_due_ms: Optional[int] = None  # of those counted (overdue or not)
        self.next_due_ms: Optional[int] = None  # of those counted not overdue
        self.counts = Counts(list(ranges))
        self.read = 0  # entries read
        self.keys = 0  # done keys read

    # -- the done stream ---------------------------------------------------------------------
    def add_keys(self, body: bytes) -> None:
        """A record of the done stream: done keys (anything else: nothing)."""
        if body.startswith(DONE_KEYS) and len(body) >= 8:
            count = int.from_bytes(body[4:8], "big")
            if 8 + count * KEY.size <= len(body):
                keys = np.frombuffer(body, dtype=_KEY_DTYPE, count=count, offset=8)
                self._done_parts.append(mixed(keys["read_us"], keys["crc"]))
                self.keys += count

    def _sealed(self) -> "np.ndarray":
        if self._done is None:
            self._done = np.unique(np.concatenate(self._done_parts)) if self._done_parts \
                else np.zeros(0, dtype=np.uint64)
            self._done_parts.clear()
        return self._done

    # -- the bands ---------------------------------------------------------------------------
    def add_entries(self, body: bytes, read_at_ms: Optional[int] = None) -> None:
        """A record of a band, read at `read_at_ms` (the reader's clock: default `now_ms`):
        each entry decided as it is read (but laps in transit). A record of the index's first
        layout too, with that layout's checksum (index_records.entries_layout)."""
        if not body.startswith(ENTRIES) or len(body) < 8:
            return
        count, first = entries_layout(body)
        if first:
            end = 8 + count * FIRST_FIXED.size
            fixed = np.array(list(first_fixed(body, count)), dtype=_FIXED_DTYPE)
        else:
            end = 8 + count * FIXED.size
            if end > len(body) or not count:
                return
            fixed = np.frombuffer(body, dtype=_FIXED_DTYPE, count=count, offset=8)
        done = self._sealed()
        self.read += count
        until = fixed["until"].astype(np.int64)
        due = fixed["due"].astype(np.int64)
        keys = mixed(fixed["read_us"], fixed["crc"])
        alive = ~_member(done, keys)
        current = until >= self.now_ms
        waits = (current | ((until >= self.at.at_ms) & (due <= self.now_ms))) & alive
        transit = (due > until) & (until < (self.now_ms if read_at_ms is None else read_at_ms)) \
            & (until >= self.at.at_ms) & alive
        waits &= ~transit
        if not waits.any() and not transit.any():
            return
        r = _Record(body, fixed, end)
        if not r.whole:
            return  # (a damaged record: its entries cannot be told apart)
        for i in np.nonzero(transit)[0].tolist():
            self._transit[int(keys[i])] = r.listed(i)
        self._superseded(keys, waits & current)
        waits &= self._may_select(r)
        suspects = self.cancelled.suspects(r, waits) if self.cancelled is not None else np.zeros(count, dtype=bool)
        if self.select.empty and self.each is None and self.keep != 0:
            # Nothing to judge one by one but the suspects: count what cannot enter the listing
            # (all of it for a count; what is due no sooner than the latest kept once it is
            # full) in one go.
            counted = waits & ~suspects
            if self.keep is not None:
                if len(self._kept) >= self.keep:
                    counted &= due >= -self._kept[0][0]
                else:
                    counted[:] = False
            waits &= ~counted
            chosen = np.nonzero(counted)[0]
            if len(chosen):
                self._count_all(due[chosen], fixed["size"][chosen].astype(np.int64))
        for i in np.nonzero(waits)[0].tolist():
            self._consider_entry(r, i, bool(suspects[i]))

    def _may_select(self, r: _Record) -> "np.ndarray":
        """The entries the selection may select, from what whole records show (a key pattern's
        literal words, message ids and prefixes): the others it does not."""
        select, found = self.select, np.ones(len(r.read_us), dtype=bool)
        if select.key is not None:
            words = literal_words(select.key)
            if words:
                found &= r.key_starts_with(b".".join(words))
        if select.ids and not any(i.startswith(b"@") for i in select.ids):
            named = np.zeros(len(found), dtype=bool)
            for wanted in select.ids:
                named |= r.id_is(wanted)
            found &= named
        return found

    def _count_all(self, due: "np.ndarray", sizes: "np.ndarray") -> None:
        self.total += len(due)
        self.counts.add_all(due - self.now_ms, sizes)
        latest, earliest = int(due.max()), int(due.min())
        self.latest_due_ms = latest if self.latest_due_ms is None else max(latest, self.latest_due_ms)
        self.earliest_due_ms = earliest if self.earliest_due_ms is None else min(earliest, self.earliest_due_ms)
        ahead = due[due > self.now_ms]
        if len(ahead):
            soonest = int(ahead.min())
            self.next_due_ms = soonest if self.next_due_ms is None else min(soonest, self.next_due_ms)

    def _consider_entry(self, r: _Record, i: int, suspect: bool) -> None:
        """One entry, read only as far as its selection and the listing need."""
        c = r.lists
        if not self.select.empty:
            flags = c["flags"][i]
            if not self.select.matches(r.message_id(i), r.key(i), c["due"][i], bool(flags & RETRY),
                                       lambda: r.listed(i).properties.headers,
                                       lambda: cancels.handle(c["read_us"][i], c["crc"][i]).encode("ascii")):
                return
        if suspect or self.each is not None or self.keep is not None:
            self._take(r.listed(i), suspect)
        else:
            self._counted(int(c["due"][i]), int(c["size"][i]))

    def _superseded(self, keys: "np.ndarray", current: "np.ndarray") -> None:
        """Current entries that are the next entries of laps in transit: those laps no longer count."""
        if self._transit and current.any():
            laps = np.sort(np.fromiter(self._transit, dtype=np.uint64, count=len(self._transit)))
            for k in keys[current & _member(laps, keys)].tolist():
                self._transit.pop(k, None)

    def finish(self) -> None:
        """Every band read: the laps in transit whose next entry was not met count as they are."""
        transit, self._transit = self._transit, {}
        for m in transit.values():
            self._consider(m)

    def _consider(self, m: Listed) -> None:
        """A message read whole (a lap in transit): selected, judged, counted, kept."""
        if self.select.matches(m.message_id, m.routing_key, m.due_ms, m.retry, lambda: m.properties.headers,
                               lambda: m.handle.encode("ascii")):
            self._take(m, True)

    def _counted(self, due_ms: int, size: int) -> None:
        self.total += 1
        self.counts.add(due_ms - self.now_ms, size)
        if self.latest_due_ms is None or due_ms > self.latest_due_ms:
            self.latest_due_ms = due_ms
        if self.earliest_due_ms is None or due_ms < self.earliest_due_ms:
            self.earliest_due_ms = due_ms
        if due_ms > self.now_ms and (self.next_due_ms is None or due_ms < self.next_due_ms):
            self.next_due_ms = due_ms

    def _take(self, m: Listed, judge: bool) -> None:
        """A selected message: unless cancelled (asked when `judge`), counted and kept."""
        if judge and self.cancelled is not None and self.cancelled(m):
            return
        self._counted(m.due_ms, m.size)
        if self.each is not None:
            self.each(m)
            return
        if self.keep is None:
            return
        self._seq += 1
        item = (-m.due_ms, -self._seq, self._seq, m)
        if not self.keep:
            self._kept.append(item)
        elif len(self._kept) < self.keep:
            heapq.heappush(self._kept, item)
        elif item > self._kept[0]:  # due sooner than the latest kept
            heapq.heapreplace(self._kept, item)

    def listed(self) -> List[Listed]:
        """The messages kept, soonest due first (first read first among equals)."""
        return [m for _, _, _, m in sorted(self._kept, key=lambda i: (-i[0], i[2]))]

