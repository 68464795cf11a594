"""Publishing one partition's rows to check-in: one connection, confirms with a window
(the gateway's confirm-window publisher, broker/tools/window.py).

Runs inside a Spark task (an executor's Python worker). A row counts as published only once
the broker confirmed it. A negative confirm (a quorum queue between leaders, the check-in
queue full) is retried after a second, three times; a message returned as unroutable means
check-in has no queue (topology not declared for this prefix) and fails the partition at
once, as does a lost connection. A failed partition is published again, whole, by the next
run: rows are published at least once, with the same message ids, never lost.
"""

from dataclasses import dataclass
from typing import Any, Callable, Iterator, Tuple

import pika

from gateway.broker.tools.window import PublishError, WindowPublisher
from gateway.settings import Tls

__all__ = ["PartitionPublisher", "PublishError", "Published", "Target"]

NACK_RETRY_S = 1.0
NACK_ATTEMPTS = 3

Outgoing = Tuple[str, bytes, pika.BasicProperties]  # routing key, body, properties


@dataclass(frozen=True)
class Target:
    """Where and how to publish (picklable: shipped to the executors)."""

    urls: Tuple[str, ...]
    exchange: str
    tls: Tls = Tls()
    window: int = 1000
    max_rate: float = 0.0  # rows per second for this partition; 0: as fast as confirms allow
    connect_timeout: float = 30.0


@dataclass
class Published:
    rows: int = 0
    seconds: float = 0.0


class PartitionPublisher:
    """Publishes what `make` turns each item of `items` into; `run` returns once every
    message is confirmed, or raises PublishError."""

    def __init__(self, target: Target, items: Iterator[Any], make: Callable[[Any], Outgoing],
                 name: str = "delay-gateway schedule") -> None:
        messages = ((target.exchange, key, props, body) for key, body, props in map(make, items))
        self.publisher = WindowPublisher(
            target.urls, messages, name, target.tls, window=target.window, max_rate=target.max_rate,
            nack_attempts=NACK_ATTEMPTS, retry_s=NACK_RETRY_S, connect_timeout=target.connect_timeout,
            unroutable=f"{target.exchange} routed a message to no queue",
            unroutable_hint="is the gateway's topology declared with this --prefix? (`delay-gateway declare`)",
            queue="the check-in queue")

    def run(self) -> Published:
        p = self.publisher.run()
        return Published(p.acked, p.seconds)
