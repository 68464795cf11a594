"""What the broker holds, read with plain AMQP, and the steps that retire old chains.

Only what every broker allows: passive declares (does a queue or exchange exist; a queue's
ready messages and consumers: configure permission on RabbitMQ 4), reading a stream to its
end (read permission only: `stream_ends`, `read_stream`), reading the registry stream,
appending to it with publisher confirms, and deletes. No management plugin. A passive
declare of something missing closes its channel (404), so the Prober opens another one.
"""

import logging
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Set, Tuple

import pika
from pika.exceptions import ChannelClosedByBroker

from topology import registry as reg
from topology.broker.permissions import needing
from topology.names import Names
from topology.registry import ChainKey, Record, level_queues
from topology.retirement import (Count, DeleteExchange, DeleteQueue, MarkRetired, Observed, SealQueues, Step)
from topology.settings import MAX_LEVELS

# Reading the registry: an empty one (nothing at "last") is read until nothing more arrives
# for this long.
REGISTRY_IDLE_S = 0.25
REGISTRY_PREFETCH = 500


_quiet = threading.local()


class _ExpectedCloses(logging.Filter):
    """pika logs every channel the broker closes as a warning; a look at something that
    does not exist is an answer here, not a problem."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not getattr(_quiet, "on", False)


logging.getLogger("pika.channel").addFilter(_ExpectedCloses())


class Unknown(RuntimeError):
    """A passive declare failed for another reason than "not found"."""


class Prober:
    """Passive declares on one connection; a 404 costs a channel, which is replaced."""

    def __init__(self, connection) -> None:
        self.connection = connection
        self._channel = None
        self.looks = 0

    @property
    def channel(self):
        if self._channel is None or not self._channel.is_open:
            self._channel = self.connection.channel()
        return self._channel

    def queue(self, name: str) -> Optional[Count]:
        """Its ready messages and consumers, or None if it does not exist."""
        ok = self._look("queue", name, lambda ch: ch.queue_declare(name, passive=True))
        return None if ok is None else Count(ok.method.message_count, ok.method.consumer_count)

    def exchange(self, name: str) -> bool:
        return self._look("exchange", name, lambda ch: ch.exchange_declare(name, passive=True)) is not None

    def _look(self, kind: str, name: str, declare):
        self.looks += 1
        _quiet.on = True
        try:
            return declare(self.channel)
        except ChannelClosedByBroker as exc:
            self._channel = None
            if exc.reply_code == 404:
                return None
            raise Unknown(f"{kind} {name!r}: {exc.reply_text}") from None
        finally:
            _quiet.on = False

    def close(self) -> None:
        if self._channel is not None and self._channel.is_open:
            self._channel.close()


class Look:
    """Collects what a Prober finds into an Observed; failed looks stay unknown."""

    def __init__(self, prober: Prober) -> None:
        self.prober = prober
        self.queues: Dict[str, Optional[Count]] = {}
        self.exchanges: Dict[str, bool] = {}
        self.errors: List[str] = []

    def queue(self, name: str) -> Optional[Count]:
        if name not in self.queues:
            try:
                self.queues[name] = self.prober.queue(name)
            except Unknown as exc:
                self.errors.append(str(exc))
                return None
        return self.queues[name]

    def exchange(self, name: str) -> Optional[bool]:
        if name not in self.exchanges:
            try:
                self.exchanges[name] = self.prober.exchange(name)
            except Unknown as exc:
                self.errors.append(str(exc))
                return None
        return self.exchanges[name]

    def observed(self) -> Observed:
        return Observed(dict(self.queues), dict(self.exchanges))


def look_at_generation(look: Look, prefix: str, key: ChainKey, every_level: bool = False,
                       exchanges: bool = True) -> Set[ChainKey]:
    """Look at every object a chain of `key`'s generation can have: each level (up to the
    highest that exists, or all MAX_LEVELS with `every_level`), and the meditation and
    gateways queues of every level count (the level counts cannot be listed either, but
    there are only MAX_LEVELS of them). Returns the chains found by those queues."""
    names = Names(prefix, key.generation)
    found = set()
    for n in range(1, MAX_LEVELS + 1):
        meditation = look.queue(names.meditation(n))
        if exchanges:
            look.exchange(names.meditation(n))
        gateways = look.queue(names.gateways(n))
        if meditation is not None or gateways is not None:
            found.add(key.with_levels(n))
    highest = max([k.max_level for k in found] + [key.max_level])
    for k in range(MAX_LEVELS):
        exists = bool(look.exchange(names.level(k))) if exchanges else False
        for q in level_queues(key, names, k):
            exists = (look.queue(q) is not None) or exists
        if not exists and not every_level and k >= highest:
            break
    return found


# -- the registry stream --------------------------------------------------------------------
def close_stream_reader(channel) -> None:
    """Close a channel that consumes streams without cancelling its consumers first. pika's
    BlockingChannel cancels them on close (and on basic_cancel) and rejects what arrived
    meanwhile, which a stream refuses by closing the whole connection (540 NOT_IMPLEMENTED:
    basic.nack and basic.reject not supported by stream queues). Closing the channel ends its
    consumers on the broker all the same, and a stream keeps what it holds."""
    impl = channel._impl  # (the channel under the blocking adapter)
    if impl.is_open:
        impl.close()
    while not (impl.is_closed or channel.connection.is_closed):
        channel.connection.process_data_events(time_limit=0.002)


# Reading a stream to its end. AMQP does not say where a stream ends (a stream's passive
# declare says 0 messages, and needs configure permission on RabbitMQ 4), so a reader learns
# it by consuming at "last": the broker delivers the stream's last chunk, whose highest
# offset is the end as of then (`stream_ends`). It then reads from where it wants until it
# has read that offset (`read_stream`), and writes nothing. A stream that does not exist
# refuses the consume (404); an empty one delivers nothing at "last".
END_WAIT_S = 2.0  # "last" delivered nothing for this long: the end is not known
END_QUIET_S = 0.1  # the last chunk came: nothing more for this long, its highest offset is the end
END_BURST_S = 1.0  # ... or, on a stream that never pauses, this long after the first of it
END_PREFETCH = 64
PAST_END_S = 0.02  # the end came to the probe and nothing to the reader (before, or since): nothing to read
STALL_S = 60.0  # nothing at all from the broker for this long: the read fails


@dataclass
class Ends:
    """Each stream's end as of a moment (`stream_ends`)."""

    offsets: Dict[str, int] = field(default_factory=dict)  # the highest offset of its last chunk
    missing: Set[str] = field(default_factory=set)  # not declared (404)
    silent: Set[str] = field(default_factory=set)  # nothing at "last" in time: empty, or the broker slow


