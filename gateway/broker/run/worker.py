"""Run the consumers: prepare once (declare, probe, read the cancels), then connect and
consume, rotating through the configured URLs, until SIGTERM. When to try again and when
to give up is reconnects.Reconnects; a trouble that cannot heal ends the process with one
line that says what to fix.
"""

import itertools
import random
import signal
import threading
import time
from typing import Callable, List, Optional, Sequence

import pika
import structlog

from topology import build
from topology.broker.declare import TopologyConflict, declare, verify
from topology.settings import QUEUE_TYPES
from topology.waiting import bands

from gateway import health as health_http
from gateway import logs, stopping
from gateway.broker.plumbing import wire_connection
from gateway.broker.run import stamp
from gateway.exits import EXIT_NO_BROKER, EXIT_REFUSED
from gateway.broker.plumbing.amqp import BrokerError, Trouble, blocking_channel, classify, parameters
from gateway.broker.run.reconnects import FATAL_ATTEMPTS, Reconnects
from gateway.clock import wall_ms
from gateway.core.carrier import Batcher
from gateway.core.cancels import Sequencer
from gateway.broker.run import cancelling
from gateway.broker.run.cancelling import Judge
from gateway.broker.run.consumer import Pipe
from gateway.broker.run.retrying import counting_retries
from gateway.broker.run.index_streams import Beats, declare_noting
from gateway.core.handlers import CheckIn, Distributor, Parking, Retry, Returning
from gateway.core.waiting import Consumers, Recorder
from gateway.health import Health
from gateway.metrics import Metrics
from gateway.settings import Settings
from gateway.urls import redact, vhost_of

STOP_POLL_S = 0.2
STOP_GRACE_S = 10.0
STABLE_S = 30.0  # a connection up this long (and consuming) resets the backoff
CATCH_UP_S = 60.0  # the other consumers wait at most this long for check-in's backlog


