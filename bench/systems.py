"""What delays the messages in a run: the gateway (its real `run` processes, its topology
declared through the public topology API) or the rabbitmq-delayed-message-exchange plugin
(an `x-delayed-message` exchange). Both are used exactly as their users use them: publish
with a delay header to one exchange, bind a queue to another (or the same) one."""

import uuid
from dataclasses import dataclass
from typing import List, Optional, Sequence

import pika

from topology import ChainSettings, build
from topology.broker.declare import declare, delete

from .clients import blocking
from .launcher import GatewayProcess

DELAY = "x-delay"
DELIVER_AT = "x-deliver-at"
HEADERS = (DELAY, DELIVER_AT)


def unique_prefix(tag: str) -> str:
    return f"bench-{tag}-{uuid.uuid4().hex[:6]}"


@dataclass(frozen=True)
class Target:
    """One side of a comparison: the plugin, or the gateway with one topology, and the
    delay header the publisher uses."""

    system: str  # "plugin" or "gateway"
    header: str = DELAY
    queue_type: Optional[str] = None  # gateway only
    zero_bits: Optional[str] = None

    @property
    def label(self) -> str:
        if self.system == "plugin":
            return f"plugin ({self.header})"
        return f"gateway {self.queue_type}/{self.zero_bits} ({self.header})"


def headers_for(header: str, published_ms: float, delay_ms: int):
    """The publisher's header and the due time it means, on the publisher's clock."""
    if header == DELAY:
        return {DELAY: delay_ms}, published_ms + delay_ms
    due = int(published_ms + delay_ms)
    return {DELIVER_AT: due}, float(due)


class Gateway:
    """The chain declared with topology.build, then `delay-gateway run` (one process with
    both roles, as `run` does by default, or one process per role)."""

    system = "gateway"

    def __init__(self, url: str, chain: ChainSettings, gateway_args: Sequence[str] = (),
                 split_roles: bool = False) -> None:
        self.url, self.chain = url, chain
        self.prefix = chain.prefix
        self.publish_exchange = chain.names.check_in
        self.deliver_exchange = chain.names.pick_up
        with blocking(url) as c:
            declare(c.channel(), build(chain))
        roles = (("--role", "check-in"), ("--role", "distributor")) if split_roles else ((),)
        self.processes: List[GatewayProcess] = []
        try:
            for role in roles:
                self.processes.append(GatewayProcess(chain, *role, *gateway_args, url=url, die_with_parent=True))
            for p in self.processes:
                p.wait_ready(60)
        except Exception:
            self.close()
            raise

    def forwarded(self, queue: Optional[str] = None) -> float:
        """Messages the gateway's consumers forwarded (its /metrics), of one queue or all."""
        total = 0.0
        for p in self.processes:
            for labels, value in p.samples("delay_gateway_messages_total"):
                if queue is None or labels.get("queue") == queue:
                    total += value
        return total

    def lateness_buckets(self) -> dict:
        """The gateway's own histogram of how late it published to pick-up (cumulative counts
        by upper bound in seconds), before the hop to the user's queue and the receiver."""
        out: dict = {}
        for p in self.processes:
            for labels, value in p.samples("delay_gateway_lateness_seconds_bucket"):
                out[labels["le"]] = out.get(labels["le"], 0.0) + value
        return out

    def errors(self) -> List[dict]:
        return [e for p in self.processes for e in p.errors()]

    def close(self) -> None:
        for p in self.processes:
            p.terminate(30)
        try:
            with blocking(self.url) as c:
                delete(c.channel(), build(self.chain))
        except pika.exceptions.AMQPError:
            pass


class Plugin:
    """An `x-delayed-message` exchange routing like a topic exchange: publish to it with
    `x-delay`, bind to it."""

    system = "plugin"
    processes: List[GatewayProcess] = []

    def __init__(self, url: str, prefix: str) -> None:
        self.url, self.prefix = url, prefix
        self.publish_exchange = self.deliver_exchange = f"{prefix}.delayed"
        with blocking(url) as c:
            c.channel().exchange_declare(self.publish_exchange, "x-delayed-message", durable=True,
                                         arguments={"x-delayed-type": "topic"})

    def forwarded(self, queue: Optional[str] = None) -> float:
        return 0.0

    def lateness_buckets(self) -> dict:
        return {}

    def errors(self) -> List[dict]:
        return []

    def close(self) -> None:
        # Messages still delayed inside the plugin (pending) stay in its table until due and
        # are then dropped, their exchange gone.
        try:
            with blocking(self.url) as c:
                c.channel().exchange_delete(self.publish_exchange)
        except pika.exceptions.AMQPError:
            pass
