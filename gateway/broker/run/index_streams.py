"""The index of what waits, as the gateways write it: beats and marks, and notes of where
messages may wait unlisted (what the records mean: gateway/core/index_records.py; reading
them for `pending` and `status`: gateway/broker/tools/index_reader.py).

Writing (a gateway's upkeep thread): every BEAT_EVERY_MS a beat into the done stream, with
what the gateway sees of the queues where messages wait for it (a passive declare of each,
which needs configure permission, which a gateway has and a reader need not); and, once a
process, a mark into each stream of the index, so that none is empty (an empty stream says
nothing of its end). Every record is signed with the gateway's user (gateway/core/writers.py).
`looked` is the passive look a reader also takes where it may.
"""

import time
import uuid
from typing import Any, Callable, Dict, List, Optional, Sequence

import structlog
from pika.exceptions import ChannelClosedByBroker

from topology import Topology
from topology.broker.declare import declare
from topology.broker.inventory import Prober, Unknown, append
from topology.names import Names
from topology.registry import Record
from topology.settings import QUEUE_TYPES, ChainSettings
from topology.index_bands import DONE, band_key, bands

from gateway.broker.plumbing import lazy_properties
from gateway.broker.plumbing.amqp import login_user
from gateway.clock import wall_ms
from gateway.core import cancels, index_records, writers
from gateway.core.index_records import Place
from gateway.core.index_records import Consumers
from gateway.core.wire import Properties
from gateway.times import iso_s

MARK = b"DGM1"  # a mark (and 16 random bytes): each gateway appends one to each stream as it starts
READING_CLEARED_S = 1.0  # at most this often, a beat saying check-in no longer holds what it read
RECORD = Properties.build(delivery_mode=2)
DAY_MS = 86_400_000


class Beats:
    """A gateway's beat, every BEAT_EVERY_MS, into the done stream (from the upkeep thread):
    which roles it runs, how many consumers of each kind (`consumers`, set by the worker's
    session), whether it writes entries, the earliest due time of what its distributor
    holds (`low`, set by the worker; now when nothing), and what it sees of the queues where
    messages wait for a gateway (`look`). Signed with the connection's user."""

    def __init__(self, names: Names, role: str, indexes: bool = True) -> None:
        self.names = names
        self.id = uuid.uuid4().bytes
        self.roles = (index_records.ROLE_CHECK_IN if role in ("all", "check-in") else 0) \
            | (index_records.ROLE_DISTRIBUTOR if role in ("all", "distributor") else 0)
        self.flags = index_records.INDEXES if indexes else 0
        self.low: Callable[[], Optional[int]] = lambda: None
        # (set by the worker's session, read here: messages check-in read and has not sent on
        # yet, and whether the broker blocks its publishes; readers say the answer is not exact)
        self.reading: Callable[[], bool] = lambda: False
        self.blocked: Callable[[], bool] = lambda: False
        self.consumers = Consumers()
        self._channel: Any = None
        self._prober: Optional[Prober] = None
        self._sent = 0.0
        self._said_reading = False  # the last beat said check-in held messages it had read
        self._off = False
        self.log = structlog.get_logger("gateway").bind(part="upkeep")

    def maybe(self, connection) -> None:
        if self._off:
            return
        since = time.monotonic() - self._sent
        # (a beat that said check-in held what it had read is followed, within a second, by one
        # saying it no longer does: until then readers call their answers inexact)
        if since < index_records.BEAT_EVERY_MS / 1000 and not (
                self._said_reading and since >= READING_CLEARED_S and not self.reading()):
            return
        self._sent = time.monotonic()
        seen = self.look(connection)
        now = wall_ms()
        low = self.low()
        try:
            if self._channel is None or not self._channel.is_open:
                self._channel = connection.channel()
            flags = self.flags | (index_records.READING if self.reading() else 0) \
                | (index_records.BLOCKED if self.blocked() else 0)
            self._said_reading = bool(flags & index_records.READING)
            self._channel.basic_publish(self.names.waiting, DONE, index_records.pack_beat(
                self.id, self.roles, now if low is None else min(low, now), now, self.consumers, flags, seen),
                lazy_properties.WireProperties(record_properties(connection)))
        except ChannelClosedByBroker as exc:  # the exchange is missing: an older topology
            self._channel = None
            if exc.reply_code == 404:
                self._off = True
                self.log.warning("waiting_beats_off", exchange=self.names.waiting,
                                 fix="run `delay-gateway declare` with this version")

    def look(self, connection) -> Optional[index_records.Seen]:
        """What this gateway sees of the queues where messages wait for a gateway (None: a
        look was refused)."""
        if self._prober is None or self._prober.connection is not connection:
            self._prober = Prober(connection)
        try:
            return seen_queues(self._prober, self.names)
        except Unknown:
            return None

    def count(self, consumers: Consumers) -> None:
        """The worker's session consumes these now: beat soon, so that readers know at once."""
        self.consumers = consumers
        self._sent = 0.0

    def forget(self) -> None:
        """The connection is gone."""
        self._channel = None
        self._prober = None