class Session:
    """One connection, from open to close, with the consumers of the chosen role."""

    def __init__(self, url: str, settings: Settings, metrics: Metrics, health: Health,
                 stop: threading.Event, exits: Sequence[str] = (), judge: Optional[Judge] = None,
                 sequence: Optional[Sequencer] = None, beats: Optional[Beats] = None,
                 on_ready: Optional[Callable[[], None]] = None) -> None:
        self.on_ready = on_ready  # called once consuming every queue (vhosts.py: a refused vhost is back)
        self.judge = judge  # whether a message was cancelled (cancelling.py); None: not asked
        self.sequence = sequence  # check-in's read times, one sequence for the process
        self.url, self.settings, self.metrics, self.health, self.stop_event = url, settings, metrics, health, stop
        self.exits = exits  # chain exits in other queue types, to consume as well
        self.log = structlog.get_logger("gateway").bind(broker=redact(url))
        self.error: Optional[BaseException] = None  # why it ended, if the broker said
        self.pipes: List[Pipe] = []
        self.ready_since: Optional[float] = None
        self.blocked = False  # by a resource alarm
        self._stopping = False
        self._opened_all = False
        self.check_in: Optional[CheckIn] = None
        self.beats = beats  # the index of what waits: this session says what its distributor holds

    def run(self) -> None:
        """Returns when the connection closes."""
        self.connection = wire_connection.WireConnection(
            parameters(self.url, f"delay-gateway {self.settings.role}", self.settings.tls),
            on_open_callback=self._on_open, on_open_error_callback=self._on_open_error,
            on_close_callback=self._on_close)
        self.connection.ioloop.start()

    def _on_open(self, connection) -> None:
        self.log.info("connected")
        connection.add_on_connection_blocked_callback(self._on_blocked)
        connection.add_on_connection_unblocked_callback(self._on_unblocked)
        self.metrics.connections.inc()
        s, chain, names = self.settings, self.settings.chain, self.settings.chain.names

        def pipe(queue: str, handler, prefetch: int, batched: bool = False, on_caught_up=None) -> None:
            batcher = Batcher(s.carrier_messages, s.carrier_bytes, s.carrier_wait_ms) if batched else None
            still_wanted = handler.still_wanted if isinstance(handler, Distributor) and self.judge is not None \
                else None
            # (without the index: no entries, but the done keys of what others may have listed)
            recorder = Recorder(bands(chain), chain.meditation_ms, entries=s.pending_index)
            self.pipes.append(Pipe(connection, queue, handler, prefetch, self.metrics, names,
                                   on_fatal=self._on_fatal, batcher=batcher, still_wanted=still_wanted,
                                   on_caught_up=on_caught_up, recorder=recorder))

        returning = [names.returning] + [q for q in self.exits if q.startswith(names.returning + ".")]
        distributors = [names.distributor] + [q for q in self.exits if q.startswith(names.distributor + ".")]
        # The other consumers start once check-in has read what it held and recorded every
        # cancel in it: after a crash, a cancel the dead process read but had not recorded
        # yet must be in place before a message it cancels can be released, even one due
        # by now (at most CATCH_UP_S).
        gate = s.role == "all" and self.judge is not None
        if s.role in ("all", "check-in"):
            check_in = self.check_in = CheckIn(chain, s.lead_ms, s.carrier_wait_ms, self.judge, self.sequence)
            if gate:
                check_in.recorded = {}
            pipe(names.check_in, cancelling.recording(check_in, self.metrics), s.prefetch, batched=True,
                 on_caught_up=self._caught_up if gate else None)
            for queue in returning:
                pipe(queue, Returning(chain, s.lead_ms, s.carrier_wait_ms, self.judge), s.prefetch,
                     batched=True)
            retry = Retry(chain, s.lead_ms, s.retry_rules(), random.Random(), s.carrier_wait_ms, self.judge,
                          self.sequence, s.retry_queues)
            pipe(names.retry, counting_retries(retry, self.metrics), s.prefetch, batched=True)
        if s.role in ("all", "distributor"):
            for queue in distributors:
                pipe(queue, Distributor(chain, s.lead_ms, s.stamp_due_at, self.judge),
                     s.distributor_prefetch)
            pipe(names.parking, Parking(names), s.prefetch)
        if self.beats is not None:
            held = [p.flow.ledger for p in self.pipes if p.queue in distributors]
            # (read from the upkeep thread: the earliest due time of a heap, one list index)
            self.beats.low = lambda: min((t for t in (h.next_due() for h in held) if t is not None), default=None)
            consumed = [p.queue for p in self.pipes]
            self.beats.count(Consumers(sum(q in (names.check_in, names.retry) for q in consumed),
                                       sum(q in returning for q in consumed), sum(q in distributors for q in consumed)))
        for p in self.pipes[:1] if gate else self.pipes:
            p.open()
        if gate:
            self.connection.ioloop.call_later(CATCH_UP_S, lambda: self._caught_up(late=True))
        self._watch()

    def _caught_up(self, late: bool = False) -> None:
        if self._opened_all or not self.connection.is_open:
            return
        recorded = self.check_in.recorded if self.check_in is not None else None
        if not late and recorded and self.judge is not None and not self.judge.holds(recorded):
            # confirmed, but the follower has not read them back yet: in a moment
            self.connection.ioloop.call_later(0.01, self._caught_up)
            return
        self._opened_all = True
        if self.check_in is not None:
            self.check_in.recorded = None
        if late:
            self.log.warning("check_in_catch_up_slow", waited_s=CATCH_UP_S,
                             cancels="starting the other consumers before check-in read its backlog")
        for p in self.pipes[1:]:
            p.open()

    def _watch(self) -> None:
        # Polled rather than signalled: a signal handler must not take pika's locks.
        if self.stop_event.is_set():
            return self._begin_stop()
        self._check_confirms()
        ready = bool(self.pipes) and all(p.consuming for p in self.pipes)
        if ready and self.ready_since is None:
            self.ready_since = time.monotonic()
            self.log.info("ready", queues=[p.queue for p in self.pipes])
            if self.on_ready is not None:
                self.on_ready()
        self.health.ready(ready, "" if ready else "connecting to the queues")
        self.metrics.ready.labels(self.settings.role).set(int(ready))
        self.connection.ioloop.call_later(STOP_POLL_S, self._watch)

    def _check_confirms(self) -> None:
        """Confirms that stop coming mean a broker that cannot act for its cluster: a node
        cut off by a partition that does not pause it (Khepri has no partition handling),
        or a leader gone silent. Start over on the next URL; what was not confirmed comes
        back to its queue. Not while the broker blocks publishers (a resource alarm)."""
        if self.blocked or self.settings.confirm_timeout <= 0:
            return
        now = wall_ms()
        waited = max((p.waiting_for_confirm_ms(now) for p in self.pipes), default=0)
        if waited > self.settings.confirm_timeout * 1000 and self.connection.is_open:
            self.log.error("confirms_stalled", waited_s=round(waited / 1000, 1))
            if self.error is None:
                self.error = pika.exceptions.AMQPConnectionError(f"no publisher confirm for {waited / 1000:.0f} s")
            self.connection.close()

    def _on_blocked(self, *_) -> None:
        self.blocked = True
        self.log.warning("blocked_by_broker", reason="a resource alarm: publishes wait until it clears")

    def _on_unblocked(self, *_) -> None:
        self.blocked = False
        self.log.info("unblocked_by_broker")

    def _on_fatal(self, reason: BaseException) -> None:
        """A consumer's channel was closed by the broker: the connection closes next."""
        if self.error is None:
            self.error = reason
            self.log.error("channel_closed", reason=str(reason))

    def _begin_stop(self) -> None:
        if self._stopping:
            return
        self._stopping = True
        self.health.ready(False, "stopping")
        self.log.info("stopping")
        remaining = len(self.pipes)

        def one_stopped() -> None:
            nonlocal remaining
            remaining -= 1
            if remaining == 0 and self.connection.is_open:
                self.connection.close()

        for p in self.pipes:
            p.stop(one_stopped)
        if not self.pipes and self.connection.is_open:
            self.connection.close()
        self.connection.ioloop.call_later(STOP_GRACE_S, self._close_now)

    def _close_now(self) -> None:
        if self.connection.is_open:
            self.log.warning("stop_grace_expired", unconfirmed="redelivered to the next gateway")
            self.connection.close()

    def _on_open_error(self, connection, error) -> None:
        self.error = error
        connection.ioloop.stop()

    def _on_close(self, connection, reason) -> None:
        self.health.ready(False, "connection lost")
        self.metrics.ready.labels(self.settings.role).set(0)
        if not self._stopping and self.error is None:  # (else we closed it, and said why)
            self.log.warning("connection_lost", reason=str(reason))
            if isinstance(reason, pika.exceptions.ConnectionClosedByBroker):
                self.error = reason
        connection.ioloop.stop()

    @property
    def stable(self) -> bool:
        return self.ready_since is not None and time.monotonic() - self.ready_since >= STABLE_S


