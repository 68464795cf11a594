"""The index of what waits on the broker: the gateways' beats, noting where messages may wait
unlisted, and reading the waiting streams for `delay-gateway pending` (what the records
mean: gateway/core/index_records.py; what a reader makes of them: gateway/core/listing.py).

Reading: passive declares say whether messages wait unread where a gateway should take
them (check-in, and the distributor and returning queues) and who consumes them; the
registry says whether messages may wait unlisted since an upgrade; the done stream's last
seconds hold the gateways' beats. From these the reader knows how far back a message may be
overdue (`listing.horizon`) and whether the answer can be exact (`listing.gaps`). It then
reads the done stream since then, and each band from its span before, one after the other,
the highest first (listing.View says why); each stream up to its end as of its start,
which it learns by appending a mark of its own and reading until it comes back (AMQP does
not say where a stream ends). However long that takes: a reader that hears nothing from the
broker for STALL_S gives up, one that reads on is never cut short.
"""

import datetime
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import structlog
from pika.exceptions import AMQPError, ChannelClosedByBroker

from topology import Topology
from topology.broker.declare import declare
from topology.broker.inventory import Prober, Unknown, append, close_stream_reader, read_registry
from topology.names import Names
from topology.registry import Record, fold
from topology.settings import QUEUE_TYPES, ChainSettings
from topology.index_bands import BANDS, DONE, RETENTION_SLACK_MS, band_key

from gateway.broker.plumbing import lazy_properties
from gateway.clock import wall_ms
from gateway.core import index_records, listing
from gateway.core.listing import Gap, Horizon, Place, View
from gateway.core.index_records import Consumers
from gateway.core.wire import Properties
from gateway.times import iso_s

MARK = b"DGM1"
PREFETCH = 64  # records (each up to a carrier's worth of entries) unacknowledged per stream
CLOCKS_MS = 60_000  # read this much earlier: the streams' chunk times are the broker's clock
STALL_S = 60.0  # nothing at all from the broker for this long: the read fails
PROGRESS_EVERY_S = 0.5
RECORD = Properties.build(delivery_mode=2)
DAY_MS = 86_400_000


class Beats:
    """A gateway's beat, every BEAT_EVERY_MS, into the done stream (from the upkeep thread):
    which roles it runs, how many consumers of each kind (`consumers`, set by the worker's
    session), whether it writes entries, and the earliest due time of what its distributor
    holds (`low`, set by the worker; now when nothing)."""

    def __init__(self, names: Names, role: str, indexes: bool = True) -> None:
        self.names = names
        self.id = uuid.uuid4().bytes
        self.roles = (index_records.ROLE_CHECK_IN if role in ("all", "check-in") else 0) \
            | (index_records.ROLE_DISTRIBUTOR if role in ("all", "distributor") else 0)
        self.flags = index_records.INDEXES if indexes else 0
        self.low: Callable[[], Optional[int]] = lambda: None
        self.consumers = Consumers()
        self._channel: Any = None
        self._sent = 0.0
        self._off = False
        self.log = structlog.get_logger("gateway").bind(part="upkeep")

    def maybe(self, connection) -> None:
        if self._off or time.monotonic() - self._sent < index_records.BEAT_EVERY_MS / 1000:
            return
        self._sent = time.monotonic()
        now = wall_ms()
        low = self.low()
        try:
            if self._channel is None or not self._channel.is_open:
                self._channel = connection.channel()
            self._channel.basic_publish(self.names.waiting, DONE, index_records.pack_beat(
                self.id, self.roles, now if low is None else min(low, now), now, self.consumers, self.flags),
                lazy_properties.WireProperties(RECORD))
        except ChannelClosedByBroker as exc:  # the exchange is missing: an older topology
            self._channel = None
            if exc.reply_code == 404:
                self._off = True
                self.log.warning("waiting_beats_off", exchange=self.names.waiting,
                                 fix="run `delay-gateway declare` with this version")

    def count(self, consumers: Consumers) -> None:
        """The worker's session consumes these now: beat soon, so that readers know at once."""
        self.consumers = consumers
        self._sent = 0.0

    def forget(self) -> None:
        """The connection is gone."""
        self._channel = None


# -- noting where messages may wait unlisted ---------------------------------------------------
def index_missing(prober: Prober, names: Names) -> bool:
    """Whether the index's streams are not declared (before a declare: an upgrade from a
    version without them, or a new broker)."""
    return prober.queue(names.waiting_stream(DONE)) is None


