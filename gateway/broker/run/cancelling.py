"""Cancels on the broker: their objects, following the cancellations stream, and the judge
the consumers ask (the decision itself is gateway/core/cancels.py).

Objects (in the topology model, topology/model.py; none depends on the chain's settings):
- `<prefix>.cancel`: a durable fanout exchange without arguments, so any client's plain
  declare of it succeeds. Publishers send a cancel there: the id to cancel as the
  message's `message_id`, nothing else needed. It is bound to the check-in *queue*, so a
  cancel queues behind every message published before it.
- `<prefix>.cancellations`: a fanout exchange and the stream behind it. The check-in
  consumer appends one record per cancel (with publisher confirms; the cancel is
  acknowledged only then). The stream's `x-max-age` is the retention window the first
  gateway declared it with; RabbitMQ removes whole segments older than that.

Every gateway process follows the stream in a thread of its own with its own connection
(like upkeep.py), from the start of the window, into a `Store` (cancels by id) and `Rules`
(group cancels: gateway/core/rules.py); it starts consuming its queues only once it has read
up to the stream's end (a mark it appends itself), so a restarted gateway, or a replica
started after a cancel, knows every cancel and rule of the window before it reads a single
message. The same thread appends this process's tallies: how many messages each rule
removed so far.
"""

import datetime
import itertools
import threading
import time
import uuid
from typing import Any, Dict, List, Optional, Tuple

import structlog
from pika.exceptions import AMQPError, ChannelClosedByBroker

from gateway.broker.plumbing import lazy_properties, wire_connection
from gateway.broker.plumbing.amqp import Trouble, classify, login_user, parameters
from gateway.broker.run import launch
from gateway.clock import wall_ms
from gateway.core import cancels, envelope, index_records, rules, writers
from gateway.core.actions import Action, Forward
from gateway.core.inputs import Delivery
from gateway.core.routes import Way
from gateway.core.effects import Handler
from gateway.core.carrier import Entry
from gateway.core.cancels import Store
from gateway.core.rules import Rules
from gateway.core.wire import Properties
from gateway.metrics import Metrics
from gateway.settings import Settings
from gateway.urls import redact

PREFETCH = 2000
PRUNE_EVERY_S = 1.0
TALLY_EVERY_S = 5.0
MISSING_RETRY_S = 0.3
MISSING_S = 3.0
RESERVED_AHEAD_US = 3_600_000_000  # a reservation further ahead of our clock is ignored


def handle_of(entry: Entry) -> bytes:
    """The handle `pending` lists a message by (b"" for one read before read times were kept)."""
    if entry.accepted_us is None:
        return b""
    return cancels.handle(entry.accepted_us, cancels.checksum(entry.routing_key, entry.user.raw,
                                                              entry.body)).encode("ascii")


def first_handle_of(entry: Entry) -> bytes:
    """The handle the index's first layout listed a message by (345936a..bc3eba0: the CRC-32 of
    its routing key alone, index_records.first_checksum), which a cancel of that time names."""
    if entry.accepted_us is None:
        return b""
    return cancels.handle(entry.accepted_us, index_records.first_checksum(entry.routing_key)).encode("ascii")


def signed(props: Properties, connection: object) -> Properties:
    """What the follower appends, signed by the user it logged in as (writers.py: readers trust
    only the gateway user's records); unsigned where the login names no user (EXTERNAL)."""
    user = login_user(connection)
    return props if user is None else writers.signed(props, user)


