"""The gateway's housekeeping beside its consumers: being counted as a user of its chain,
recording the chain in the registry, retiring chains no gateway uses any more, and saying
it is alive.

It runs in a thread of its own with its own connection (`start`, called once from
worker.one), so the consumers never wait for it and it never touches their connection:

- it consumes the chain's `gateways.NN` queue (nothing is ever published there); the queue's
  consumer count is how other gateways and `status` know that this chain is in use;
- it appends a `declared` record for its chain when the registry lacks one, or when
  retiring some of the chain's queues had begun (this cancels that retirement);
- every tick, with `--retire` (the default), it retires chains of the same prefix that
  have had no gateway for `--retire-after` seconds (topology/retirement.py says how);
- every 15 s it counts the ready messages of the gateway's own queues (one passive declare
  each) for the metric `delay_gateway_queue_messages`, which the alerts on a check-in
  backlog read;
- once a process, it appends a mark to each stream of the index (index_streams.mark_streams),
  so that none is empty: a reader finds where a stream ends by its last chunk;
- every 5 s it beats into the done stream (index_streams.py: Beats), so that a reader
  knows which gateways keep up and what they see of the queues; with --no-pending-index it
  also notes in the registry, every quarter lap, until when what it sends on may wait unlisted.

Automatic rather than a separate step because a `helm upgrade` that changes the chain is
then complete by itself: old replicas stop, their chain drains into the shared queues and
is removed once empty, with nothing for a person to remember. `delay-gateway migrate` runs
the same retirement once, for deployments that turn it off.
"""

import itertools
import threading
import time
from typing import Callable, List, Optional, Set, Tuple

import structlog
from pika.exceptions import AMQPError, ChannelClosedByBroker, UnroutableError

from topology.broker.inventory import Executor, Look, Prober, Unknown, append, look_at_generation, read_registry
from topology.model import PRESENCE_ARGUMENTS
from topology.names import Names
from topology.registry import ChainKey, Record, Registry, fold
from topology.retirement import Step, Unused, plan

from gateway.broker.plumbing import wire_connection
from gateway.broker.plumbing.amqp import classify, parameters, unreachable
from gateway.broker.run import launch
from gateway.broker.run.index_streams import Beats, mark_streams, note_unindexed_gateway, unindexed_every_ms
from gateway.clock import wall_ms
from gateway.metrics import Metrics
from gateway.settings import Settings
from gateway.urls import redact

TICK_MAX_S = 30.0
TICK_MIN_S = 0.5
COUNT_EVERY_S = 15.0  # the queues' ready messages, for the metrics


def counted_queues(names: Names) -> Tuple[str, ...]:
    """The queues whose ready messages the metrics export: where a backlog means a consumer
    of the gateway's falls behind (or, parked, that messages wait for a person)."""
    return (names.check_in, names.returning, names.retry, names.distributor, names.parking, names.parked)


def count_queues(prober: Prober, queues: Tuple[str, ...], metrics: Metrics) -> None:
    """One passive declare per queue; a queue that is missing, or that cannot be looked at,
    has no value rather than an old one."""
    for queue in queues:
        try:
            found = prober.queue(queue)
        except Unknown:
            found = None
        if found is None:
            try:
                metrics.queue_messages.remove(queue)
            except KeyError:
                pass
        else:
            metrics.queue_messages.labels(queue).set(found.messages)


def tick_s(retire_after_s: float) -> float:
    """How often to look: often enough that a retirement is not much later than its margin."""
    return min(TICK_MAX_S, max(TICK_MIN_S, retire_after_s / 10))


def record_chain(connection, prefix: str, key: ChainKey, registry: Optional[Registry],
                 clock: Callable[[], int] = wall_ms) -> bool:
    """Append `declared` for `key` if the registry needs it; False if there is no registry."""
    names = key.settings(prefix).names
    if registry is None:
        return False
    if registry.needs_record(key, prefix):
        append(connection, names, [Record("declared", clock(), key)])
    return True