def chain_queues(settings: ChainSettings) -> List[str]:
    """Every queue where a message of this chain can wait without an entry."""
    n = settings.names
    out = [n.check_in, n.retry, n.returning, n.distributor, settings.meditation]
    out += [n.exit_distributor(t) for t in QUEUE_TYPES] + [n.exit_returning(t) for t in QUEUE_TYPES]
    for k in range(settings.max_level):
        out += [n.delay_queue(k), n.pass_queue(k)]
    return out


def note_messages_before_index(connection, settings: ChainSettings, now_ms: int) -> Optional[Record]:
    """Just after a declare that created the index where messages already wait (an upgrade):
    say in the registry until when they may wait unlisted. A message passes a gateway at
    least once a lap (and is listed from then); a day on top for gateways of the earlier
    version still running beside the new ones meanwhile (a rolling upgrade)."""
    prober = Prober(connection)
    try:
        waiting_now = sum(c.messages for c in (prober.queue(q) for q in chain_queues(settings)) if c is not None)
    except Unknown:  # (a look refused: then whether messages wait cannot be told, so say they may)
        waiting_now = 1
    prober.close()
    if not waiting_now:
        return None
    since = iso_s(now_ms)
    record = Record("unlisted", now_ms, until_ms=now_ms + settings.meditation_ms + DAY_MS,
                    why=f"messages scheduled before {since} (before the index of what waits existed) are listed "
                        "from their next lap, or not at all until due")
    append(connection, settings.names, [record])
    return record


def declare_noting(channel, topology: Topology, declaring: Callable[[Any, Topology], None] = declare) -> None:
    """Declare (or, `declaring=verify`, find) the topology; if that created the index where
    messages already wait, say so in the registry (`note_messages_before_index`)."""
    prober = Prober(channel.connection)
    try:
        missing = index_missing(prober, topology.settings.names)
    except Unknown:  # (a look refused: the declare says what is wrong, in its own words)
        missing = False
    prober.close()
    declaring(channel, topology)
    if missing and declaring is declare:
        note_messages_before_index(channel.connection, topology.settings, wall_ms())


