"""Run the consumers: prepare once (declare, probe, read the cancels), then connect and
consume (one session.Session after another), rotating through the configured URLs, until
SIGTERM. When to try again and when to give up is reconnects.Reconnects; a trouble that
cannot heal ends the process with one line that says what to fix.
"""

import itertools
import threading
import time
import uuid
from typing import Dict, List, Optional, Tuple

import pika
import structlog

from topology import build
from topology.broker.declare import TopologyConflict, declare, short_retention, verify
from topology.settings import QUEUE_TYPES

from gateway import logs
from gateway.broker.plumbing.amqp import BrokerError, Trouble, blocking_channel, classify
from gateway.broker.run import cancelling, launch, stamp
from gateway.broker.run.index_streams import Beats, declare_noting
from gateway.broker.run.reconnects import FATAL_ATTEMPTS, Reconnects
from gateway.broker.run.session import CATCH_UP_S, Session
from gateway.core.cancels import Sequencer
from gateway.core.stranded import Stranded
from gateway.exits import EXIT_NO_BROKER, EXIT_REFUSED
from gateway.health import Health
from gateway.metrics import Metrics
from gateway.settings import Settings
from gateway.urls import vhost_of


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


GATE_ID = "delay-gateway-gate-"  # and a random part: a cancel by id for an id no message has


def wait_for_check_in(url: str, settings: Settings, cancels: cancelling.Follower, stop: threading.Event,
                      health: Health) -> None:
    """A distributor of its own (`--role distributor`) about to consume: once check-in has
    recorded every cancel queued in it now (after an outage: cancels published meanwhile),
    as a gateway of every role waits for its own check-in (session.py). Nothing queued and no
    check-in consumer: nothing to wait for. Else it waits for a check-in consumer (the other
    process may start after it), then cancels an id no message has, which queues behind them,
    and waits until that is recorded: at most CATCH_UP_S in all (check-in may not run at all;
    then it publishes nothing)."""
    log = structlog.get_logger("gateway")
    names = settings.chain.names
    deadline = time.monotonic() + CATCH_UP_S
    health.ready(False, "waiting for check-in to record the cancels queued in it")

    def check_in() -> Tuple[int, int]:
        with blocking_channel(url, "delay-gateway gate", settings.tls) as channel:
            ok = channel.queue_declare(names.check_in, passive=True).method
            return ok.message_count, ok.consumer_count
    ready, consumers = check_in()
    if not consumers and not ready:
        return
    if not consumers:
        log.info("check_in_gate", waiting="for a check-in consumer to record the cancels queued in check-in",
                 ready=ready)
    while not consumers:
        if stop.wait(0.5) or time.monotonic() > deadline:
            if not stop.is_set():
                log.warning("check_in_catch_up_slow", waited_s=CATCH_UP_S,
                            cancels=f"releasing what is due before a check-in consumer recorded the cancels queued "
                                    f"in check-in ({ready} message(s) wait there, none consumes it)")
            return
        ready, consumers = check_in()
    gate = GATE_ID + uuid.uuid4().hex
    try:
        with blocking_channel(url, "delay-gateway gate", settings.tls) as channel:
            channel.confirm_delivery()
            channel.basic_publish(names.cancel, "", b"", pika.BasicProperties(message_id=gate, delivery_mode=2),
                                  mandatory=True)
    except pika.exceptions.UnroutableError:
        log.warning("check_in_gate_unroutable", exchange=names.cancel,
                    cancels="not waiting for check-in: declare the topology")
        return
    while not stop.is_set() and cancels.store.get(gate.encode()) is None:
        if time.monotonic() > deadline:
            log.warning("check_in_catch_up_slow", waited_s=CATCH_UP_S,
                        cancels="releasing what is due before check-in recorded the cancels queued in it (a "
                                "backlog)")
            return
        stop.wait(0.05)


def main(settings: Settings) -> int:
    """`delay-gateway run`: the consumers until SIGTERM or SIGINT (of the URLs' own virtual
    host; several: vhosts.py)."""
    metrics, health = Metrics(vhost=vhost_of(settings.urls[0])), Health()
    stop = launch.process(settings, metrics, health)
    return one(settings, stop, metrics, health)


def one(settings: Settings, stop: threading.Event, metrics: Metrics, health: Health,
        refusals: Optional["Refusals"] = None) -> int:
    """The consumers of one virtual host (the URLs'), with their upkeep and cancellations."""
    from gateway.broker.run import due_gauges, upkeep
    beats = Beats(settings.chain.names, settings.role, settings.pending_index)
    # counted as a user of the chain; retires unused chains; counts queues; beats
    upkeep.start(settings, stop, metrics, beats)
    due_gauges.start(settings, stop, metrics)
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
        # read times: one sequence for the process (the follower's: reserved in the stream)
        self.sequence = cancels.sequence if cancels is not None else Sequencer()
        self._checked = False  # the topology
        self._stamp_checked = False  # said once per process
        self._log = structlog.get_logger("gateway")

    def on(self, url: str, stop: threading.Event) -> bool:
        """Prepared against the broker at `url`: False if stopped meanwhile."""
        settings = self.settings
        if not self._checked:
            with blocking_channel(url, "delay-gateway declare", settings.tls) as channel:
                topology = build(settings.chain, settings.cancel_window_ms)
                declare_noting(channel, topology, declare if settings.declare else verify)
                short = short_retention(channel, topology)
                if short is not None:
                    self._log.warning("cancellations_kept_shorter", problem=short)
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
    stranded: Dict[str, Stranded] = {}  # what a lost connection's distributor held, per queue (core/stranded.py)
    while not stop.is_set():
        url = next(urls)
        session = None
        try:
            if not prepared.on(url, stop):
                break
            if settings.role == "distributor" and cancels is not None:
                wait_for_check_in(url, settings, cancels, stop, health)
            session = Session(url, settings, metrics, health, stop, other_exits(url, settings),
                              cancels.judge(metrics) if cancels is not None else None, prepared.sequence,
                              beats, refusals.back if refusals is not None else None, stranded)
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
