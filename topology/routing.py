"""A pure model of how the broker routes through a topology: AMQP topic matching plus
dead-lettering on TTL. Used by the property tests and by `delay-gateway explain`."""

import functools
from dataclasses import dataclass
from typing import List, Tuple

from topology.model import Topology


def topic_matches(pattern: str, key: str) -> bool:
    """AMQP 0-9-1 topic semantics: '*' is exactly one word, '#' zero or more."""
    p, k = pattern.split("."), key.split(".")

    @functools.cache
    def match(i: int, j: int) -> bool:
        if i == len(p):
            return j == len(k)
        if p[i] == "#":
            return match(i + 1, j) or (j < len(k) and match(i, j + 1))
        return j < len(k) and (p[i] == "*" or p[i] == k[j]) and match(i + 1, j + 1)

    return match(0, 0)


def route(topology: Topology, exchange: str, key: str) -> List[str]:
    """The queues a message published to `exchange` with `key` lands in."""
    ex = topology.exchange(exchange)
    queues: List[str] = []
    for b in topology.bindings_from(exchange):
        if ex.type == "fanout" or topic_matches(b.routing_key, key):
            if b.destination_type == "queue":
                queues.append(b.destination)
            else:
                queues.extend(route(topology, b.destination, key))
    if not queues and "alternate-exchange" in ex.arguments:
        return route(topology, ex.arguments["alternate-exchange"], key)
    return queues


@dataclass(frozen=True)
class Hop:
    queue: str
    wait_ms: int


def trace(topology: Topology, exchange: str, key: str, stop_at: str) -> Tuple[Hop, ...]:
    """Follow a message through TTL queues until it lands in `stop_at` (a consumed queue).

    Raises ValueError if it is dropped, copied, or lands anywhere else.
    """
    hops: List[Hop] = []
    while True:
        queues = route(topology, exchange, key)
        if len(queues) != 1:
            raise ValueError(f"{exchange} routes {key!r} to {queues}: expected exactly one queue")
        queue = topology.queue(queues[0])
        if queue.name == stop_at:
            return tuple(hops)
        if queue.ttl_ms is None or queue.dead_letter_exchange is None:
            raise ValueError(f"{key!r} is stuck in {queue.name}")
        hops.append(Hop(queue.name, queue.ttl_ms))
        exchange = queue.dead_letter_exchange