def plan_once(connection, prefix: str, own: ChainKey, unused: Unused, grace_ms: int, margin_ms: int,
              clock: Callable[[], int], registry: Registry,
              report: Callable[..., None] = lambda event, **fields: None) -> List[List[Step]]:
    """Look at every chain the registry knows of under `prefix` and plan the next steps of
    retiring those that no gateway has used for `grace_ms` (never `own`)."""
    known = set(registry.declared) | {own}
    if all(k == own for k in known):
        return []
    look = Look(Prober(connection))
    chains: Set[ChainKey] = set()
    for gen, key in {k.generation: k for k in sorted(known)}.items():
        if {k for k in known if k.generation == gen} == {own}:
            continue  # only ours: nothing to retire there
        errors = len(look.errors)
        found = look_at_generation(look, prefix, key, every_level=True)
        if len(look.errors) > errors:
            report("retire_blocked", generation=gen, reason="; ".join(look.errors[errors:]))
            continue  # a look failed: decide nothing about this generation
        chains |= found | {k for k in known if k.generation == gen}
    look.prober.close()
    observed = look.observed()
    now = clock()
    unused.update({k: (None if k == own else observed.gateways(k.settings(prefix).names, k.max_level))
                   for k in chains}, now)
    keep = (chains - unused.retiring(now, grace_ms)) | {own}
    return plan(prefix, registry, chains, keep, observed, now, margin_ms)


def retire_once(connection, prefix: str, own: ChainKey, unused: Unused, grace_ms: int, margin_ms: int,
                report: Callable[..., None], clock: Callable[[], int] = wall_ms,
                registry: Optional[Registry] = None) -> List[Step]:
    """Take the next steps of retiring the chains no gateway has used for `grace_ms`;
    returns the steps done."""
    names = own.settings(prefix).names
    if registry is None:
        records = read_registry(connection, names)
        if records is None:
            return []
        registry = fold(records)
    sequences = plan_once(connection, prefix, own, unused, grace_ms, margin_ms, clock, registry, report)
    if not sequences:
        return []
    return Executor(connection, names, clock, report).run(sequences)


