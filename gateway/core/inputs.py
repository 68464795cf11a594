"""What comes into the core: a delivery as the broker handed it to a consumer (pure).

The adapter (broker.run.consumer.Pipe) builds one per basic.deliver; the core (flow.Flow) and
its handlers take it in and answer with actions (actions.py)."""

from typing import NamedTuple

from gateway.core.wire import Properties


class Delivery(NamedTuple):
    """One message as it arrived: where it was published to, and its exact properties. (A
    tuple: one is made for every message read, and a tuple is the cheapest to make.)"""

    exchange: str
    routing_key: bytes
    props: Properties
    body: bytes
    redelivered: bool = False
