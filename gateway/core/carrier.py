"""Carriers: many publishers' messages travelling the chain as one broker message (pure).

Every hop of the chain is a queue write on the broker, and on a replicated (quorum) queue
that write is the gateway's real cost: about seven per message where the plugin we replace
needs one. Messages that take the same route within a short window (the same level and bit
key, or meditation) are all due within one unit of each other, so they can wait in the
same queues: check-in collects them for at most `wait_ms` and publishes one carrier, whose
body packs each message's routing key, properties, body and due time, exactly. The
distributor unpacks it and releases each message at its own due time, as if it had come
alone; the carrier is acknowledged once every message in it is confirmed at pick-up. A
crash costs what it always costs: redeliveries (possible duplicates), never a loss.

A batch is closed by count, by bytes (far below RabbitMQ's 16 MiB body limit) or by age; a
message too big for a carrier travels alone in the plain format.
"""

import heapq
import struct
from dataclasses import dataclass, field
from typing import Dict, Generic, List, NamedTuple, Optional, Tuple, TypeVar

from gateway.core import wire
from gateway.core.envelope import ACCEPTED, DUE_AT, EXCHANGE, PERSISTENT
from gateway.core.routes import Route
from gateway.core.wire import Properties, Table

MAGIC = b"DGC1"
_ENTRY = struct.Struct(">qI")  # due time, routing key length


class Entry(NamedTuple):
    """One publisher's message inside the gateway. (A NamedTuple, not a frozen dataclass: one
    is made for every message at check-in and again at release, at a sixth of the cost.)"""

    routing_key: bytes
    user: Properties  # the publisher's properties, as they will arrive at pick-up
    body: bytes
    due_ms: int
    accepted_us: Optional[int] = None  # when the gateway took it in (cancels.py); None: before that was kept
    # Where it goes when due: None for pick-up (with `routing_key`); "" for the default
    # exchange, a retry going back to the queue `routing_key` names (retries.py).
    exchange: Optional[str] = None

    @property
    def size(self) -> int:
        return len(self.routing_key) + len(self.user.raw) + len(self.body) + 24


def pack(entries: List[Entry]) -> bytes:
    pieces = [MAGIC]
    for e in entries:
        pieces += [_ENTRY.pack(e.due_ms, len(e.routing_key)), e.routing_key,
                   struct.pack(">I", len(e.user.raw)), e.user.raw, struct.pack(">I", len(e.body)), e.body]
    return b"".join(pieces)


class Damaged(ValueError):
    pass


def unpack(body: bytes, accepted: Optional[List[Optional[int]]] = None, exchange: Optional[str] = None) -> List[Entry]:
    """Raises Damaged if `body` is not a carrier's. `accepted`: each entry's time, from the
    carrier's properties (`accepted_times`); `exchange`: where they all go (`destination`)."""
    if not body.startswith(MAGIC):
        raise Damaged("not a carrier")
    parts: List[Tuple[bytes, bytes, bytes, int]] = []
    offset = len(MAGIC)
    try:
        while offset < len(body):
            due, key_len = _ENTRY.unpack_from(body, offset)
            offset += _ENTRY.size
            key = body[offset:offset + key_len]
            offset += key_len
            (props_len,) = struct.unpack_from(">I", body, offset)
            props = body[offset + 4:offset + 4 + props_len]
            offset += 4 + props_len
            (body_len,) = struct.unpack_from(">I", body, offset)
            payload = body[offset + 4:offset + 4 + body_len]
            offset += 4 + body_len
            if len(key) != key_len or len(props) != props_len or len(payload) != body_len:
                raise Damaged("truncated carrier")
            parts.append((key, props, payload, due))
    except struct.error:
        raise Damaged("truncated carrier") from None
    times = accepted if accepted is not None and len(accepted) == len(parts) else [None] * len(parts)
    return [Entry(key, Properties.parse(props), payload, due, t, exchange)
            for (key, props, payload, due), t in zip(parts, times, strict=True)]


COUNT = "x-gateway-carrier"
# Each entry's time (envelope.ACCEPTED), in entry order, as an array of longs (0: unknown).
# In the properties rather than the body, so that the body's format is the one every
# version reads, and a version that does not know the header carries the entries all the same.
_NO_TIME = 0


def properties(entries: List[Entry]) -> Properties:
    """A carrier's own properties: persistent, its earliest due time, how many it carries,
    when each was accepted, and where they go if not to pick-up (one batch: one place)."""
    fields = [wire.long(DUE_AT, min(e.due_ms for e in entries)), wire.long(COUNT, len(entries))]
    if entries[0].exchange is not None:
        fields.append(wire.longstr(EXCHANGE, entries[0].exchange.encode()))
    if any(e.accepted_us is not None for e in entries):
        times = b"".join(b"l" + struct.pack(">q", _NO_TIME if e.accepted_us is None else e.accepted_us)
                         for e in entries)
        fields.append(wire.TableField(ACCEPTED.encode(), b"A", struct.pack(">I", len(times)) + times))
    return Properties.build(delivery_mode=PERSISTENT, headers=Table(fields))


