"""One connection of the `run` process, from open to close, with the consumers of its role:
check-in first and the others once it caught up (cancels before the messages they cancel),
ready once every queue is consumed, stopped gracefully on SIGTERM, and closed when confirms
stop coming (a broker that cannot act for its cluster). worker.run opens one after another.
"""

import random
import threading
import time
from typing import Callable, Dict, List, Optional, Sequence

import pika
import structlog

from topology.index_bands import bands

from gateway.broker.plumbing import wire_connection
from gateway.broker.plumbing.amqp import parameters
from gateway.broker.run import cancelling
from gateway.broker.run.cancelling import Judge
from gateway.broker.run.consumer import CONSUMER_TIMEOUT_MS, Pipe
from gateway.broker.run.index_streams import Beats
from gateway.broker.run.retrying import counting_retries
from gateway.clock import wall_ms
from gateway.core.cancels import Sequencer
from gateway.core.carrier import Batcher
from gateway.core.catch_up import CatchUp
from gateway.core.deliveries import Deliveries
from gateway.core.handlers import CheckIn, Distributor, Parking, Retry, Returning, crowded_at, max_hold_ms
from gateway.core.index_records import Consumers, Recorder
from gateway.core.stranded import Stranded
from gateway.health import Health
from gateway.metrics import Metrics
from gateway.settings import Settings
from gateway.urls import redact

STOP_POLL_S = 0.2
STOP_GRACE_S = 10.0
STABLE_S = 30.0  # a connection up this long (and consuming) resets the backoff
CATCH_UP_S = 60.0  # the other consumers wait at most this long for check-in's backlog


def crowding(ledger: Deliveries, room: int) -> Callable[[], bool]:
    """Whether the deliveries holding messages take the prefetch's room (handlers.crowded_at)."""
    return lambda: ledger.holding >= room


class Session:
    """One connection, from open to close, with the consumers of the chosen role."""

    def __init__(self, url: str, settings: Settings, metrics: Metrics, health: Health,
                 stop: threading.Event, exits: Sequence[str] = (), judge: Optional[Judge] = None,
                 sequence: Optional[Sequencer] = None, beats: Optional[Beats] = None,
                 on_ready: Optional[Callable[[], None]] = None, stranded: Optional[Dict[str, Stranded]] = None) -> None:
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
        # per distributor queue, what the process held when a connection was lost (stranded.py)
        self.stranded = stranded if stranded is not None else {}

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

        def pipe(queue: str, handler, prefetch: int, batched: bool = False, on_caught_up=None,
                 stranded: Optional[Stranded] = None, catch_up: Optional[CatchUp] = None) -> None:
            batcher = Batcher(s.carrier_messages, s.carrier_bytes, s.carrier_wait_ms) if batched else None
            still_wanted = handler.still_wanted if isinstance(handler, Distributor) and self.judge is not None \
                else None
            # (without the index: no entries, but the done keys of what others may have listed)
            recorder = Recorder(bands(chain), chain.meditation_ms, entries=s.pending_index)
            # (the exits of a classic chain are classic queues: no consumer timeout there)
            timeout_ms = None if queue in self.exits else max(CONSUMER_TIMEOUT_MS, 2 * max_hold_ms(chain, s.lead_ms))
            self.pipes.append(Pipe(connection, queue, handler, prefetch, self.metrics, names, timeout_ms=timeout_ms,
                                   on_fatal=self._on_fatal, batcher=batcher, still_wanted=still_wanted,
                                   on_caught_up=on_caught_up, recorder=recorder, stranded=stranded,
                                   catch_up=catch_up))

        returning = [names.returning] + [q for q in self.exits if q.startswith(names.returning + ".")]
        distributors = [names.distributor] + [q for q in self.exits if q.startswith(names.distributor + ".")]
        # The other consumers start once check-in has read what it held and recorded every
        # cancel in it: after a crash, a cancel the dead process read but had not recorded
        # yet must be in place before a message it cancels can be released, even one due
        # by now (at most CATCH_UP_S).
        gate = s.role == "all" and self.judge is not None
        if s.role in ("all", "check-in"):
            check_in = self.check_in = CheckIn(chain, s.lead_ms, s.carrier_wait_ms, self.judge, self.sequence,
                                               s.hold_within_ms, s.hold_messages,
                                               self.judge.rules if self.judge is not None else None)
            if gate:
                check_in.recorded = {}
            pipe(names.check_in, cancelling.recording(check_in, self.metrics), s.prefetch, batched=True,
                 on_caught_up=self._caught_up if gate else None)
            for queue in returning:
                pipe(queue, Returning(chain, s.lead_ms, s.carrier_wait_ms, self.judge,
                                      hold_within_ms=s.hold_within_ms, hold_messages=s.hold_messages),
                     s.prefetch, batched=True)
            retry = Retry(chain, s.lead_ms, s.retry_rules(), random.Random(), s.carrier_wait_ms, self.judge,
                          self.sequence, s.retry_queues, s.hold_within_ms, s.hold_messages)
            pipe(names.retry, counting_retries(retry, self.metrics), s.prefetch, batched=True)
        if s.role in ("all", "distributor"):
            room = crowded_at(s.distributor_prefetch)
            for queue in distributors:
                distributor = Distributor(chain, s.lead_ms, s.stamp_due_at, self.judge)
                pipe(queue, distributor, s.distributor_prefetch, stranded=self.stranded.setdefault(queue, Stranded()),
                     catch_up=CatchUp(s.catch_up_rate) if s.catch_up_rate > 0 else None)
                if room is not None:
                    distributor.crowded = crowding(self.pipes[-1].flow.ledger, room)
            pipe(names.parking, Parking(names), s.prefetch)
        if self.beats is not None:
            held = [p.flow for p in self.pipes if p.queue in distributors]
            # (read from the upkeep thread: the earliest due time of a heap, one list index)
            self.beats.low = lambda: min((t for t in (h.held_due() for h in held) if t is not None), default=None)
            taking = [p.flow for p in self.pipes if p.queue in (names.check_in, names.retry) or p.queue in returning]
            self.beats.reading = lambda: any(f.reading for f in taking)
            self.beats.blocked = lambda: self.blocked
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
