"""What a consumer's core (flow.Flow) tells its adapter (broker.run.consumer.Pipe) to do after
each event, and the values it works with (pure)."""

from dataclasses import dataclass, field
from typing import Callable, List, NamedTuple, Optional, Protocol, Sequence, Tuple

from gateway.core.actions import Action, Forward, Publish
from gateway.core.inputs import Delivery
from gateway.core.carrier import Entry
from gateway.core.confirms import Publication
from gateway.core.routes import Way

Member = Tuple[int, Optional[Entry]]  # a delivery tag, and the publisher's message if it is one
Handler = Callable[[Delivery, int], List[Action]]  # a delivery, and the time it came (epoch ms)


class Payload(NamedTuple):
    """What one publication is: the frame to send, and whose messages it holds (one for
    every publish: a NamedTuple, cheaper to make than a dataclass)."""

    forward: Forward
    members: Sequence[Member]


Sent = Publication[Payload]


@dataclass
class Effects:
    """What the adapter (broker.run.consumer.Pipe) must do after an event, in this order: the
    core's last word, in the adapter's terms (frames to publish, delivery tags to acknowledge
    or reject, steps of the connection). flow.Flow builds it from its own decisions and the
    confirm window's answers (`confirms.Outcome`), which the adapter never sees."""

    publish: List[Sent] = field(default_factory=list)  # send each `payload.forward`, in order
    ack: List[Tuple[int, bool]] = field(default_factory=list)  # (delivery tag, multiple)
    reject: List[int] = field(default_factory=list)  # nack without requeue: the broker dead-letters it
    reconnect: bool = False  # start over on a new connection
    # After the acks: a round trip on the consuming channel (basic.qos), answered by
    # Flow.synced, so the broker has taken every ack sent before it.
    sync: bool = False
    finished: bool = False  # stopping, and nothing is left to wait for


class Observer(Protocol):
    """Metrics and logs: told what was decided; they decide nothing."""

    def forwarded(self, action: Publish) -> None: ...

    def landed(self, forward: Forward) -> None:
        """The broker confirmed it where it was sent (not returned as unroutable)."""

    def batched(self, way: Way, messages: int) -> None: ...

    def late(self, ms: int) -> None: ...

    def note(self, level: str, event: str, **fields: object) -> None: ...