def looked(connection, names: Names) -> Optional[Dict[str, Place]]:
    """The queues where messages wait for a gateway, as the broker says now, where this reader
    may look (a passive declare needs configure permission: an operator's, the gateway's);
    None where it may not."""
    prober = Prober(connection)
    try:
        return seen_queues(prober, names).places()
    except Unknown:
        return None
    finally:
        prober.close()


def seen_queues(prober: Prober, names: Names) -> index_records.Seen:
    """Ready messages and consumers of check-in (and retry), of every returning exit and of
    every distributor exit (a missing queue counts nothing). Raises Unknown."""
    def place(queues: Sequence[str]) -> Place:
        counts = [c for c in (prober.queue(q) for q in queues) if c is not None]
        return Place(sum(c.messages for c in counts), sum(c.consumers for c in counts))
    return index_records.Seen(place([names.check_in, names.retry]),
                              place([names.exit_returning(t) for t in QUEUE_TYPES]),
                              place([names.exit_distributor(t) for t in QUEUE_TYPES]))


def record_properties(connection) -> Properties:
    """A record's properties, signed with the user the connection logged in as."""
    user = login_user(connection)
    return RECORD if user is None else writers.signed(RECORD, user)


def index_keys(chain: ChainSettings) -> List[str]:
    """The streams of a chain's index, by routing key: the done stream and its bands."""
    return [DONE] + [band_key(b) for b in range(bands(chain))]


def mark_streams(connection, chain: ChainSettings, cancellations: bool = False) -> None:
    """Append a mark (signed) to each stream of the index (and, `cancellations`, to the
    cancellations stream), so that none is empty: a reader finds a stream's end by its last
    chunk, and an empty stream has none. Confirmed."""
    channel = connection.channel()
    channel.confirm_delivery()
    props = record_properties(connection)
    for key in index_keys(chain):
        channel.basic_publish(chain.names.waiting, key, MARK + uuid.uuid4().bytes,
                              lazy_properties.WireProperties(props), mandatory=True)
    if cancellations:
        user = login_user(connection)
        mark = cancels.mark(uuid.uuid4().hex.encode())
        channel.basic_publish(chain.names.cancellations, "", b"",
                              lazy_properties.WireProperties(mark if user is None else writers.signed(mark, user)),
                              mandatory=True)
    channel.close()


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
    """Declare (or, `declaring=verify`, find) the topology; if that created the index, mark its
    streams and the cancellations stream (`mark_streams`), and where messages already wait,
    say so in the registry (`note_messages_before_index`)."""
    prober = Prober(channel.connection)
    try:
        missing = index_missing(prober, topology.settings.names)
    except Unknown:  # (a look refused: the declare says what is wrong, in its own words)
        missing = False
    prober.close()
    declaring(channel, topology)
    if missing and declaring is declare:
        note_messages_before_index(channel.connection, topology.settings, wall_ms())
        mark_streams(channel.connection, topology.settings, cancellations=True)  # (none is left empty)


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
