"""The index of what waits on the broker: the gateways' beats, and reading the waiting
streams for `delay-gateway pending` (what the records mean: gateway/core/waiting.py).

Reading: passive declares say whether messages wait unread where a gateway should take
them (the distributor and returning queues) and who consumes them; the done stream's last
seconds hold the gateways' beats; from both the reader knows how far back a message may be
overdue (`waiting.horizon`). It then reads the done records since then, and each band from
its span before; each stream up to its end as of the start, which it learns by appending a
mark of its own and reading until it comes back (AMQP does not say where a stream ends).
"""

import datetime
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import structlog
from pika.exceptions import AMQPError, ChannelClosedByBroker

from topology.broker.inventory import Prober
from topology.names import Names
from topology.settings import QUEUE_TYPES
from topology.waiting import BANDS, DONE, RETENTION_SLACK_MS, band_key

from gateway.broker import lazy_properties
from gateway.clock import wall_ms
from gateway.core import waiting
from gateway.core.wire import Properties

MARK = b"DGM1"
PREFETCH = 64  # records (each up to a carrier's worth of entries) unacknowledged per stream
CLOCKS_MS = 60_000  # read this much earlier: the streams' chunk times are the broker's clock
MARK_TIMEOUT_S = 120.0
RECORD = Properties.build(delivery_mode=2)


class Beats:
    """A gateway's beat, every BEAT_EVERY_MS, into the done stream (from the upkeep thread):
    which roles it runs, and the earliest due time of what its distributor holds (`low`,
    set by the worker; now when nothing)."""

    def __init__(self, names: Names, role: str) -> None:
        self.names = names
        self.id = uuid.uuid4().bytes
        self.roles = (waiting.ROLE_CHECK_IN if role in ("all", "check-in") else 0) \
            | (waiting.ROLE_DISTRIBUTOR if role in ("all", "distributor") else 0)
        self.low: Callable[[], Optional[int]] = lambda: None
        self._channel: Any = None
        self._sent = 0.0
        self._off = False
        self.log = structlog.get_logger("gateway").bind(part="upkeep")

    def maybe(self, connection) -> None:
        if self._off or time.monotonic() - self._sent < waiting.BEAT_EVERY_MS / 1000:
            return
        self._sent = time.monotonic()
        now = wall_ms()
        low = self.low()
        try:
            if self._channel is None or not self._channel.is_open:
                self._channel = connection.channel()
            self._channel.basic_publish(self.names.waiting, DONE, waiting.pack_beat(
                self.id, self.roles, now if low is None else min(low, now), now),
                lazy_properties.WireProperties(RECORD))
        except ChannelClosedByBroker as exc:  # the exchange is missing: an older topology
            self._channel = None
            if exc.reply_code == 404:
                self._off = True
                self.log.warning("waiting_beats_off", exchange=self.names.waiting,
                                 fix="run `delay-gateway declare` with this version")

    def forget(self) -> None:
        """The connection is gone."""
        self._channel = None


# -- reading -----------------------------------------------------------------------------------
@dataclass
class Found:
    """What a reading found beside the view: the streams read, and what was left unread."""

    horizon: waiting.Horizon
    bands: List[int]
    unread_check_in: Optional[int]  # messages in check-in no gateway has read yet (not listed)
    records: int = 0
    notes: List[str] = field(default_factory=list)


class Missing(RuntimeError):
    """The waiting streams are not declared under the prefix."""


def read(connection, names: Names, now_ms: int,
         make_view: Callable[[waiting.Horizon], waiting.View]) -> Tuple[waiting.View, Found]:
    """Read the index into a view (see the module doc). Raises Missing."""
    prober = Prober(connection)
    places: Dict[str, Tuple[int, int]] = {}
    for place, exits in (("distributor", names.exit_distributor), ("returning", names.exit_returning)):
        counts = [c for c in (prober.queue(exits(t)) for t in QUEUE_TYPES) if c is not None]
        places[place] = (sum(c.messages for c in counts), sum(c.consumers for c in counts))
    check_in = prober.queue(names.check_in)
    bands = [b for b in range(BANDS) if prober.queue(names.waiting_stream(band_key(b))) is not None]
    done_there = prober.queue(names.waiting_stream(DONE)) is not None
    prober.close()
    if not bands or not done_there:
        raise Missing(f"the waiting streams ({names.waiting_stream('NN')}) are not declared under prefix "
                      f"{names.prefix!r}: run `delay-gateway declare` with this version (the gateways then list "
                      "what they send on from that moment)")
    reader = StreamReader(connection, names)
    recent: List[waiting.Beat] = []
    done: List[int] = []

    def on_done(body: bytes) -> None:
        found = waiting.beat(body)
        if found is not None:
            recent.append(found)
        else:
            done.extend(waiting.done_keys(body))
    since = now_ms - waiting.LIVE_MS - CLOCKS_MS
    reader.read({DONE: since}, {DONE: on_done})
    at = waiting.horizon(now_ms, recent, places)
    if at.at_ms - CLOCKS_MS < since:  # overdue messages may be older: their done records too
        reader.read({DONE: at.at_ms - CLOCKS_MS}, {DONE: lambda body: done.extend(waiting.done_keys(body))})
    view = make_view(at)
    view.add_done(done)
    def on_entries(body: bytes) -> None:
        for m in waiting.entries(body):
            view.add(m)
    reader.read({band_key(b): waiting.read_from_ms(b, at) - CLOCKS_MS for b in bands},
                {band_key(b): on_entries for b in bands})
    view.finish()
    result = Found(at, bands, None if check_in is None else check_in.messages, reader.records)
    if not at.exact:
        result.notes.append(f"{at.why}: everything the streams keep was read (up to "
                            f"{RETENTION_SLACK_MS // 3_600_000} h past due)")
    return view, result


class StreamReader:
    """Reads streams from a time to their end (as of the start), all at once on one channel."""

    def __init__(self, connection, names: Names) -> None:
        self.connection, self.names = connection, names
        self.records = 0

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
                if body == token:
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
        deadline = time.monotonic() + MARK_TIMEOUT_S
        while reading:
            if time.monotonic() > deadline:
                raise TimeoutError(f"the end of {', '.join(self.names.waiting_stream(k) for k in reading)} did "
                                   f"not come back within {MARK_TIMEOUT_S:g} s")
            self.connection.process_data_events(time_limit=0.05)
            while ended:
                channel.basic_cancel(reading.pop(ended.pop()))
        channel.close()

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
