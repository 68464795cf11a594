"""What delays the messages in a run: the gateway (its real `run` processes, its topology
declared through the public topology API), the rabbitmq-delayed-message-exchange plugin (an
`x-delayed-message` exchange) or Celery's native delayed delivery (kombu's chain of 28
quorum levels). Each is used exactly as its users use it: publish with a delay (a header,
or for kombu a routing key) to one exchange, bind a queue to another (or the same) one."""

import math
import uuid
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import pika

from topology import ChainSettings, build
from topology.broker.declare import declare, delete

from tests.launcher import GatewayProcess

from .clients import blocking

DELAY = "x-delay"
DELIVER_AT = "x-deliver-at"
HEADERS = (DELAY, DELIVER_AT)


def unique_prefix(tag: str) -> str:
    return f"bench-{tag}-{uuid.uuid4().hex[:6]}"


@dataclass(frozen=True)
class Target:
    """One side of a comparison: the plugin, or the gateway with one topology, and the
    delay header the publisher uses."""

    system: str  # "plugin", "kombu" or "gateway"
    header: str = DELAY
    queue_type: Optional[str] = None  # gateway only
    zero_bits: Optional[str] = None
    index: bool = True  # gateway only: the index of what waits on (--compare-index runs it off too)

    @property
    def label(self) -> str:
        if self.system == "plugin":
            return f"plugin ({self.header})"
        if self.system == "kombu":
            return "kombu native delayed delivery (whole seconds)"
        return f"gateway {self.queue_type}/{self.zero_bits} ({self.header})" + ("" if self.index else ", index off")


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
                 split_roles: bool = False, replicas: int = 1, python: Optional[str] = None) -> None:
        self.url, self.chain = url, chain
        self.prefix = chain.prefix
        self.publish_exchange = chain.names.check_in
        self.deliver_exchange = chain.names.pick_up
        with blocking(url) as c:
            declare(c.channel(), build(chain))
        roles = ((("--role", "check-in"), ("--role", "distributor")) if split_roles else ((),)) * replicas
        self.processes: List[GatewayProcess] = []
        try:
            for role in roles:
                self.processes.append(GatewayProcess(chain, *role, *gateway_args, url=url, die_with_parent=True,
                                                     python=python))
            for p in self.processes:
                p.wait_ready(60)
        except Exception:
            self.close()
            raise

    def route(self, delay_ms: int) -> Tuple[str, str]:
        """Where a message with this delay is published: (exchange, routing key)."""
        return self.publish_exchange, "bench"

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


class _InsideTheBroker:
    """A system with no process of its own to measure: all its work is the broker's."""

    processes: List[GatewayProcess] = []

    def forwarded(self, queue: Optional[str] = None) -> float:
        return 0.0

    def lateness_buckets(self) -> dict:
        return {}

    def errors(self) -> List[dict]:
        return []


class Plugin(_InsideTheBroker):
    """An `x-delayed-message` exchange routing like a topic exchange: publish to it with
    `x-delay`, bind to it."""

    system = "plugin"

    def route(self, delay_ms: int) -> Tuple[str, str]:
        return self.publish_exchange, "bench"

    def __init__(self, url: str, prefix: str) -> None:
        self.url, self.prefix = url, prefix
        self.publish_exchange = self.deliver_exchange = f"{prefix}.delayed"
        with blocking(url) as c:
            c.channel().exchange_declare(self.publish_exchange, "x-delayed-message", durable=True,
                                         arguments={"x-delayed-type": "topic"})

    def close(self) -> None:
        # Messages still delayed inside the plugin (pending) stay in its table until due and
        # are then dropped, their exchange gone.
        try:
            with blocking(self.url) as c:
                c.channel().exchange_delete(self.publish_exchange)
        except pika.exceptions.AMQPError:
            pass


def whole_seconds(delay_ms: int) -> int:
    """kombu's countdown for a delay: rounded up, so never early; at least 1 (kombu's minimum)."""
    return max(1, math.ceil(delay_ms / 1000))


class Kombu(_InsideTheBroker):
    """Celery 5.5+'s native delayed delivery, declared with kombu's own functions under a
    prefix of its own: 28 quorum queues of 2^level s TTL, the delay spelled in the routing
    key's 28 bits, published to the top level's exchange. The user's topic exchange is
    bound to the chain's delivery exchange as kombu binds a Celery queue. Delays are whole
    seconds there: each is rounded up (Celery's own int() rounds down, which delivers
    early), so its lateness includes up to a second of rounding."""

    system = "kombu"

    def __init__(self, url: str, prefix: str, receiver_queue_type: str) -> None:
        from kombu import Connection, Exchange, Queue
        from kombu.transport import native_delayed_delivery as native
        self.url, self.prefix, self._native = url, prefix, native
        self.publish_exchange = native.level_name(native.MAX_LEVEL, prefix)
        self.deliver_exchange = f"{prefix}.tasks"
        with blocking(url) as c:
            c.channel().exchange_declare(self.deliver_exchange, "topic", durable=True)
        with Connection(url) as conn:
            native.declare_native_delayed_delivery_exchanges_and_queues(conn, "quorum", prefix)
            # the scenario's receiver queue, bound the way kombu binds a Celery worker's queue
            queue = Queue(f"{prefix}.receiver", Exchange(self.deliver_exchange, "topic"), routing_key="bench",
                          durable=True, queue_arguments={"x-queue-type": receiver_queue_type})
            queue.bind(conn.default_channel).declare()
            native.bind_queue_to_native_delayed_delivery_exchange(conn, queue, prefix)

    def route(self, delay_ms: int) -> Tuple[str, str]:
        return self.publish_exchange, self._native.calculate_routing_key(whole_seconds(delay_ms), "bench")

    def close(self) -> None:
        native = self._native
        try:
            with blocking(self.url) as c:
                ch = c.channel()
                for level in range(native.MAX_LEVEL + 1):
                    ch.queue_delete(native.level_name(level, self.prefix))
                    ch.exchange_delete(native.level_name(level, self.prefix))
                ch.exchange_delete(f"{self.prefix}_{native.CELERY_DELAYED_DELIVERY_EXCHANGE}")
                ch.exchange_delete(self.deliver_exchange)
        except pika.exceptions.AMQPError:
            pass