def taken_in_at(entry: Entry) -> Optional[cancels.Time]:
    """When a message was taken in, as cancels and rules are judged against it: its read time,
    and the broker's arrival stamp of its publish (a retry's: of its first publish, which a
    cancel published after it follows), judged plausible against the read time, not the
    judging gateway's clock. None: before read times were kept."""
    if entry.accepted_us is None:
        return None
    return cancels.Time(entry.accepted_us, envelope.broker_stamp(entry.user.headers, entry.accepted_us // 1000))


class Judge:
    """handlers.Cancelled over the cancels by id (a Store) and the rules held: decides, and
    counts and logs each drop (and, per rule, in `tally`, which the follower publishes)."""

    def __init__(self, store: Store, held_rules: Rules, metrics: Metrics, tally: Dict[bytes, int]) -> None:
        self.store, self.rules, self.metrics, self.tally = store, held_rules, metrics, tally
        self.log = structlog.get_logger("gateway")

    def holds(self, recorded: Dict[Tuple[str, bytes], int]) -> bool:
        """Whether these records (("id", id) or ("rule", name) -> read time) are all held."""
        return all(self.rules.holds(key, at) if kind == "rule" else self.store.holds({key: at})
                   for (kind, key), at in recorded.items())

    def __call__(self, entry: Entry, where: str) -> bool:
        if not len(self.store) and not len(self.rules):  # the usual case: nothing to read
            return False
        message_id = entry.user.get("message_id")
        message_id = message_id if isinstance(message_id, bytes) and message_id else None
        taken_in = taken_in_at(entry)
        arrived = taken_in.arrived_ms if taken_in else None
        if len(self.store):
            if entry.accepted_us in self.store.handle_times and (
                    self.store.get(handle_of(entry)) or self.store.get(first_handle_of(entry))):
                return self._dropped(entry, where, None)  # cancelled by its handle: exactly this message
            held = self.store.get(message_id)
            if held is not None and held.cancels(taken_in):
                return self._dropped(entry, where, held.newest_read_us, arrived)
        rule = self.rules.first(message_id, entry.routing_key, entry.due_ms, entry.exchange == "",
                                lambda: entry.user.headers, lambda: handle_of(entry), entry.accepted_us, taken_in)
        if rule is None:
            return False
        self.tally[rule.name] = self.tally.get(rule.name, 0) + 1
        return self._dropped(entry, where, rule.at.read_us, arrived, rule.name)

    def _dropped(self, entry: Entry, where: str, cancelled_us: Optional[int], arrived_ms: Optional[int] = None,
                 rule: Optional[bytes] = None) -> bool:
        self.metrics.cancelled.labels(where).inc()
        self.log.info("cancelled_message_dropped", message_id=entry.user.text("message_id"), where=where,
                      due_ms=entry.due_ms, cancelled_us=cancelled_us, accepted_us=entry.accepted_us,
                      arrived_ms=arrived_ms, **({} if rule is None else {"rule": rule.decode("utf-8", "replace")}))
        return True


def recording(check_in: Handler, metrics: Metrics) -> Handler:
    """The check-in handler, counting and logging each cancel it records."""
    log = structlog.get_logger("gateway")

    def handle(d: Delivery, now: int) -> List[Action]:
        actions = check_in(d, now)
        for action in actions:
            if isinstance(action, Forward) and action.way is Way.CANCEL:
                metrics.cancels.inc()
                found = cancels.read_record(action.props.headers)
                if found is not None:
                    log.info("cancel_recorded", message_id=found[0].decode("utf-8", "backslashreplace"),
                             cancelled_us=found[1].read_us, arrived_ms=found[1].arrived_ms)
                    continue
                rule = rules.read_record(action.props.headers, action.body)
                if isinstance(rule, rules.Rule):
                    log.info("rule_recorded", rule=rule.name.decode("utf-8", "backslashreplace"),
                             select=rule.select.describe(), cancelled_us=rule.at.read_us,
                             arrived_ms=rule.at.arrived_ms)
                elif isinstance(rule, rules.Withdrawal):
                    log.info("rule_withdrawal_recorded", rule=rule.name.decode("utf-8", "backslashreplace"),
                             cancelled_us=rule.at.read_us)
        return actions
    return handle


class Follower:
    """Reads the cancellations stream into the store and the rules, from the window's start,
    for ever; appends this process's tallies."""

    def __init__(self, settings: Settings, store: Store, metrics: Metrics, stop: threading.Event) -> None:
        self.settings, self.store, self.metrics, self.stop = settings, store, metrics, stop
        self.rules = Rules(store.window_us // 1000)
        self.tally: Dict[bytes, int] = {}  # rule name -> messages removed by it (Judge counts)
        self._published: Dict[bytes, int] = {}  # what the stream has of this process's tally
        self._tallied = 0.0
        self.id = uuid.uuid4().bytes
        self.names = settings.chain.names
        # Check-in's read times, one sequence for the process: above every read time its prefix
        # recorded, and reserved in the stream before they are handed out (cancels.Sequencer).
        self.sequence = cancels.Sequencer(ceiling=0)
        self.reserved_us = 0  # the highest reservation of any process read from the stream
        self._reserving = settings.role in ("all", "check-in")
        self._caught_up = False  # read up to our mark, not yet ready
        self._writer: Any = None  # a channel with confirms, for reservations
        self.ready = threading.Event()  # read up to the stream's end at least once
        self.log = structlog.get_logger("gateway").bind(part="cancellations")
        self.problem: Optional[Trouble] = None  # why the last attempt to read the stream failed
        self._next: Optional[int] = None  # the stream offset to resume from
        self._mark: Optional[bytes] = None
        self._pruned = 0.0
        metrics.cancellations_following.set(0)

    def wait_ready(self) -> Optional[Trouble]:
        """Block until the stream was read to its end, or stop: None. Or why it cannot be, once
        that lasted MISSING_S (the stream is missing: the worker reports it like any other
        missing object, and gives up after a few attempts)."""
        since = time.monotonic()
        while not self.stop.is_set():
            if self.ready.wait(0.2):
                return None
            if self.problem is not None and time.monotonic() - since > MISSING_S:
                return self.problem
        return None

    def run(self) -> None:
        urls = itertools.cycle(self.settings.urls)
        failures = 0
        while not self.stop.is_set():
            url = next(urls)
            connection = None
            try:
                connection = wire_connection.blocking(parameters(url, "delay-gateway cancellations", self.settings.tls))
                self._session(connection)
            except ChannelClosedByBroker as exc:
                # Back off over attempts that fail alike; a session that read the stream (it
                # cleared `problem`) starts the count again.
                failures = 0 if self.problem is None else failures
                if exc.reply_code != 404:
                    failures += 1
                    trouble = classify(exc, url)
                    if self.problem is None or trouble.message != self.problem.message:  # news only
                        self.log.warning("cancellations_channel_closed", broker=redact(url), error=repr(exc))
                    self.problem = trouble
                    self.stop.wait(min(10.0, 0.2 * 2 ** min(failures, 6)))
                    continue
                # At start the worker may not have declared it yet: look again soon, quietly.
                if self.problem is None:
                    self.log.info("cancellations_missing", queue=self.names.cancellations)
                self.problem = Trouble(False, f"queue {self.names.cancellations!r} (the cancellations stream) not "
                                              "found: run `delay-gateway declare` with this version, or start "
                                              "without --no-declare")
                failures = 0
                self.stop.wait(MISSING_RETRY_S)
                continue
            except AMQPError as exc:
                failures = (0 if self.problem is None else failures) + 1
                self.problem = classify(exc, url)
                if self.ready.is_set():  # (before, the worker reports it)
                    self.log.warning("cancellations_connection_lost", broker=redact(url), error=repr(exc))
            except Exception:  # following must never take the consumers down with it
                failures += 1
                self.log.exception("cancellations_failed")
            finally:
                self.metrics.cancellations_following.set(0)
                if connection is not None and connection.is_open:
                    try:
                        connection.close()
                    except AMQPError:
                        pass
            self.stop.wait(min(10.0, 0.2 * 2 ** min(failures, 6)))

    def _start(self) -> object:
        return self._next if self._next is not None else window_start(self.store.window_us // 1000)

    def judge(self, metrics: Metrics) -> Judge:
        return Judge(self.store, self.rules, metrics, self.tally)

    def newest_read_us(self) -> int:
        """Of every cancel, rule and reservation held: where this process's read times start."""
        reserved = self.reserved_us + cancels.OVERFLOW_US if self.reserved_us else 0
        return max(self.store.newest_read_us, self.rules.newest_read_us, reserved)

    def _reserve(self, connection) -> None:
        """Record a reservation before the read times reach the last one (a confirmed publish:
        only then may they be handed out)."""
        until = self.sequence.wanted(wall_ms())
        if until is None:
            return
        if self._writer is None or not self._writer.is_open:
            self._writer = connection.channel()
            self._writer.confirm_delivery()
        self._writer.basic_publish(self.names.cancellations, "", b"",
                                   lazy_properties.WireProperties(signed(cancels.reservation(until), connection)),
                                   mandatory=True)
        self.sequence.reserved(until)

    def _now_ready(self, connection) -> None:
        """Read up to our mark: read times start above every one recorded, a first reservation
        is recorded, and the consumers may start."""
        self._caught_up = False
        if self._reserving:
            self.sequence.above(self.newest_read_us())
            self._reserve(connection)
        self.ready.set()
        self.metrics.cancellations_following.set(1)
        self.metrics.cancellations_held.set(len(self.store))
        self.metrics.rules_held.set(len(self.rules))
        self.log.info("cancellations_read", held=len(self.store), rules=len(self.rules),
                      window_s=self.store.window_us // 1_000_000, reads_above_us=self.newest_read_us())

    def _publish_tallies(self, connection) -> None:
        """What each rule removed here since the last time, as this process's running total."""
        changed = {name: n for name, n in list(self.tally.items()) if self._published.get(name) != n}
        if not changed:
            return
        channel = connection.channel()
        for name, removed in changed.items():
            channel.basic_publish(self.names.cancellations, "", b"",
                                  lazy_properties.WireProperties(signed(rules.tally_record(name, self.id, removed),
                                                                        connection)))
        channel.close()
        self._published.update(changed)

    def _forget_tallies(self) -> None:
        """The tallies of rules no longer held (past the window): they report nothing more."""
        for name in [n for n in self.tally if n not in self.rules.recorded]:
            self.tally.pop(name, None)
            self._published.pop(name, None)

    def _session(self, connection) -> None:
        channel = connection.channel()
        channel.queue_declare(self.names.cancellations, passive=True)
        channel.basic_qos(prefetch_count=PREFETCH)
        ended: List[object] = []  # the broker cancelled the consumer: the stream deleted, or its member gone
        channel.add_on_cancel_callback(ended.append)
        channel.basic_consume(self.names.cancellations, self._on_record,
                              arguments={"x-stream-offset": self._start()})
        self.problem = None  # consuming: a passive declare needs no permission, a consume does
        if self.ready.is_set():  # back, reading on from where it stopped
            self.metrics.cancellations_following.set(1)
        else:
            # The stream's end, as of now: a record of our own. Read back, everything before
            # it has been read.
            self._mark = uuid.uuid4().hex.encode()
            publisher = connection.channel()
            publisher.confirm_delivery()
            publisher.basic_publish(self.names.cancellations, "", b"",
                                    lazy_properties.WireProperties(signed(cancels.mark(self._mark), connection)),
                                    mandatory=True)
            publisher.close()
        self._writer = None
        while not self.stop.is_set() and not ended:
            connection.process_data_events(time_limit=0.2)
            if self._caught_up:
                self._now_ready(connection)
            elif self.ready.is_set() and self._reserving:
                self._reserve(connection)
            if time.monotonic() - self._pruned > PRUNE_EVERY_S:
                self._pruned = time.monotonic()
                self.store.prune(wall_ms())
                if self.rules.prune(wall_ms()):
                    self._forget_tallies()
                self.metrics.cancellations_held.set(len(self.store))
                self.metrics.rules_held.set(len(self.rules))
            if time.monotonic() - self._tallied > TALLY_EVERY_S:
                self._tallied = time.monotonic()
                self._publish_tallies(connection)
        if ended:  # (run connects again and reads on from where it stopped)
            self.log.warning("cancellations_consumer_cancelled", queue=self.names.cancellations)

    def _on_record(self, channel, method, properties, body) -> None:
        headers = writers.cancellation_headers(properties.wire, self.settings.trusted_user)  # (trusted only)
        offset = headers.get("x-stream-offset")
        if isinstance(offset, int):
            self._next = offset + 1
        found = cancels.read_record(headers)
        if found is not None:
            self.store.add(found[0], found[1], wall_ms())
        elif (rule := rules.read_record(headers, body)) is not None:
            if self.rules.add(rule, wall_ms()) and isinstance(rule, rules.Refused):
                self.log.warning("rule_record_refused", rule=rule.name.decode("utf-8", "backslashreplace"),
                                 recorded_us=rule.at.read_us, why=rule.why, cancels="nothing")
        elif (reserved := cancels.read_reservation(headers)) is not None:
            # (one an hour or more ahead of this clock is not a gateway's: they reserve 30 s ahead)
            if reserved <= wall_ms() * 1000 + RESERVED_AHEAD_US:
                self.reserved_us = max(self.reserved_us, reserved)
        elif self._mark is not None and cancels.read_mark(headers) == self._mark:
            self._mark = None
            self._caught_up = True  # (ready once the loop has recorded a reservation)
        channel.basic_ack(method.delivery_tag)


def window_start(window_ms: int) -> datetime.datetime:
    """Where reading the stream starts: the window's start, by the broker's chunk times, with
    a minute to spare for clocks (older records are pruned as they are read)."""
    start_s = (wall_ms() - window_ms) / 1000 - 60
    return datetime.datetime.fromtimestamp(max(0.0, start_s), datetime.timezone.utc)


def start(settings: Settings, metrics: Metrics, stop: threading.Event) -> Follower:
    """Follow the cancellations in a daemon thread until `stop` is set."""
    store = Store(settings.cancel_window_ms)
    follower = Follower(settings, store, metrics, stop)
    launch.daemon("cancellations", follower.run)
    return follower
