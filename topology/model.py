"""What the gateway declares: every exchange, queue and binding, computed from settings."""

import math
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Dict, Mapping, Optional, Tuple

from topology import index_bands
from topology.encoding import level_pattern
from topology.settings import ChainSettings

Json = Dict[str, Any]  # a JSON object

# Explicit on every consumed queue: RabbitMQ 4.0 defaults quorum queues to 20 and earlier
# versions to unlimited; one value everywhere means the same behaviour on every broker. A
# message redelivered this often is dead-lettered to parking, not dropped.
DELIVERY_LIMIT = 20
# Parked messages stay until a person replays or removes them, however often they are
# listed: a list reads and returns them, and every return counts against a quorum queue's
# delivery limit (20 by default on 4.0+; unlimited before). -1 means unlimited on 4.0 but
# drops the message at the first return on 3.10, so the largest limit both accept it is.
PARKED_DELIVERY_LIMIT = 2**31 - 1
PASS_THROUGH_TTL_MS = 1
# Without both, a quorum queue dead-letters at most once: a hop could drop the message
# (RabbitMQ's at-least-once dead-lettering needs both; docs/reliability.md).
AT_LEAST_ONCE = {"x-dead-letter-strategy": "at-least-once", "x-overflow": "reject-publish"}

# What each queue is for: `status` and `migrate` read these, not the names.
ROLES = ("check-in", "returning", "distributor", "parking", "parked", "meditation", "delay", "pass",
         "registry", "presence", "cancellations", "retry", "waiting")
# The record of declared chains is a stream: any number of readers can read it from the
# start at the same time without taking anything away (a queue read with basic.get hides
# what one reader holds from the others, and on 4.x counts each look against the delivery
# limit). It holds a few records per change of settings, so it needs no retention limit.
REGISTRY_ARGUMENTS = {"x-queue-type": "stream"}
# The presence queue never holds messages; quorum, so that it stays available (and its
# consumers counted) while a node of a cluster is down.
PRESENCE_ARGUMENTS = {"x-queue-type": "quorum"}
# Cancels (docs/cancelling.md) are kept for a window: by default the longest a message can go
# without passing a gateway consumer (a lap of meditation or one pass of the chain, both at
# most 2^max_level units) plus a day for outages, backlogs and clocks a little off.
DAY_MS = 86_400_000
# Segments are the unit a stream's retention removes: small enough that little is kept past
# the window (the default is 500 MB), large enough to be few.
CANCEL_SEGMENT_BYTES = 8_000_000


def cancel_window_ms(settings: ChainSettings, setting_s: float = 0.0) -> int:
    """The cancels' retention window: the setting (seconds), or the default above. A setting
    shorter than the longest a message goes without passing a gateway (a lap) raises
    ValueError: a cancel would be forgotten before the message it concerns came by again."""
    lap_ms = (1 << settings.max_level) * settings.resolution_ms
    if setting_s > 0:
        if setting_s * 1000 < lap_ms:
            raise ValueError(f"--cancel-retention {setting_s:g} s is shorter than the longest a message of this chain "
                             f"goes without passing a gateway ({math.ceil(lap_ms / 1000)} s: 2^max_level x "
                             "resolution): a cancel would be forgotten before the message it concerns comes by "
                             "again; give at least that, or 0 for the default (that plus a day)")
        return int(setting_s * 1000)
    return lap_ms + DAY_MS


def _frozen(mapping: Optional[Mapping[str, Any]]) -> Mapping[str, Any]:
    return MappingProxyType(dict(mapping or {}))


@dataclass(frozen=True)
class Exchange:
    name: str
    type: str
    arguments: Mapping[str, Any] = field(default_factory=dict)
    internal: bool = False

    def __post_init__(self) -> None:
        if self.type not in ("topic", "fanout"):
            raise ValueError(f"unexpected exchange type {self.type!r}")
        object.__setattr__(self, "arguments", _frozen(self.arguments))