class Upkeep:
    def __init__(self, settings: Settings, stop: threading.Event, metrics: Optional[Metrics] = None,
                 beats: Optional[Beats] = None) -> None:
        self.settings, self.stop, self.metrics, self.beats = settings, stop, metrics, beats
        self.chain = settings.chain
        self.key = ChainKey.of(self.chain)
        self.names = self.chain.names
        self.log = structlog.get_logger("gateway").bind(part="upkeep")
        self.unused = Unused()
        self.attached = threading.Event()  # counted as a user of the chain
        self._cancelled = False
        self._noted_ms: Optional[int] = None  # when it last noted that it writes no entries
        self._marked = False  # its marks are in the index's streams

    def run(self) -> None:
        urls = itertools.cycle(self.settings.urls)
        failures = 0
        said = ""  # the last error logged: the same one again every second is no news
        while not self.stop.is_set():
            url = next(urls)
            try:
                connection = wire_connection.blocking(parameters(url, "delay-gateway upkeep", self.settings.tls))
            except Exception as exc:  # the worker reports bad settings itself
                failures += 1
                self.log.warning("upkeep_cannot_connect", broker=redact(url), error=unreachable(exc))
                self.stop.wait(min(10.0, 0.5 * 2 ** min(failures, 5)))
                continue
            failures = 0
            try:
                self._session(connection)
            except AMQPError as exc:
                trouble = classify(exc, url)
                # A topology that is not there (yet) is the worker's to report, once, with the
                # fix; the same trouble again every second is no news either.
                if not self.attached.is_set() and (trouble.message == said or "NOT_FOUND" in trouble.message):
                    self.log.debug("upkeep_waiting", error=trouble.message)
                else:
                    self.log.warning("upkeep_connection_lost", broker=redact(url), error=trouble.message)
                said = trouble.message
            except Exception:  # housekeeping must never take the consumers down with it
                self.log.exception("upkeep_failed")
            finally:
                self.attached.clear()
                if self.beats is not None:
                    self.beats.forget()
                if self.metrics is not None:  # no connection: no counts, rather than old ones
                    self.metrics.queue_messages.clear()
                if connection.is_open:
                    try:
                        connection.close()
                    except AMQPError:
                        pass
            self.stop.wait(1.0)

    def _attach(self, connection) -> None:
        channel = connection.channel()
        queue = self.names.gateways(self.chain.max_level)
        channel.queue_declare(queue, durable=True, arguments=dict(PRESENCE_ARGUMENTS),
                              passive=not self.settings.declare)
        channel.basic_qos(prefetch_count=1)

        def on_cancel(frame) -> None:  # the queue was deleted: declare it again next tick
            self._cancelled = True

        channel.add_on_cancel_callback(on_cancel)
        # Nothing is published to this queue; the consumer is only there to be counted.
        channel.basic_consume(queue, lambda *args: None)
        self._cancelled = False
        self.attached.set()
        self.log.info("presence_attached", queue=queue)

    def _session(self, connection) -> None:
        self._attach(connection)
        self._mark(connection)
        grace_ms = margin_ms = int(self.settings.retire_after * 1000)
        misses = 0
        prober, counted_at = Prober(connection), float("-inf")
        queues = counted_queues(self.names)
        while not self.stop.is_set():
            if self._cancelled:
                self._attach(connection)
            records = read_registry(connection, self.names)
            registry = None if records is None else fold(records)
            tick = tick_s(self.settings.retire_after)
            if not record_chain(connection, self.chain.prefix, self.key, registry):
                # At start the worker may not have declared the registry yet: look again soon,
                # and say so only if it stays missing.
                misses += 1
                tick = min(tick, 2.0)
                if misses == 3:
                    self.log.warning("registry_missing", queue=self.names.registry,
                                     fix="run `delay-gateway declare` with this version, or start without "
                                         "--no-declare; until then old chains are not retired")
            else:
                misses = 0
                self._note_unindexed(connection)
                if self.settings.retire:
                    retire_once(connection, self.chain.prefix, self.key, self.unused, grace_ms, margin_ms,
                                self._report, registry=registry)
            deadline = time.monotonic() + tick
            while not self.stop.is_set() and time.monotonic() < deadline:
                if self.metrics is not None and time.monotonic() - counted_at >= COUNT_EVERY_S:
                    counted_at = time.monotonic()
                    count_queues(prober, queues, self.metrics)
                if self.beats is not None:
                    self.beats.maybe(connection)
                connection.process_data_events(time_limit=min(0.2, max(0.0, deadline - time.monotonic())))

    def _mark(self, connection) -> None:
        """Once a process: a mark in each stream of the index (none is left empty)."""
        if self._marked:
            return
        try:
            mark_streams(connection, self.chain)
        except (ChannelClosedByBroker, UnroutableError) as exc:  # an older topology: the index is not there
            self.log.info("index_marks_not_written", exchange=self.names.waiting, error=str(exc))
        self._marked = True

    def _note_unindexed(self, connection) -> None:
        if self.settings.pending_index:
            return
        now = wall_ms()
        if self._noted_ms is None or now - self._noted_ms >= unindexed_every_ms(self.chain):
            record = note_unindexed_gateway(connection, self.chain, now)
            self._noted_ms = now
            self.log.info("unlisted_noted", until_ms=record.until_ms, why="--no-pending-index")

    def _report(self, event: str, **fields) -> None:
        level = "warning" if event in ("retire_blocked", "retire_queue_not_empty") else \
            "error" if event == "retire_deleted_messages" else "info"
        getattr(self.log, level)(event, **fields)


def start(settings: Settings, stop: threading.Event, metrics: Optional[Metrics] = None,
          beats: Optional[Beats] = None) -> Upkeep:
    """Run the upkeep in a daemon thread until `stop` is set."""
    upkeep = Upkeep(settings, stop, metrics, beats)
    launch.daemon("upkeep", upkeep.run)
    return upkeep
