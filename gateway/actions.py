"""The values that pass between a consumer and its handler."""

from dataclasses import dataclass
from typing import Optional

from pika import BasicProperties


@dataclass(frozen=True)
class Delivery:
    exchange: str
    routing_key: str
    properties: BasicProperties
    body: bytes
    redelivered: bool = False


@dataclass(frozen=True)
class Forward:
    """Publish this (with confirms); acknowledge the delivery once the broker confirms."""

    exchange: str
    routing_key: str
    properties: BasicProperties
    body: bytes
    outcome: str  # metric label and log event: chain, meditation, distributor, delivered, parked, ...
    not_before_ms: Optional[int] = None  # hold until then (epoch ms)
    reason: Optional[str] = None  # why it is parked
