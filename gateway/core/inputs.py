"""What comes into the core: a delivery as the broker handed it to a consumer (pure).

The adapter (broker.run.consumer.Pipe) builds one per basic.deliver; the core (flow.Flow) and
its handlers take it in and answer with actions (actions.py)."""

from dataclasses import dataclass

from gateway.core.wire import Properties


@dataclass(frozen=True)
class Delivery:
    """One message as it arrived: where it was published to, and its exact properties."""

    exchange: str
    routing_key: bytes
    props: Properties
    body: bytes
    redelivered: bool = False
