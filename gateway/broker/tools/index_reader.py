"""Reading the index of what waits for `delay-gateway pending` and `status` (what the records
mean: gateway/core/index_records.py; what a reader makes of them: gateway/core/horizon.py and
gateway/core/listing.py; the gateways write them: gateway/broker/run/index_streams.py).

Reading needs read permission on the streams and nothing else: it declares nothing and
appends nothing. It learns where each stream ends as of its start (topology/broker/inventory.py:
`stream_ends`, the highest offset of the last chunk), and whether it exists (a consume of a
missing one is refused with 404); the registry says whether messages may wait unlisted since
an upgrade; the done stream's last seconds hold the gateways' beats, and the newest says
whether messages wait unread where a gateway should take them (check-in, the distributor and
returning queues) and who consumes them. From these the reader knows how far back a message
may be overdue (`horizon.horizon`) and whether the answer can be exact (`horizon.gaps`). It
then reads the done stream since then, and each band from its span before, one after the
other, the highest first (listing.View says why), each up to its end. It trusts the records
of the gateway user: another user's are left out, unsigned ones (before 1.0) are read but
trusted less (their done keys hide nothing, their beats count no queue), and either makes the
answer not exact. However long that takes: a reader that hears nothing
from the broker for STALL_S gives up, one that reads on is never cut short.
"""

import dataclasses
import datetime
from dataclasses import dataclass, field
from typing import Callable, List, Optional, Set, Tuple

from pika.exceptions import AMQPError

from topology.broker.inventory import END_WAIT_S, Ends, offset_of, read_registry, read_stream, stream_ends
from topology.index_bands import BANDS, DONE, RETENTION_SLACK_MS, band_key, bands
from topology.names import Names
from topology.registry import fold
from topology.settings import ChainSettings

from gateway.broker.run.index_streams import MARK, index_keys, looked
from gateway.clock import wall_ms
from gateway.core import horizon, index_records, writers
from gateway.core.horizon import Gap, Horizon
from gateway.core.index_records import Place
from gateway.core.listing import View
from gateway.times import iso_s

PREFETCH = 64  # records (each up to a carrier's worth of entries) unacknowledged per stream
CLOCKS_MS = 60_000  # read this much earlier: the streams' chunk times are the broker's clock
STALL_S = 60.0  # nothing at all from the broker for this long: the read fails
QUIET_S = 0.3  # a stream whose end is not known is read until nothing came for this long
PROGRESS_EVERY_S = 0.5


@dataclass
class Found:
    """What a reading found beside the view: the streams read, and what may be missing."""

    horizon: Horizon
    bands: List[int]
    unread_check_in: Optional[int]  # messages in check-in no gateway has read yet (not listed); None: unknown
    gaps: List[Gap] = field(default_factory=list)
    records: int = 0
    earlier: int = 0  # gateways of 0.1.0 that beat lately (they take a rule for a message)

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