def unindexed_every_ms(settings: ChainSettings) -> int:
    """How often a gateway without entries notes it (a quarter lap, at least ten minutes)."""
    return max(settings.meditation_ms // 4, 600_000)


def note_unindexed_gateway(connection, settings: ChainSettings, now_ms: int) -> Record:
    """A gateway that writes no entries (--no-pending-index) says, as it runs, until when what
    it sends on may wait unlisted: a lap after the next time it says so (`unindexed_every_ms`),
    and a minute for clocks."""
    until = now_ms + unindexed_every_ms(settings) + settings.meditation_ms + 60_000
    record = Record("unlisted", now_ms, until_ms=until,
                    why="a gateway runs (or ran) with --no-pending-index: what it sent on is listed from its next "
                        "lap, or not at all until due")
    append(connection, settings.names, [record])
    return record


# -- reading -----------------------------------------------------------------------------------
@dataclass
class Found:
    """What a reading found beside the view: the streams read, and what may be missing."""

    horizon: Horizon
    bands: List[int]
    unread_check_in: Optional[int]  # messages in check-in no gateway has read yet (not listed)
    gaps: List[Gap] = field(default_factory=list)
    records: int = 0

    @property
    def exact(self) -> bool:
        """Nothing can wait unlisted, and the horizon is a minute."""
        return self.horizon.exact and not self.gaps

    def reasons(self) -> List[str]:
        """Why the answer is not exact, in short."""
        return ([] if self.horizon.exact else [self.horizon.why]) + [g.why for g in self.gaps]

    def notes(self) -> List[str]:
        """Why the answer is not exact, for people: what was read instead, and until when."""
        out = []
        if not self.horizon.exact:
            out.append(f"{self.horizon.why}: everything the streams keep was read (up to "
                       f"{RETENTION_SLACK_MS // 3_600_000} h past due)")
        for gap in self.gaps:
            until = "" if gap.until_ms is None else f" (until {iso_s(gap.until_ms)})"
            out.append(gap.why + until)
        return out


class Missing(RuntimeError):
    """The waiting streams are not declared under the prefix."""


Progress = Callable[[int, int], None]  # (entries read, keys read), every PROGRESS_EVERY_S


def read(connection, names: Names, now_ms: int, make_view: Callable[[Horizon], View],
         progress: Optional[Progress] = None) -> Tuple[View, Found]:
    """Read the index into a view (see the module doc). Raises Missing."""
    prober = Prober(connection)
    places: Dict[str, Place] = {}
    for place, exits in (("distributor", names.exit_distributor), ("returning", names.exit_returning)):
        counts = [c for c in (prober.queue(exits(t)) for t in QUEUE_TYPES) if c is not None]
        places[place] = Place(sum(c.messages for c in counts), sum(c.consumers for c in counts))
    entrance = [c for c in (prober.queue(names.check_in), prober.queue(names.retry)) if c is not None]
    check_in = Place(sum(c.messages for c in entrance), sum(c.consumers for c in entrance))
    bands = [b for b in range(BANDS) if prober.queue(names.waiting_stream(band_key(b))) is not None]
    done_there = prober.queue(names.waiting_stream(DONE)) is not None
    prober.close()
    if not bands or not done_there:
        raise Missing(f"the waiting streams ({names.waiting_stream('NN')}) are not declared under prefix "
                      f"{names.prefix!r}: run `delay-gateway declare` with this version (the gateways then list "
                      "what they send on from that moment)")
    records = read_registry(connection, names)
    unlisted = [Gap(r.why, r.until_ms) for r in fold(records or []).unlisted]
    reader = StreamReader(connection, names)
    recent: List[index_records.Beat] = []

    def on_beat(body: bytes) -> None:
        found = index_records.beat(body)
        if found is not None:
            recent.append(found)
    reader.read({DONE: now_ms - index_records.LIVE_MS - CLOCKS_MS}, {DONE: on_beat})
    at = listing.horizon(now_ms, recent, places)
    view = make_view(at)
    if progress is not None:
        reader.progress = lambda: progress(view.read, view.keys)
    reader.read({DONE: at.at_ms - CLOCKS_MS}, {DONE: view.add_keys})
    for b in sorted(bands, reverse=True):  # (the highest first: a lap's entry before its next one)
        reader.read({band_key(b): listing.read_from_ms(b, at) - CLOCKS_MS},
                    {band_key(b): lambda body: view.add_entries(body, wall_ms())})
    view.finish()
    found = Found(at, bands, check_in.ready, listing.gaps(now_ms, recent, check_in, unlisted), reader.records)
    return view, found


class StreamReader:
    """Reads streams from a time to their end (as of the start), all at once on one channel."""

    def __init__(self, connection, names: Names) -> None:
        self.connection, self.names = connection, names
        self.records = 0
        self.progress: Callable[[], None] = lambda: None

    def read(self, starts: Dict[str, int], handlers: Dict[str, Callable[[bytes], object]]) -> None:
        """Each stream (by its key) from `starts[key]` (epoch ms), each record's body to its handler."""
        channel = self.connection.channel()
        marks = self._marks(channel, list(starts))
        reading: Dict[str, str] = {}  # key -> consumer tag, until its mark came back
        ended: List[str] = []

        def consumer(key: str):
            handle, token = handlers[key], marks[key]

            def on_message(ch, method, properties, body) -> None:
                self.records += 1
                if key not in reading:
                    pass  # (past its mark: the stream was read to where it ended at the start)
                elif body == token:
                    ended.append(key)
                else:
                    handle(body)
                ch.basic_ack(method.delivery_tag)
            return on_message

        channel.basic_qos(prefetch_count=PREFETCH)
        for key, start_ms in starts.items():
            start = datetime.datetime.fromtimestamp(max(0.0, start_ms / 1000), datetime.timezone.utc)
            reading[key] = channel.basic_consume(self.names.waiting_stream(key), consumer(key),
                                                 arguments={"x-stream-offset": start})
        heard, seen, told = time.monotonic(), self.records, time.monotonic()
        while reading:
            self.connection.process_data_events(time_limit=0.05)
            while ended:  # (its records after the mark are acknowledged and left aside)
                reading.pop(ended.pop(), None)
            now = time.monotonic()
            if self.records != seen:
                heard, seen = now, self.records
            elif now - heard > STALL_S:
                raise TimeoutError(f"nothing came from {', '.join(self.names.waiting_stream(k) for k in reading)} "
                                   f"for {STALL_S:g} s: is the broker overloaded, or the stream's member down?")
            if now - told >= PROGRESS_EVERY_S:
                told = now
                self.progress()
        close_stream_reader(channel)

    def _marks(self, channel, keys: Sequence[str]) -> Dict[str, bytes]:
        """Append a mark of our own to each stream: read back, everything before it was read."""
        channel.confirm_delivery()
        marks = {}
        for key in keys:
            marks[key] = MARK + uuid.uuid4().bytes
            channel.basic_publish(self.names.waiting, key, marks[key], lazy_properties.WireProperties(RECORD),
                                  mandatory=True)
        return marks


def problem(exc: BaseException) -> str:
    return f"reading the waiting streams failed: {exc}" if isinstance(exc, (AMQPError, TimeoutError)) else repr(exc)
