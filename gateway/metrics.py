"""Prometheus metrics of one gateway process."""

from typing import Optional

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

LATENESS_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class Metrics:
    def __init__(self, registry: Optional[CollectorRegistry] = None) -> None:
        self.registry = registry or CollectorRegistry()
        self.forwarded = Counter(
            "delay_gateway_messages", "Messages forwarded, by consumer and outcome",
            ["queue", "outcome"], registry=self.registry)
        self.parked = Counter(
            "delay_gateway_parked", "Messages parked, by the consumer that parked them",
            ["queue"], registry=self.registry)
        self.lateness = Histogram(
            "delay_gateway_lateness_seconds", "How long after its due time a message was published to pick-up",
            buckets=LATENESS_BUCKETS, registry=self.registry)
        self.held = Gauge(
            "delay_gateway_held_messages", "Messages held until their due time, by consumer",
            ["queue"], registry=self.registry)
        self.batch_publishes = Counter(
            "delay_gateway_batch_publishes", "Publishes into the chain, meditation or the distributor "
            "(each a carrier or a message alone), by consumer and what was sent", ["queue", "outcome"],
            registry=self.registry)
        self.batched_messages = Counter(
            "delay_gateway_batched_messages", "Messages in those publishes", ["queue", "outcome"],
            registry=self.registry)
        self.connections = Counter(
            "delay_gateway_connections", "Connections opened to the broker", registry=self.registry)
        self.cancels = Counter(
            "delay_gateway_cancels", "Cancels the check-in consumer recorded in the cancellations stream",
            registry=self.registry)
        self.cancelled = Counter(
            "delay_gateway_cancelled", "Cancelled messages dropped (acknowledged, not delivered), by where: "
            "check-in, returning (from meditation), distributor, release (held by the distributor)",
            ["where"], registry=self.registry)
        self.cancellations_held = Gauge(
            "delay_gateway_cancellations_held", "Cancels inside the retention window this process holds",
            registry=self.registry)
        self.cancellations_following = Gauge(
            "delay_gateway_cancellations_following", "1 while this process follows the cancellations stream (its "
            "consumer attached, the stream read to its end once); 0 while it cannot read it", registry=self.registry)
        self.retries = Counter(
            "delay_gateway_retries", "Failed messages by the queue they came from and what became of them: "
            "scheduled (a retry waits), delivered (sent back to the queue), gave_up (parked after the last "
            "attempt)", ["queue", "outcome"], registry=self.registry)
        self.queue_messages = Gauge(
            "delay_gateway_queue_messages", "Ready messages in the gateway's own queues, by queue, from a passive "
            "declare every 15 s (absent while this process has no connection for its upkeep)", ["queue"],
            registry=self.registry)
        self.ready = Gauge(
            "delay_gateway_ready", "1 while connected and consuming every queue of the role, by the process's "
            "--role (all: check-in and distributor)", ["role"], registry=self.registry)
