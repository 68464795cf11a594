"""Prometheus metrics of one gateway process, each labelled with the virtual host it counts
for: `Metrics(vhost=...)` is one vhost's view, and `of(vhost)` another's on the same registry."""

from typing import Any, Dict, Optional, Set, Tuple

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

LATENESS_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class Bound:
    """One metric family seen from one virtual host: its first label, `vhost`, already set."""

    def __init__(self, family: Any, vhost: str) -> None:
        self.family, self.vhost = family, vhost
        self._seen: Set[Tuple[str, ...]] = set()

    def labels(self, *values: str) -> Any:
        self._seen.add(values)
        return self.family.labels(self.vhost, *values)

    def remove(self, *values: str) -> None:
        self._seen.discard(values)
        self.family.remove(self.vhost, *values)

    def clear(self) -> None:
        """This vhost's samples only."""
        for values in list(self._seen):
            try:
                self.remove(*values)
            except KeyError:
                pass

    def inc(self, amount: float = 1) -> None:
        self.family.labels(self.vhost).inc(amount)

    def set(self, value: float) -> None:
        self.family.labels(self.vhost).set(value)

    def observe(self, value: float) -> None:
        self.family.labels(self.vhost).observe(value)


class Metrics:
    forwarded: Bound
    parked: Bound
    lateness: Bound
    held: Bound
    batch_publishes: Bound
    batched_messages: Bound
    connections: Bound
    cancels: Bound
    cancelled: Bound
    cancellations_held: Bound
    cancellations_following: Bound
    retries: Bound
    queue_messages: Bound
    ready: Bound
    vhost_refused: Bound

    def __init__(self, registry: Optional[CollectorRegistry] = None, vhost: str = "/",
                 families: Optional[Dict[str, Any]] = None) -> None:
        self.vhost = vhost
        self._families = families if families is not None else self._declare(registry or CollectorRegistry())
        self.registry: CollectorRegistry = self._families["registry"]
        for name, family in self._families.items():
            if name != "registry":
                setattr(self, name, Bound(family, vhost))
                if family._labelnames == ("vhost",):  # a sample at 0 from the start, as without labels
                    family.labels(vhost)

    def of(self, vhost: str) -> "Metrics":
        """The same metrics for another virtual host."""
        return Metrics(vhost=vhost, families=self._families)

    def _declare(self, registry: CollectorRegistry) -> Dict[str, Any]:
        """Every family, by attribute name, on `registry`."""
        families: Dict[str, Any] = {"registry": registry}
        families["forwarded"] = Counter(
            "delay_gateway_messages", "Messages forwarded, by consumer and outcome",
            ["vhost", "queue", "outcome"], registry=registry)
        families["parked"] = Counter(
            "delay_gateway_parked", "Messages parked, by the consumer that parked them",
            ["vhost", "queue"], registry=registry)
        families["lateness"] = Histogram(
            "delay_gateway_lateness_seconds", "How long after its due time a message was published to pick-up",
            ["vhost"], buckets=LATENESS_BUCKETS, registry=registry)
        families["held"] = Gauge(
            "delay_gateway_held_messages", "Messages held until their due time, by consumer",
            ["vhost", "queue"], registry=registry)
        families["batch_publishes"] = Counter(
            "delay_gateway_batch_publishes", "Publishes into the chain, meditation or the distributor "
            "(each a carrier or a message alone), by consumer and what was sent", ["vhost", "queue", "outcome"],
            registry=registry)
        families["batched_messages"] = Counter(
            "delay_gateway_batched_messages", "Messages in those publishes", ["vhost", "queue", "outcome"],
            registry=registry)
        families["connections"] = Counter(
            "delay_gateway_connections", "Connections opened to the broker", ["vhost"], registry=registry)
        families["cancels"] = Counter(
            "delay_gateway_cancels", "Cancels the check-in consumer recorded in the cancellations stream",
            ["vhost"], registry=registry)
        families["cancelled"] = Counter(
            "delay_gateway_cancelled", "Cancelled messages dropped (acknowledged, not delivered), by where: "
            "check-in, returning (from meditation), distributor, release (held by the distributor)",
            ["vhost", "where"], registry=registry)
        families["cancellations_held"] = Gauge(
            "delay_gateway_cancellations_held", "Cancels inside the retention window this process holds",
            ["vhost"], registry=registry)
        families["cancellations_following"] = Gauge(
            "delay_gateway_cancellations_following", "1 while this process follows the cancellations stream (its "
            "consumer attached, the stream read to its end once); 0 while it cannot read it", ["vhost"],
            registry=registry)
        families["retries"] = Counter(
            "delay_gateway_retries", "Failed messages by the queue they came from and what became of them: "
            "scheduled (a retry waits), delivered (sent back to the queue), gave_up (parked after the last "
            "attempt)", ["vhost", "queue", "outcome"], registry=registry)
        families["queue_messages"] = Gauge(
            "delay_gateway_queue_messages", "Ready messages in the gateway's own queues, by queue, from a passive "
            "declare every 15 s (absent while this process has no connection for its upkeep)", ["vhost", "queue"],
            registry=registry)
        families["ready"] = Gauge(
            "delay_gateway_ready", "1 while connected and consuming every queue of the role, by the process's "
            "--role (all: check-in and distributor)", ["vhost", "role"], registry=registry)
        families["vhost_refused"] = Gauge(
            "delay_gateway_vhost_refused", "1 while the broker refuses this process the virtual host (a login, a "
            "permission or the topology missing there: the log says which, event vhost_refused); it tries again "
            "and serves the others meanwhile", ["vhost"], registry=registry)
        return families