def _headers(properties) -> Any:
    wire = getattr(properties, "wire", None)  # (the gateway's connections: the exact headers)
    return wire.headers if wire is not None else (properties.headers or {})


def offset_of(properties) -> Optional[int]:
    """A stream record's offset (the broker's `x-stream-offset` header)."""
    found = _headers(properties).get("x-stream-offset")
    return found if isinstance(found, int) and not isinstance(found, bool) else None


class _Consumers:
    """Consumers of a stream on a channel of their own, started with callbacks on pika's
    channel under the blocking adapter, so that many channels start at once (a round trip
    for all of them, not several for each). `ready` once the broker took every consumer;
    `refused`: why the broker closed the channel (a 404, a 403), raised by `check`."""

    def __init__(self, connection, stream: str, consumers: Sequence[Tuple[int, object, Callable, str]]) -> None:
        """`consumers`: (prefetch, x-stream-offset, on_message(channel, method, properties,
        body), consumer tag), started in this order."""
        self.connection = connection
        self.channel: Any = None
        self.started = 0
        self.wanted = len(consumers)
        self.refused: Optional[BaseException] = None
        self._closing = False

        def on_open(channel) -> None:
            self.channel = channel
            channel.add_on_close_callback(self._on_close)
            for prefetch, offset, on_message, tag in consumers:
                channel.basic_qos(prefetch_count=prefetch)
                channel.basic_consume(stream, on_message, arguments={"x-stream-offset": offset}, consumer_tag=tag,
                                      callback=self._on_consume_ok)
        connection._impl.channel(on_open_callback=on_open)

    def _on_consume_ok(self, frame) -> None:
        self.started += 1

    def _on_close(self, channel, reason: BaseException) -> None:
        if not self._closing:
            self.refused = reason

    @property
    def ready(self) -> bool:
        return self.started == self.wanted

    def check(self) -> None:
        """Raise the broker's refusal, if it refused (a 403 as Refused: read is what it needs)."""
        if self.refused is not None:
            with needing("read"):
                raise self.refused

    def close(self) -> None:
        """Close the channel without cancelling its consumers first (`close_stream_reader`);
        `closed` says when the broker answered."""
        self._closing = True
        if self.channel is not None and self.channel.is_open:
            self.channel.close()

    @property
    def closed(self) -> bool:
        return self.channel is None or self.channel.is_closed or self.connection.is_closed


def _close_all(connection, readers: Iterable[_Consumers]) -> None:
    readers = list(readers)
    for reader in readers:
        reader.close()
    while not all(r.closed for r in readers):
        connection.process_data_events(time_limit=0.002)


def _missing(refused: BaseException) -> bool:
    return isinstance(refused, ChannelClosedByBroker) and refused.reply_code == 404