@dataclass(frozen=True)
class Queue:
    name: str
    arguments: Mapping[str, Any] = field(default_factory=dict)
    role: str = "delay"
    level: Optional[int] = None  # delay and pass queues: their level; meditation, presence: the chain's max_level

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"unexpected queue role {self.role!r}")
        object.__setattr__(self, "arguments", _frozen(self.arguments))

    @property
    def ttl_ms(self) -> Optional[int]:
        return self.arguments.get("x-message-ttl")

    @property
    def dead_letter_exchange(self) -> Optional[str]:
        return self.arguments.get("x-dead-letter-exchange")

    @property
    def declared_once(self) -> bool:
        """Declared with its arguments only when missing: the cancellations stream keeps the
        window it was first declared with, as a queue's arguments cannot change, while the
        setting may (the gateways' memory follows the setting)."""
        return self.role == "cancellations"

    @property
    def consumed(self) -> bool:
        """Read by the gateway (the others only hold messages until their TTL, or for people)."""
        return self.role in ("check-in", "returning", "distributor", "parking", "retry")


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
        for name in exchanges | queues:
            if len(name.encode()) > 255:
                raise ValueError(f"name {name!r} is longer than AMQP's 255 bytes")
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

    def in_chain(self, name: str) -> bool:
        """Whether `name` is an object of this generation's chain (one that can be retired
        once empty), rather than one every generation shares."""
        return name.startswith(self.settings.names.chain + ".")


