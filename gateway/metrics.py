"""Prometheus metrics of one gateway process, each labelled with the virtual host it counts
for: `Metrics(vhost=...)` is one vhost's view, and `of(vhost)` another's on the same registry."""

from typing import Dict, Generic, Optional, Sequence, Set, Tuple, TypeVar, Union

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

LATENESS_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)

F = TypeVar("F", Counter, Gauge, Histogram)
Family = Union[Counter, Gauge, Histogram]


class Bound(Generic[F]):
    """One metric family seen from one virtual host: its first label, `vhost`, already set."""

    def __init__(self, family: F, vhost: str) -> None:
        self.family: F = family
        self.vhost = vhost
        self._seen: Set[Tuple[str, ...]] = set()
        self._own: Optional[F] = None  # the sample of the vhost alone, looked up once (a lock and a lookup)

    def labels(self, *values: str) -> F:
        self._seen.add(values)
        return self.family.labels(self.vhost, *values)

    def remove(self, *values: str) -> None:
        self._seen.discard(values)
        if not values:
            self._own = None
        self.family.remove(self.vhost, *values)

    def _alone(self) -> F:
        own = self._own
        if own is None:
            own = self._own = self.family.labels(self.vhost)
        return own

    def clear(self) -> None:
        """This vhost's samples only."""
        for values in list(self._seen):
            try:
                self.remove(*values)
            except KeyError:
                pass

    def inc(self: "Union[Bound[Counter], Bound[Gauge]]", amount: float = 1) -> None:
        self._alone().inc(amount)

    def set(self: "Bound[Gauge]", value: float) -> None:
        self._alone().set(value)

    def observe(self: "Bound[Histogram]", value: float) -> None:
        self._alone().observe(value)