def _raise_first_refusal(connection, readers: List[_Consumers]) -> None:
    """Raise the refusal of the first reader, in the caller's order, that the broker refused
    (other than a 404), once each before it has answered: the refusals of streams opened at
    once arrive in any order, and the one line should name the same stream every time."""
    deadline = time.monotonic() + STALL_S
    for reader in readers:
        while reader.refused is None and not reader.ready and time.monotonic() < deadline:
            connection.process_data_events(time_limit=0.005)
        if reader.refused is not None and not _missing(reader.refused):
            _close_all(connection, readers)
            reader.check()


def stream_ends(connection, streams: Sequence[str], wait_s: float = END_WAIT_S) -> Ends:
    """Where each stream ends as of now: all at once, each on a channel of its own (a missing
    stream's 404 closes its channel). Needs read permission on each (a refusal: Refused)."""
    out = Ends()
    first: Dict[str, float] = {}
    last: Dict[str, float] = {}
    fixed: Set[str] = set()

    def consumer(stream: str):
        def on_message(channel, method, properties, body) -> None:
            if stream not in fixed:
                offset = offset_of(properties)
                if offset is not None:
                    out.offsets[stream] = max(offset, out.offsets.get(stream, -1))
                now = time.monotonic()
                first.setdefault(stream, now)
                last[stream] = now
            channel.basic_ack(method.delivery_tag)
        return on_message

    started = time.monotonic()
    _quiet.on = True
    try:
        readers = {s: _Consumers(connection, s, [(END_PREFETCH, "last", consumer(s), f"end-{uuid.uuid4().hex}")])
                   for s in streams}
        while len(fixed) < len(readers):
            connection.process_data_events(time_limit=0.005)
            now = time.monotonic()
            for stream, reader in readers.items():
                if stream in fixed:
                    continue
                if reader.refused is not None:
                    fixed.add(stream)
                    if _missing(reader.refused):
                        out.missing.add(stream)
                        continue
                    _raise_first_refusal(connection, list(readers.values()))
                elif stream in first:
                    if now - last[stream] >= END_QUIET_S or now - first[stream] >= END_BURST_S:
                        fixed.add(stream)
                elif now - started >= wait_s and reader.ready:
                    fixed.add(stream)
                    out.silent.add(stream)
                elif now - started >= STALL_S:
                    raise TimeoutError(f"the broker did not take a consumer of {stream} within {STALL_S:g} s")
    finally:
        _quiet.on = False
    _close_all(connection, readers.values())
    return out


def read_stream(connection, stream: str, start: object, end: Optional[int],
                on_record: Callable[[object, bytes], None], prefetch: int = REGISTRY_PREFETCH,
                idle_s: float = REGISTRY_IDLE_S, stall_s: float = STALL_S,
                progress: Optional[Callable[[], None]] = None, progress_every_s: float = 0.5) -> None:
    """Each record of `stream` from `start` (an `x-stream-offset`: "first", a time, an offset)
    up to and including the offset `end` (`stream_ends`) to on_record(properties, body);
    later ones are left aside. Where the start is past the end (a time after the last
    chunk's), the broker attaches the reader at the end and delivers nothing: a second
    consumer at `end` gets that record while the first gets none, and the reading is over.
    `end` None (not known): until nothing came for idle_s. Nothing at all from the broker
    for `stall_s`: TimeoutError. Needs read permission (a refusal: Refused)."""
    channel = connection.channel()
    state = _Reading(time.monotonic())

    def on_message(ch, method, properties, body) -> None:
        state.heard = time.monotonic()
        if not state.done:
            offset = offset_of(properties)
            state.read = True
            if end is not None and offset is not None and offset > end:
                state.done = True  # (attached past the end: a record appended since)
            else:
                on_record(properties, body)
                if end is not None and offset is not None and offset >= end:
                    state.done = True
        ch.basic_ack(method.delivery_tag)

    def on_probe(ch, method, properties, body) -> None:
        if state.probed is None:
            state.probed = time.monotonic()
        ch.basic_ack(method.delivery_tag)

    # The broker serves a channel's stream consumers in the order of their tags (and the
    # reader first, as it was first): what the reader has comes before the probe's record.
    tag = uuid.uuid4().hex
    with needing("read"):
        channel.basic_qos(prefetch_count=prefetch)
        channel.basic_consume(stream, on_message, arguments={"x-stream-offset": start}, consumer_tag=f"a-{tag}")
        if end is not None:
            channel.basic_consume(stream, on_probe, arguments={"x-stream-offset": end}, consumer_tag=f"z-{tag}")
    told = time.monotonic()
    try:
        while not state.done:
            connection.process_data_events(time_limit=0.005)
            now = time.monotonic()
            if end is None:
                if now - state.heard >= idle_s:
                    break
            elif state.probed is not None and not state.read and now - state.probed >= PAST_END_S:
                break
            elif now - state.heard > stall_s:
                raise TimeoutError(f"nothing came from {stream} for {stall_s:g} s: is the broker overloaded, "
                                   "or the stream's member down?")
            if progress is not None and now - told >= progress_every_s:
                told = now
                progress()
    finally:
        if channel.is_open:
            close_stream_reader(channel)