def other_exits(url: str, settings: Settings) -> List[str]:
    """The exits of chains in another queue type than ours that exist (a chain of the
    other type may still be draining into them, or is current for other gateways)."""
    names, found = settings.chain.names, []
    for queue_type in QUEUE_TYPES:
        if queue_type == "quorum":
            continue  # the quorum exits are every chain's: always consumed
        for queue in (names.exit_returning(queue_type), names.exit_distributor(queue_type)):
            if queue_type == settings.chain.queue_type or exists(url, settings, queue):
                found.append(queue)
    return found


def exists(url: str, settings: Settings, queue: str) -> bool:
    try:
        with blocking_channel(url, "delay-gateway", settings.tls) as channel:
            channel.queue_declare(queue, passive=True)
        return True
    except BrokerError as exc:
        if exc.trouble.heals or "NOT_FOUND" not in exc.trouble.message:
            raise
        return False


def main(settings: Settings) -> int:
    """`delay-gateway run`: the consumers until SIGTERM or SIGINT (of the URLs' own virtual
    host; several: vhosts.py)."""
    metrics, health = Metrics(vhost=vhost_of(settings.urls[0])), Health()
    if settings.metrics_port:
        health_http.serve(settings.metrics_port, metrics.registry, health)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, stopping.setter(stop))
    starting(settings)
    return one(settings, stop, metrics, health)


def starting(settings: Settings, **fields) -> None:
    c = settings.chain
    structlog.get_logger("gateway").info(
        "starting", role=settings.role, brokers=[redact(u) for u in settings.urls], prefix=c.prefix,
        max_level=c.max_level, resolution_ms=c.resolution_ms, queue_type=c.queue_type, zero_bits=c.zero_bits,
        **fields)


def one(settings: Settings, stop: threading.Event, metrics: Metrics, health: Health,
        refusals: Optional["Refusals"] = None) -> int:
    """The consumers of one virtual host (the URLs'), with their upkeep and cancellations."""
    from gateway.broker.run import upkeep
    beats = Beats(settings.chain.names, settings.role, settings.pending_index)
    # counted as a user of the chain; retires unused chains; counts queues; beats
    upkeep.start(settings, stop, metrics, beats)
    return run(settings, stop, metrics, health, cancelling.start(settings, metrics, stop), beats, refusals)


class Refusals:
    """How a vhost among several meets a refusal that does not heal (vhosts.py): `tolerate`
    says whether to try again (True) or to give up as a process of one vhost does; `back`
    is called once it consumes again."""

    def tolerate(self, trouble: Trouble, retry_in_s: float) -> bool:
        raise NotImplementedError

    def back(self) -> None:
        raise NotImplementedError


