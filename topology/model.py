"""What the gateway declares: every exchange, queue and binding, computed from settings."""

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Mapping, Optional, Tuple

from .encoding import level_pattern
from .settings import ChainSettings

# Explicit on every consumed quorum queue: RabbitMQ 4.0 defaults to 20 and earlier versions
# to unlimited; one value everywhere means the same behaviour on every broker. A message
# redelivered this often is dead-lettered to parking, not dropped.
DELIVERY_LIMIT = 20
PASS_THROUGH_TTL_MS = 1


def _frozen(mapping: Optional[Mapping]) -> Mapping:
    return MappingProxyType(dict(mapping or {}))


@dataclass(frozen=True)
class Exchange:
    name: str
    type: str
    arguments: Mapping = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.type not in ("topic", "fanout"):
            raise ValueError(f"unexpected exchange type {self.type!r}")
        object.__setattr__(self, "arguments", _frozen(self.arguments))


@dataclass(frozen=True)
class Queue:
    name: str
    arguments: Mapping = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "arguments", _frozen(self.arguments))

    @property
    def ttl_ms(self) -> Optional[int]:
        return self.arguments.get("x-message-ttl")

    @property
    def dead_letter_exchange(self) -> Optional[str]:
        return self.arguments.get("x-dead-letter-exchange")


@dataclass(frozen=True)
class Binding:
    source: str
    destination: str
    routing_key: str = ""
    destination_type: str = "queue"

    def __post_init__(self) -> None:
        if self.destination_type not in ("queue", "exchange"):
            raise ValueError(f"unexpected destination type {self.destination_type!r}")


@dataclass(frozen=True)
class Topology:
    settings: ChainSettings
    exchanges: Tuple[Exchange, ...]
    queues: Tuple[Queue, ...]
    bindings: Tuple[Binding, ...]

    def __post_init__(self) -> None:
        exchanges = {e.name for e in self.exchanges}
        queues = {q.name for q in self.queues}
        if len(exchanges) != len(self.exchanges) or len(queues) != len(self.queues):
            raise ValueError("duplicate exchange or queue name")
        for b in self.bindings:
            targets = queues if b.destination_type == "queue" else exchanges
            if b.source not in exchanges or b.destination not in targets:
                raise ValueError(f"binding {b} names something not declared")
        for q in self.queues:
            if q.dead_letter_exchange and q.dead_letter_exchange not in exchanges:
                raise ValueError(f"queue {q.name} dead-letters to an undeclared exchange")

    def exchange(self, name: str) -> Exchange:
        return next(e for e in self.exchanges if e.name == name)

    def queue(self, name: str) -> Queue:
        return next(q for q in self.queues if q.name == name)

    def bindings_from(self, source: str) -> Tuple[Binding, ...]:
        return tuple(b for b in self.bindings if b.source == source)


def build(settings: ChainSettings) -> Topology:
    n = settings.names
    quorum = settings.queue_type == "quorum"

    def queue(name: str, ttl: Optional[int] = None, dlx: Optional[str] = None, consumed: bool = False) -> Queue:
        args: dict = {"x-queue-type": settings.queue_type}
        if ttl is not None:
            args["x-message-ttl"] = ttl
        if dlx is not None:
            args["x-dead-letter-exchange"] = dlx
            if quorum:
                # Without both, a quorum queue dead-letters at most once: a hop could drop
                # the message (see RABBITMQ-FACTS, at-least-once dead-lettering).
                args["x-dead-letter-strategy"] = "at-least-once"
                args["x-overflow"] = "reject-publish"
        if consumed and quorum:
            args["x-delivery-limit"] = DELIVERY_LIMIT
        return Queue(name, args)

    # Any exchange that can be handed a key it has no binding for sends it to parking,
    # where the gateway parks it with a reason: dropping it, or (at-least-once) leaving it
    # to block the queue it was dead-lettered from, are both worse.
    catch = {"alternate-exchange": n.parking}
    exchanges = [
        Exchange(n.check_in, "fanout"),
        Exchange(n.meditation, "fanout"),
        Exchange(n.distributor, "fanout"),
        Exchange(n.pick_up, "topic", catch),
        Exchange(n.parking, "fanout"),
        Exchange(n.parked, "fanout"),
    ] + [Exchange(n.level(k), "topic", catch) for k in range(settings.max_level)]

    queues = [
        queue(n.check_in, dlx=n.parking, consumed=True),
        queue(n.meditation, ttl=settings.meditation_ms, dlx=n.check_in),
        queue(n.distributor, dlx=n.parking, consumed=True),
        queue(n.parking, dlx=n.parked, consumed=True),
        queue(n.parked),
    ]
    bindings = [
        Binding(n.check_in, n.check_in),
        Binding(n.meditation, n.meditation),
        Binding(n.distributor, n.distributor),
        Binding(n.parking, n.parking),
        Binding(n.parked, n.parked),
    ]
    for k in range(settings.max_level):
        queues.append(queue(n.delay_queue(k), ttl=settings.level_ttl_ms(k), dlx=n.below(k)))
        bindings.append(Binding(n.level(k), n.delay_queue(k), level_pattern(k, "1")))
        if settings.zero_bits == "queue":
            queues.append(queue(n.pass_queue(k), ttl=PASS_THROUGH_TTL_MS, dlx=n.below(k)))
            bindings.append(Binding(n.level(k), n.pass_queue(k), level_pattern(k, "0")))
        else:
            bindings.append(Binding(n.level(k), n.below(k), level_pattern(k, "0"), "exchange"))
    return Topology(settings, tuple(exchanges), tuple(queues), tuple(bindings))