def build(settings: ChainSettings, cancel_window: Optional[int] = None) -> Topology:
    """Everything under the prefix for these settings; `cancel_window` (ms): the cancels'
    retention window, by default `cancel_window_ms(settings)`."""
    n = settings.names
    window_ms = cancel_window if cancel_window else cancel_window_ms(settings)

    def consumed(name: str, role: str, dlx: str) -> Queue:
        # The gateway's own queues are always quorum queues, whatever the chain's type:
        # replicated, and dead-lettering at least once to parking. queue_type chooses the
        # chain's queues, where the hops (and so the broker's work) are. They dead-letter
        # with their role as routing key: parking tells by it whether a message is as its
        # publisher sent it (from check-in) or in the gateway's own format (all others).
        return Queue(name, {"x-queue-type": "quorum", "x-dead-letter-exchange": dlx,
                            "x-dead-letter-routing-key": role, **AT_LEAST_ONCE,
                            "x-delivery-limit": DELIVERY_LIMIT}, role)

    def waiting(name: str, role: str, ttl: int, dlx: str, level: int) -> Queue:
        args: Json = {"x-queue-type": settings.queue_type, "x-message-ttl": ttl, "x-dead-letter-exchange": dlx}
        if settings.queue_type == "quorum":
            args.update(AT_LEAST_ONCE)
        return Queue(name, args, role, level)

    # The contract's exchanges carry no arguments, so any client's plain declare of them
    # succeeds; a due message nobody is bound for at pick-up comes back to the distributor
    # (mandatory publish) and is parked there. The chain's exchanges, which only the
    # gateway publishes to, send a key they have no binding for to parking instead of
    # dropping it, or (at-least-once) leaving it to block the queue it came from.
    catch = {"alternate-exchange": n.parking}
    exchanges = [
        Exchange(n.check_in, "topic"),
        Exchange(n.pick_up, "topic"),
        Exchange(n.returning, "fanout", internal=True),
        Exchange(n.distributor, "fanout"),
        Exchange(n.parking, "fanout"),
        Exchange(n.parked, "fanout"),
        # Records reach the registry through an exchange of the prefix, so the least
        # privilege (docs/security.md) holds: nothing is published to the default exchange.
        Exchange(n.registry, "fanout"),
        Exchange(settings.meditation, "fanout"),
        # Cancels: publishers send them to `cancel` (no arguments, like check-in), which is
        # bound to the check-in queue so that a cancel queues behind the messages published
        # before it; check-in records them in the `cancellations` stream every gateway follows.
        # Group cancels (rules) have an exchange of their own, bound the same way: a right of
        # their own (docs/security.md).
        Exchange(n.cancel, "fanout"),
        Exchange(n.rules, "fanout"),
        Exchange(n.cancellations, "fanout"),
        # Failed messages to retry later: the dead-letter exchange of the users' queues
        # (docs/retries.md); no arguments, so a plain declare of it succeeds.
        Exchange(n.retry, "fanout"),
        # The index of what waits (topology/index_bands.py): one stream per band and one of done
        # records, behind one exchange keyed by band (no wildcards: a direct exchange, declared
        # as a topic one like the others).
        Exchange(n.waiting, "topic"),
    ] + [Exchange(n.level(k), "topic", catch) for k in range(settings.max_level)]

    queues = [
        consumed(n.check_in, "check-in", n.parking),
        consumed(n.returning, "returning", n.parking),
        consumed(n.distributor, "distributor", n.parking),
        consumed(n.parking, "parking", n.parked),
        consumed(n.retry, "retry", n.parking),
        Queue(n.parked, {"x-queue-type": "quorum", "x-delivery-limit": PARKED_DELIVERY_LIMIT}, "parked"),
        Queue(n.registry, REGISTRY_ARGUMENTS, "registry"),
        Queue(n.gateways(settings.max_level), PRESENCE_ARGUMENTS, "presence", settings.max_level),
        waiting(settings.meditation, "meditation", settings.meditation_ms, n.exit_returning(settings.queue_type),
                settings.max_level),
        Queue(n.cancellations, {"x-queue-type": "stream", "x-max-age": f"{math.ceil(window_ms / 1000)}s",
                                "x-stream-max-segment-size-bytes": CANCEL_SEGMENT_BYTES}, "cancellations"),
    ]
    bindings = [
        Binding(n.check_in, n.check_in, "#"),
        Binding(n.returning, n.returning),
        Binding(n.distributor, n.distributor),
        Binding(n.parking, n.parking),
        Binding(n.parked, n.parked),
        Binding(n.registry, n.registry),
        Binding(settings.meditation, settings.meditation),
        Binding(n.cancel, n.check_in),
        Binding(n.rules, n.check_in),
        Binding(n.retry, n.retry),
        Binding(n.cancellations, n.cancellations),
    ]
    # every wait of this chain fits its bands: a lap, or one pass (the lead and carrier wait a
    # pass adds beyond a lap go in the top band: a reader reads a minute more than a span)
    for key in [index_bands.band_key(b) for b in range(index_bands.bands(settings))] + [index_bands.DONE]:
        queues.append(Queue(n.waiting_stream(key), {
            "x-queue-type": "stream", "x-max-age": f"{index_bands.max_age_s(key)}s",
            "x-stream-max-segment-size-bytes": index_bands.SEGMENT_BYTES}, "waiting"))
        bindings.append(Binding(n.waiting, n.waiting_stream(key), key))
    if settings.queue_type != "quorum":  # the chain's own exits (names.exit_distributor)
        for name, role, internal in ((n.exit_returning(settings.queue_type), "returning", True),
                                     (n.exit_distributor(settings.queue_type), "distributor", False)):
            exchanges.append(Exchange(name, "fanout", internal=internal))
            queues.append(Queue(name, {"x-queue-type": settings.queue_type}, role))
            bindings.append(Binding(name, name))
    for k in range(settings.max_level):
        queues.append(waiting(n.delay_queue(k), "delay", settings.level_ttl_ms(k), n.below(k), k))
        bindings.append(Binding(n.level(k), n.delay_queue(k), level_pattern(k, "1")))
        if settings.zero_bits == "queue":
            queues.append(waiting(n.pass_queue(k), "pass", PASS_THROUGH_TTL_MS, n.below(k), k))
            bindings.append(Binding(n.level(k), n.pass_queue(k), level_pattern(k, "0")))
        else:
            bindings.append(Binding(n.level(k), n.below(k), level_pattern(k, "0"), "exchange"))
    return Topology(settings, tuple(exchanges), tuple(queues), tuple(bindings))