class Preparation:
    """What a process does once, on the first broker that lets it: the topology declared
    (or, --no-declare, found), the arrival stamp probed, and every cancel of the window read
    before the first message is. Each step is done once; a broker that fails one raises
    (BrokerError, TopologyConflict) and the next broker tries it again."""

    def __init__(self, settings: Settings, health: Health, cancels: Optional[cancelling.Follower]) -> None:
        self.settings, self.health, self.cancels = settings, health, cancels
        self.sequence = Sequencer()  # read times: one sequence for the process
        self._checked = False  # the topology
        self._stamp_checked = False  # said once per process
        self._log = structlog.get_logger("gateway")

    def on(self, url: str, stop: threading.Event) -> bool:
        """Prepared against the broker at `url`: False if stopped meanwhile."""
        settings = self.settings
        if not self._checked:
            with blocking_channel(url, "delay-gateway declare", settings.tls) as channel:
                declare_noting(channel, build(settings.chain, cancelling.retention_ms(
                    settings.chain, settings.cancel_retention)), declare if settings.declare else verify)
            self._log.info("topology_declared" if settings.declare else "topology_found",
                           prefix=settings.chain.prefix, generation=settings.chain.generation,
                           max_level=settings.chain.max_level)
            self._checked = True
        if not self._stamp_checked:
            stamp.check(url, settings, self._log)
            self._stamp_checked = True
        cancels = self.cancels
        if cancels is not None and not cancels.ready.is_set():
            self.health.ready(False, "reading the cancellations")
            missing = cancels.wait_ready()
            if stop.is_set():
                return False
            if missing is not None:
                raise BrokerError(missing)
        if cancels is not None:  # read times above every cancel held, whatever the clock did
            self.sequence.above(cancels.newest_read_us())
        return True


def run(settings: Settings, stop: threading.Event, metrics: Metrics, health: Health,
        cancels: Optional[cancelling.Follower] = None, beats: Optional[Beats] = None,
        refusals: Optional[Refusals] = None) -> int:
    """0 once stopped; EXIT_NO_BROKER after connect_timeout without a broker; EXIT_REFUSED
    after FATAL_ATTEMPTS troubles that cannot heal (unless `refusals` tolerates them: then
    it tries again, with backoff)."""
    log = structlog.get_logger("gateway")
    metrics.ready.labels(settings.role).set(0)  # 0 from the start: an alert sees a process that never gets ready
    urls = itertools.cycle(settings.urls)
    prepared = Preparation(settings, health, cancels)
    reconnects = Reconnects(settings.connect_timeout)
    while not stop.is_set():
        url = next(urls)
        session = None
        try:
            if not prepared.on(url, stop):
                break
            session = Session(url, settings, metrics, health, stop, other_exits(url, settings),
                              cancels.judge(metrics) if cancels is not None else None, prepared.sequence,
                              beats, refusals.back if refusals is not None else None)
            session.run()
            trouble = classify(session.error, url) if session.error is not None else None
        except TopologyConflict as exc:
            trouble = Trouble(False, str(exc))
        except BrokerError as exc:
            trouble = exc.trouble
        if session is not None and session.ready_since is not None:
            reconnects.up()
        if stop.is_set():
            break
        health.beat()
        then = reconnects.after(trouble, session is not None and session.stable)
        if then.exit_code == EXIT_REFUSED and trouble is not None and refusals is not None:
            wait_s = reconnects.backoff.next(False)
            if refusals.tolerate(trouble, wait_s):  # (it says so, once)
                stop.wait(wait_s)
                continue
        if trouble is not None and not trouble.heals:
            # (one line per attempt, its retry included: `reconnecting` would say it again)
            log.error("broker_refused", error=trouble.message, attempt=then.refused, of=FATAL_ATTEMPTS,
                      **({} if then.exit_code is not None else {"retry_in_s": round(then.wait_s, 2)}))
        if then.exit_code == EXIT_REFUSED and trouble is not None:
            logs.last_line(f"delay-gateway run: {trouble.message}")
            return then.exit_code
        if then.exit_code == EXIT_NO_BROKER:
            error = trouble.message if trouble else "no connection"
            log.error("giving_up", seconds=settings.connect_timeout, error=error)
            logs.last_line(f"delay-gateway run: no broker for {settings.connect_timeout:g} s (--connect-timeout), "
                           f"giving up: {error}")
            return then.exit_code
        if trouble is None or trouble.heals:
            log.warning("reconnecting", after_s=round(then.wait_s, 2), error=trouble.message if trouble else None)
        stop.wait(then.wait_s)
    log.info("stopped")
    return 0