def read(connection, chain: ChainSettings, trusted: str, now_ms: int, make_view: Callable[[Horizon], View],
         progress: Optional[Progress] = None) -> Tuple[View, Found]:
    """Read the index into a view (see the module doc), trusting the records `trusted` (the
    gateway user) signed. Raises Missing."""
    names = chain.names
    needed = index_keys(chain)
    others = [band_key(b) for b in range(bands(chain), BANDS)]  # (a chain of other settings may have more)
    ends = stream_ends(connection, [names.waiting_stream(k) for k in needed + others])
    if any(names.waiting_stream(k) in ends.missing for k in needed):
        raise Missing(f"the waiting streams ({names.waiting_stream('NN')}) are not declared under prefix "
                      f"{names.prefix!r}: run `delay-gateway declare` with this version (the gateways then list "
                      "what they send on from that moment)")
    there = [b for b in range(BANDS) if names.waiting_stream(band_key(b)) not in ends.missing]
    records = read_registry(connection, names)
    unlisted = [Gap(r.why, r.until_ms) for r in fold(records or []).unlisted]
    reader = StreamReader(connection, names, ends, trusted)
    recent: List[index_records.Beat] = []

    def on_beat(body: bytes, counts: bool = True) -> None:
        found = index_records.beat(body)
        if found is not None:
            recent.append(found if counts else dataclasses.replace(found, seen=None))
    # Unsigned records (before 1.0) are read but trusted less: a beat's counts of the queues
    # are not taken from one (no version that wrote them unsigned counted), and a done key
    # never hides a message (an entry may list one): the answer says it read them.
    reader.read(DONE, now_ms - index_records.LIVE_MS - CLOCKS_MS, on_beat, lambda body: on_beat(body, False))
    places, unseen = looked(connection, names), ""
    if places is None:  # (a reader with read permission only: what the gateways last saw)
        places, unseen = horizon.seen(now_ms, recent)
    at = horizon.horizon(now_ms, recent, places) if places is not None \
        else Horizon(now_ms - RETENTION_SLACK_MS, False, unseen)
    view = make_view(at)
    if progress is not None:
        reader.progress = lambda: progress(view.read, view.keys)
    reader.read(DONE, at.at_ms - CLOCKS_MS, view.add_keys)
    for b in sorted(there, reverse=True):  # (the highest first: a lap's entry before its next one)
        entries = lambda body: view.add_entries(body, wall_ms())  # noqa: E731
        reader.read(band_key(b), horizon.read_from_ms(b, at) - CLOCKS_MS, entries, entries)
    view.finish()
    check_in = places["check_in"] if places is not None else Place(0, 0)
    gaps = horizon.gaps(now_ms, recent, check_in, unlisted) + reader.gaps()
    earlier = horizon.earlier_check_in(now_ms, recent, places)
    found = Found(at, there, check_in.ready if places is not None else None, gaps, reader.records, earlier)
    return view, found


class StreamReader:
    """Reads streams of the index from a time to their end as of `ends` (stream_ends), one
    after the other, each record's body to its handler when the gateway user signed it
    (unsigned ones to another, or none; another user's are left out: `doubts` counts both)."""

    def __init__(self, connection, names: Names, ends: Ends, trusted: str) -> None:
        self.connection, self.names, self.ends, self.trusted = connection, names, ends, trusted
        self.records = 0
        self.doubts = writers.Doubts()
        self._doubted: Set[Tuple[str, Optional[int]]] = set()
        self.progress: Callable[[], None] = lambda: None
        self.silent: List[str] = []

    def read(self, key: str, start_ms: int, handle: Callable[[bytes], object],
             unsigned: Optional[Callable[[bytes], object]] = None) -> None:
        """The stream of `key` from `start_ms` (epoch ms) to its end: the gateway user's
        records to `handle`, unsigned ones (before 1.0) to `unsigned` (None: left out)."""
        stream = self.names.waiting_stream(key)
        start = datetime.datetime.fromtimestamp(max(0.0, start_ms / 1000), datetime.timezone.utc)
        end = self.ends.offsets.get(stream)
        if end is None and stream not in self.silent:
            self.silent.append(stream)

        def on_record(properties, body: bytes) -> None:
            self.records += 1
            if body.startswith(MARK):
                return  # (a mark: nothing to read, whoever wrote it)
            found = writers.writer(properties.wire, self.trusted)
            if found is writers.Writer.GATEWAY:
                handle(body)
                return
            offset = offset_of(properties)
            if (stream, offset) not in self._doubted:  # (the done stream is read twice: count each once)
                self._doubted.add((stream, offset))
                self.doubts.count(found)
            if found is writers.Writer.UNSIGNED and unsigned is not None:
                unsigned(body)
        read_stream(self.connection, stream, start, end, on_record, PREFETCH, idle_s=QUIET_S, stall_s=STALL_S,
                    progress=lambda: self.progress(), progress_every_s=PROGRESS_EVERY_S)

    def gaps(self) -> List[Gap]:
        """Why what was read may not be the index as the gateways wrote it."""
        out = []
        if self.silent:
            out.append(Gap(f"{', '.join(self.silent)}: nothing came at its end within {END_WAIT_S:g} s (an empty "
                           "stream: declared by an earlier version and no gateway of this one started; or the broker "
                           "slow): read until it was quiet"))
        if self.doubts:
            out.append(Gap(self.doubts.why("the index")))
        return out


def problem(exc: BaseException) -> str:
    return f"reading the waiting streams failed: {exc}" if isinstance(exc, (AMQPError, TimeoutError)) else repr(exc)