def accepted_times(props: Properties) -> Optional[List[Optional[int]]]:
    """Each entry's time from a carrier's properties; None if it has none (older carriers)."""
    times = props.headers.get(ACCEPTED)
    if not isinstance(times, list):
        return None
    return [t if isinstance(t, int) and not isinstance(t, bool) and t != _NO_TIME else None for t in times]


# -- collecting a batch ---------------------------------------------------------------------


@dataclass
class Batch:
    key: Route
    close_by_ms: int  # sent by then at the latest: its wait, or sooner if a message must go sooner
    items: List[Tuple[int, Entry]] = field(default_factory=list)  # (delivery tag, entry)
    size: int = 0


class Batcher:
    """Open batches by route; each add returns the batches that closed."""

    def __init__(self, max_messages: int, max_bytes: int, wait_ms: int) -> None:
        self.max_messages, self.max_bytes, self.wait_ms = max_messages, max_bytes, wait_ms
        self._open: Dict[Route, Batch] = {}
        self._first: Optional[int] = None  # the earliest close_by_ms of the open batches (asked after every event)
        self._messages = 0  # in the open batches (asked after every delivery)

    def __len__(self) -> int:
        return self._messages

    def add(self, key: Route, tag: int, entry: Entry, now_ms: int, send_by_ms: Optional[int] = None) -> List[Batch]:
        """Add a message; `send_by_ms`: it may not wait past then (else: the whole wait). One
        due already still closes only at the next tick: others read with it may join it."""
        size = entry.size
        if size >= self.max_bytes or self.max_messages <= 1 or self.wait_ms <= 0:
            return [Batch(key, now_ms, [(tag, entry)], size)]  # alone
        closed = []
        batch = self._open.get(key)
        if batch is not None and batch.size + size > self.max_bytes:
            closed.append(self._open.pop(key))
            batch = None
        if batch is None:
            batch = self._open[key] = Batch(key, now_ms + self.wait_ms)
        if send_by_ms is not None and send_by_ms < batch.close_by_ms:
            batch.close_by_ms = max(send_by_ms, now_ms)
        if self._first is None or batch.close_by_ms < self._first:
            self._first = batch.close_by_ms
        batch.items.append((tag, entry))
        batch.size += size
        self._messages += 1
        if len(batch.items) >= self.max_messages:
            closed.append(self._open.pop(key))
        if closed:
            self._closed()
        return closed

    def expired(self, now_ms: int) -> List[Batch]:
        if self._first is None or now_ms < self._first:
            return []
        due = [k for k, b in self._open.items() if now_ms >= b.close_by_ms]
        out = [self._open.pop(k) for k in due]
        self._closed()
        return out

    def next_deadline(self) -> Optional[int]:
        return self._first

    def _closed(self) -> None:
        self._first = min((b.close_by_ms for b in self._open.values()), default=None)
        self._messages = sum(len(b.items) for b in self._open.values())

    def discard(self, tag: int) -> None:
        """Forget the messages of this delivery (rare: a delivery given up)."""
        for key, batch in list(self._open.items()):
            kept = [(t, e) for t, e in batch.items if t != tag]
            if len(kept) == len(batch.items):
                continue
            if kept:
                batch.items, batch.size = kept, sum(e.size for _, e in kept)
            else:
                del self._open[key]
        self._closed()

    def drain(self) -> List[Batch]:
        out = list(self._open.values())
        self._open.clear()
        self._first, self._messages = None, 0
        return out


# -- holding messages until their time ------------------------------------------------------
K = TypeVar("K")
V = TypeVar("V")


class Holds(Generic[K, V]):
    """Messages waiting for their due time, earliest first (same time: first come, first)."""

    def __init__(self) -> None:
        self._heap: List[Tuple[int, int, K, V]] = []
        self._n = 0

    def __len__(self) -> int:
        return len(self._heap)

    def add(self, due_ms: int, key: K, item: V) -> None:
        self._n += 1
        heapq.heappush(self._heap, (due_ms, self._n, key, item))

    def next_due(self) -> Optional[int]:
        return self._heap[0][0] if self._heap else None

    def due(self, now_ms: int) -> List[Tuple[K, V]]:
        out = []
        while self._heap and self._heap[0][0] <= now_ms:
            _, _, key, item = heapq.heappop(self._heap)
            out.append((key, item))
        return out

    def first(self, count: int) -> List[Tuple[K, V]]:
        """Up to `count` of the earliest, whatever their time."""
        out: List[Tuple[K, V]] = []
        while self._heap and len(out) < count:
            _, _, key, item = heapq.heappop(self._heap)
            out.append((key, item))
        return out

    def discard(self, key: K) -> None:
        """Forget everything held under this key (rare: a delivery given up)."""
        kept = [h for h in self._heap if h[2] != key]
        if len(kept) != len(self._heap):
            self._heap = kept
            heapq.heapify(self._heap)

    def drain(self) -> List[Tuple[K, V]]:
        # (due, arrival) are unique: the sort never compares keys or items
        out = [(key, item) for _, _, key, item in sorted(self._heap, key=lambda h: (h[0], h[1]))]
        self._heap.clear()
        return out