class Families:
    """Every family of one registry by attribute name, with the label names it was declared
    with (prometheus-client keeps those private)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self.declared: Dict[str, Tuple[Family, Tuple[str, ...]]] = {}

    def counter(self, attribute: str, name: str, documentation: str, labels: Sequence[str]) -> None:
        self.declared[attribute] = (Counter(name, documentation, labels, registry=self.registry), tuple(labels))

    def gauge(self, attribute: str, name: str, documentation: str, labels: Sequence[str]) -> None:
        self.declared[attribute] = (Gauge(name, documentation, labels, registry=self.registry), tuple(labels))

    def histogram(self, attribute: str, name: str, documentation: str, labels: Sequence[str],
                  buckets: Sequence[float]) -> None:
        self.declared[attribute] = (Histogram(name, documentation, labels, registry=self.registry, buckets=buckets),
                                    tuple(labels))


class Metrics:
    forwarded: Bound[Counter]
    parked: Bound[Counter]
    lateness: Bound[Histogram]
    held: Bound[Gauge]
    held_deliveries: Bound[Gauge]
    overdue: Bound[Gauge]
    batch_publishes: Bound[Counter]
    batched_messages: Bound[Counter]
    connections: Bound[Counter]
    cancels: Bound[Counter]
    cancelled: Bound[Counter]
    cancellations_held: Bound[Gauge]
    rules_held: Bound[Gauge]
    cancellations_following: Bound[Gauge]
    retries: Bound[Counter]
    queue_messages: Bound[Gauge]
    ready: Bound[Gauge]
    vhost_refused: Bound[Gauge]
    waiting: Bound[Gauge]
    waiting_bytes: Bound[Gauge]
    next_due: Bound[Gauge]
    oldest_overdue: Bound[Gauge]
    waiting_read: Bound[Gauge]
    waiting_read_cpu: Bound[Gauge]
    waiting_exact: Bound[Gauge]

    def __init__(self, registry: Optional[CollectorRegistry] = None, vhost: str = "/",
                 families: Optional[Families] = None) -> None:
        self.vhost = vhost
        self._families = families if families is not None else self._declare(registry or CollectorRegistry())
        self.registry: CollectorRegistry = self._families.registry
        for name, (family, labels) in self._families.declared.items():
            setattr(self, name, Bound(family, vhost))
            if labels == ("vhost",):  # a sample at 0 from the start, as without labels
                family.labels(vhost)

    def of(self, vhost: str) -> "Metrics":
        """The same metrics for another virtual host."""
        return Metrics(vhost=vhost, families=self._families)

    def _declare(self, registry: CollectorRegistry) -> Families:
        """Every family, by attribute name, on `registry`."""
        families = Families(registry)
        families.counter(
            "forwarded",
            "delay_gateway_messages", "Messages forwarded, by consumer and outcome",
            ["vhost", "queue", "outcome"])
        families.counter(
            "parked",
            "delay_gateway_parked", "Messages parked, by the consumer that parked them",
            ["vhost", "queue"])
        families.histogram(
            "lateness",
            "delay_gateway_lateness_seconds", "How long after its due time a message was published to pick-up",
            ["vhost"], buckets=LATENESS_BUCKETS)
        families.gauge(
            "held",
            "delay_gateway_held_messages", "Messages held until their due time, by consumer",
            ["vhost", "queue"])
        families.gauge(
            "held_deliveries",
            "delay_gateway_held_deliveries", "Deliveries (messages, or carriers of them) with a message held until "
            "its due time, by consumer: each keeps a place of the prefetch", ["vhost", "queue"])
        families.gauge(
            "overdue",
            "delay_gateway_overdue_messages", "Messages that reached the distributor overdue and wait for the "
            "catch-up's pace (--catch-up-rate), by consumer (0 without one)", ["vhost", "queue"])
        families.counter(
            "batch_publishes",
            "delay_gateway_batch_publishes", "Publishes into the chain, meditation or the distributor "
            "(each a carrier or a message alone), by consumer and what was sent", ["vhost", "queue", "outcome"])
        families.counter(
            "batched_messages",
            "delay_gateway_batched_messages", "Messages in those publishes", ["vhost", "queue", "outcome"])
        families.counter(
            "connections",
            "delay_gateway_connections", "Connections opened to the broker", ["vhost"])
        families.counter(
            "cancels",
            "delay_gateway_cancels", "Cancels the check-in consumer recorded in the cancellations stream",
            ["vhost"])
        families.counter(
            "cancelled",
            "delay_gateway_cancelled", "Cancelled messages dropped (acknowledged, not delivered), by where: "
            "check-in, returning (from meditation), distributor, release (held by the distributor)",
            ["vhost", "where"])
        families.gauge(
            "cancellations_held",
            "delay_gateway_cancellations_held", "Cancels inside the retention window this process holds",
            ["vhost"])
        families.gauge(
            "rules_held",
            "delay_gateway_rules_held", "Group cancels (rules: `pending cancel`) live in the retention window that "
            "this process holds", ["vhost"])
        families.gauge(
            "cancellations_following",
            "delay_gateway_cancellations_following", "1 while this process follows the cancellations stream (its "
            "consumer attached, the stream read to its end once); 0 while it cannot read it", ["vhost"])
        families.counter(
            "retries",
            "delay_gateway_retries", "Failed messages by the queue they came from and what became of them: "
            "scheduled (a retry waits), delivered (sent back to the queue), gave_up (parked after the last "
            "attempt)", ["vhost", "queue", "outcome"])
        families.gauge(
            "queue_messages",
            "delay_gateway_queue_messages", "Ready messages in the gateway's own queues, by queue, from a passive "
            "declare every 15 s (absent while this process has no connection for its upkeep)", ["vhost", "queue"])
        families.gauge(
            "ready",
            "delay_gateway_ready", "1 while connected and consuming every queue of the role, by the process's "
            "--role (all: check-in and distributor)", ["vhost", "role"])
        families.gauge(
            "vhost_refused",
            "delay_gateway_vhost_refused", "1 while the broker refuses this process the virtual host (a login, a "
            "permission or the topology missing there: the log says which, event vhost_refused); it tries again "
            "and serves the others meanwhile", ["vhost"])
        families.gauge(
            "waiting",
            "delay_gateway_waiting_messages", "Messages that wait, by when they fall due (the ranges of `pending "
            "count`: overdue, within 1 minute, ...), from the index of what waits (`--due-gauges-every`)",
            ["vhost", "due"])
        families.gauge(
            "waiting_bytes",
            "delay_gateway_waiting_bytes", "Their bodies' bytes, by the same ranges", ["vhost", "due"])
        families.gauge(
            "next_due",
            "delay_gateway_next_due_timestamp_seconds", "When the next message that waits falls due (epoch seconds; "
            "0 while nothing waits that is not overdue, or before the first reading)", ["vhost"])
        families.gauge(
            "oldest_overdue",
            "delay_gateway_oldest_overdue_seconds", "How long the most overdue message that still waits has been "
            "due (0: none overdue)", ["vhost"])
        families.gauge(
            "waiting_read",
            "delay_gateway_waiting_read_timestamp_seconds", "When the due-time gauges were last read from the index "
            "(epoch seconds; 0: not yet)", ["vhost"])
        families.gauge(
            "waiting_read_cpu",
            "delay_gateway_waiting_read_cpu_seconds", "The CPU time the last reading of the index for the due-time "
            "gauges took (the next waits 99 times as long, or --due-gauges-every)", ["vhost"])
        families.gauge(
            "waiting_exact",
            "delay_gateway_waiting_exact", "1 when that reading was exact (nothing could wait unlisted: `pending "
            "count`'s notes), else 0", ["vhost"])
        return families