@dataclass
class _Reading:
    heard: float  # when the reader last got a record
    read: bool = False  # it got one
    done: bool = False  # it read the end (or past it)
    probed: Optional[float] = None  # when the probe at the end got its record


def read_registry(connection, names: Names, idle_s: float = REGISTRY_IDLE_S) -> Optional[List[Record]]:
    """Every record, oldest first, up to the stream's end as of now (`stream_ends`; an empty
    registry: until nothing came for idle_s); None if the registry stream does not exist.
    Needs read permission on it, nothing else."""
    ends = stream_ends(connection, [names.registry], wait_s=idle_s)
    if names.registry in ends.missing:
        return None
    bodies: List[bytes] = []
    read_stream(connection, names.registry, "first", ends.offsets.get(names.registry),
                lambda properties, body: bodies.append(body), REGISTRY_PREFETCH, idle_s)
    return [r for r in (reg.decode(b) for b in bodies) if r is not None]


def append(connection, names: Names, records: Iterable[Record]) -> None:
    """Publish records to the registry; returns once the broker confirmed them."""
    channel = connection.channel()
    channel.confirm_delivery()
    for record in records:
        channel.basic_publish(names.registry, "", reg.encode(record),
                              pika.BasicProperties(content_type="application/json", delivery_mode=2),
                              mandatory=True)
    channel.close()


# -- carrying out retirement steps ----------------------------------------------------------
class Executor:
    """Runs the planned sequences; each stops at its first step that cannot be done.
    `report(event, **fields)` is told what happened (the caller logs it)."""

    def __init__(self, connection, names: Names, clock: Callable[[], int],
                 report: Callable[..., None]) -> None:
        self.connection, self.names, self.clock, self.report = connection, names, clock, report
        self.prober = Prober(connection)
        self.done: List[Step] = []

    def run(self, sequences: Iterable[List[Step]]) -> List[Step]:
        for steps in sequences:
            for step in steps:
                if not self._do(step):
                    break
                self.done.append(step)
        self.prober.close()
        return self.done

    def _in_use(self, guard: Tuple[str, ...]) -> Optional[str]:
        for name in guard:
            try:
                count = self.prober.queue(name)
            except Unknown as exc:
                return str(exc)
            if count is not None and count.consumers:
                return f"{count.consumers} gateway(s) on {name}"
        return None

    def _do(self, step: Step) -> bool:
        if isinstance(step, SealQueues):
            append(self.connection, self.names, [Record("sealed", self.clock(), queues=step.empty_by)])
            self.report("chain_queues_sealed", queues=dict(step.empty_by))
            return True
        if isinstance(step, MarkRetired):
            append(self.connection, self.names, [Record("retired", self.clock(), step.chain)])
            self.report("chain_retired", chain=step.chain.describe())
            return True
        busy = self._in_use(step.guard)
        if busy:
            self.report("retire_blocked", object=step.name, reason=busy)
            return False
        if isinstance(step, DeleteExchange):
            self.prober.channel.exchange_delete(step.name)
            self.report("chain_exchange_deleted", exchange=step.name)
            return True
        return self._delete_queue(step)

    def _delete_queue(self, step: DeleteQueue) -> bool:
        try:
            count = self.prober.queue(step.name)
        except Unknown as exc:
            self.report("retire_blocked", object=step.name, reason=str(exc))
            return False
        if count is None:
            return True
        if count.messages:
            return self._not_empty(step, count.messages)
        try:
            # Classic queues: "if empty" makes the check and the delete one step. Quorum and
            # stream queues refuse that flag (540, closing the connection); for them the
            # seal's time and the count just read are the proof.
            ok = self.prober.channel.queue_delete(step.name, if_empty=step.classic)
        except ChannelClosedByBroker as exc:
            self.prober._channel = None
            if exc.reply_code == 406:
                return self._not_empty(step, None)
            raise
        deleted = ok.method.message_count
        if deleted:  # cannot happen when the seal holds; say so loudly if it ever does
            self.report("retire_deleted_messages", queue=step.name, messages=deleted)
        self.report("chain_queue_deleted", queue=step.name)
        return True

    def _not_empty(self, step: DeleteQueue, messages: Optional[int]) -> bool:
        if step.reseal_ms:
            empty_by = self.clock() + step.reseal_ms
            append(self.connection, self.names, [Record("sealed", self.clock(), queues={step.name: empty_by})])
        self.report("retire_queue_not_empty", queue=step.name, messages=messages)
        return False
