"""A stand-in for pika's SelectConnection and its channels, driven by the test: the real
consumer (broker.consumer.Pipe) runs against it without a broker, as dramatiq's StubBroker
lets a worker run without one. Nothing happens by itself: the test delivers messages,
confirms or returns publishes, closes channels, and moves the clock, which fires timers.
Callbacks that pika would run later from its ioloop (channel opened, basic.qos-ok, ...)
wait in a queue until `settle()`.

It keeps what the consumer sent: every publish (with its sequence number on its channel
and the channel it went on), every ack and nack, and (`frames`) the order of acks, nacks,
publishes and basic.qos.
"""

from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple

from pika import spec
from pika.exceptions import ChannelClosedByBroker, ChannelWrongStateError

from gateway.broker.plumbing.lazy_properties import WireProperties
from gateway.core.wire import Properties


class Clock:
    def __init__(self, now_ms: int = 1_700_000_000_000) -> None:
        self.now_ms = now_ms

    def __call__(self) -> int:
        return self.now_ms


@dataclass
class Published:
    channel: "FakeChannel"
    seq: int
    exchange: str
    routing_key: bytes
    body: bytes
    props: Properties
    mandatory: bool


class FakeLoop:
    """pika's ioloop: timers on the fake clock, and callbacks to run soon."""

    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        self._timers: Dict[int, Tuple[int, Callable[[], None]]] = {}
        self._n = 0
        self.soon: List[Callable[[], None]] = []

    def call_later(self, delay_s: float, callback: Callable[[], None]) -> int:
        self._n += 1
        self._timers[self._n] = (self.clock.now_ms + round(delay_s * 1000), callback)
        return self._n

    def remove_timeout(self, handle: int) -> None:
        self._timers.pop(handle, None)

    def next_timer(self) -> Optional[int]:
        return min((at for at, _ in self._timers.values()), default=None)

    def run_timers(self) -> None:
        """Fire the timers due by now, earliest first (a timer may add others)."""
        while True:
            due = sorted((at, n) for n, (at, _) in self._timers.items() if at <= self.clock.now_ms)
            if not due:
                return
            _, n = due[0]
            _, callback = self._timers.pop(n)
            callback()


class FakeChannel:
    def __init__(self, connection: "FakeConnection", number: int) -> None:
        self.connection, self.number = connection, number
        self.is_open = True
        self.on_close: List[Callable[[Any, Exception], None]] = []
        self.on_return: List[Callable[..., None]] = []
        self.on_cancel: List[Callable[[Any], None]] = []
        self.on_confirm: Optional[Callable[[Any], None]] = None
        self.on_message: Optional[Callable[..., None]] = None
        self.consumer_tag: Optional[str] = None
        self.prefetch = 0
        self.seq = 0  # publishes on this channel (confirm mode numbers them from 1)
        self.delivery_tag = 0
        self.acks: List[Tuple[int, bool]] = []
        self.nacks: List[Tuple[int, bool]] = []

    # -- what the consumer calls --------------------------------------------------------
    def add_on_close_callback(self, callback: Callable[[Any, Exception], None]) -> None:
        self.on_close.append(callback)

    def add_on_return_callback(self, callback: Callable[..., None]) -> None:
        self.on_return.append(callback)

    def add_on_cancel_callback(self, callback: Callable[[Any], None]) -> None:
        self.on_cancel.append(callback)

    def confirm_delivery(self, on_confirm: Callable[[Any], None], callback: Callable[[Any], None]) -> None:
        self.on_confirm = on_confirm
        self.connection.loop.soon.append(lambda: callback(None))

    def basic_qos(self, prefetch_count: int, callback: Callable[[Any], None]) -> None:
        self.prefetch = prefetch_count
        self.connection.frames.append(("qos", self.number))
        self.connection.loop.soon.append(lambda: callback(None))

    def queue_declare(self, queue: str, passive: bool, callback: Callable[[Any], None]) -> None:
        frame = _Frame(spec.Queue.DeclareOk(queue, self.connection.backlog, 0))
        self.connection.loop.soon.append(lambda: callback(frame))

    def basic_consume(self, queue: str, on_message: Callable[..., None], callback: Callable[[Any], None],
                      arguments: Optional[Dict[str, Any]] = None) -> str:
        self.on_message, self.consumer_tag = on_message, f"ctag-{self.number}"
        self.consume_arguments = arguments or {}
        self.connection.loop.soon.append(lambda: callback(None))
        return self.consumer_tag

    def basic_cancel(self, consumer_tag: str, callback: Callable[[Any], None]) -> None:
        self.on_message = None
        self.connection.loop.soon.append(lambda: callback(None))

    def basic_publish(self, exchange: str, routing_key: bytes, body: bytes, properties: WireProperties,
                      mandatory: bool = False) -> None:
        if not self.is_open:
            raise ChannelWrongStateError("Channel is closed.")
        self.seq += 1
        self.connection.published.append(
            Published(self, self.seq, exchange, routing_key, body, properties.wire, mandatory))
        self.connection.frames.append(("publish", exchange))

    def basic_ack(self, delivery_tag: int, multiple: bool = False) -> None:
        if not self.is_open:
            raise ChannelWrongStateError("Channel is closed.")
        self.acks.append((delivery_tag, multiple))
        self.connection.frames.append(("ack", delivery_tag, multiple))

    def basic_nack(self, delivery_tag: int, multiple: bool = False, requeue: bool = True) -> None:
        if not self.is_open:
            raise ChannelWrongStateError("Channel is closed.")
        self.nacks.append((delivery_tag, requeue))
        self.connection.frames.append(("nack", delivery_tag, requeue))

    # -- what the test does, as the broker ----------------------------------------------
    def deliver(self, body: bytes, props: Optional[Properties] = None, routing_key: str = "k",
                exchange: str = "", redelivered: bool = False) -> int:
        assert self.on_message is not None, "nobody consumes on this channel"
        props = props if props is not None else Properties.build()
        self.delivery_tag += 1
        method = spec.Basic.Deliver(self.consumer_tag, self.delivery_tag, redelivered, exchange, routing_key)
        self.on_message(self, method, WireProperties(props), body)
        return self.delivery_tag

    def confirm(self, seq: int, ack: bool = True, multiple: bool = False) -> None:
        assert self.on_confirm is not None
        method = spec.Basic.Ack(seq, multiple) if ack else spec.Basic.Nack(seq, multiple)
        self.on_confirm(_Frame(method))

    def give_back(self, pub: Published) -> None:
        """basic.return: nobody is bound for a mandatory publish (its confirm follows)."""
        method = spec.Basic.Return(312, "NO_ROUTE", pub.exchange, pub.routing_key.decode("latin-1"))
        for callback in self.on_return:
            callback(self, method, WireProperties(pub.props), pub.body)

    def close_by_broker(self, code: int = 406, text: str = "PRECONDITION_FAILED") -> None:
        self.is_open = False
        for callback in self.on_close:
            callback(self, ChannelClosedByBroker(code, text))


@dataclass
class _Frame:
    method: Any


@dataclass
class FakeConnection:
    clock: Clock = field(default_factory=Clock)
    is_open: bool = True
    channels: List[FakeChannel] = field(default_factory=list)
    published: List[Published] = field(default_factory=list)
    frames: List[tuple] = field(default_factory=list)  # what went out, in order: qos, publish, ack, nack
    backlog: int = 0  # what a queue holds, as queue.declare-ok says

    def __post_init__(self) -> None:
        self.loop = self.ioloop = FakeLoop(self.clock)

    def channel(self, on_open_callback: Callable[[FakeChannel], None]) -> None:
        ch = FakeChannel(self, len(self.channels) + 1)
        self.channels.append(ch)
        self.loop.soon.append(lambda: on_open_callback(ch))

    def close(self) -> None:
        """The consumer closes the connection: its channels close with it."""
        if not self.is_open:
            return
        self.is_open = False
        for ch in self.channels:
            if ch.is_open:
                ch.is_open = False
                for callback in ch.on_close:
                    callback(ch, ChannelClosedByBroker(320, "CONNECTION_FORCED"))

    def settle(self) -> None:
        """Run the callbacks pika would run next from its ioloop."""
        while self.loop.soon:
            self.loop.soon.pop(0)()

    def advance(self, ms: int) -> None:
        self.clock.now_ms += ms
        self.settle()
        self.loop.run_timers()
        self.settle()

    def open_channels(self) -> List[FakeChannel]:
        return [c for c in self.channels if c.is_open]

    def consuming(self) -> FakeChannel:
        return next(c for c in self.open_channels() if c.consumer_tag is not None)

    def publishing(self) -> Optional[FakeChannel]:
        return next((c for c in self.open_channels() if c.on_confirm is not None), None)
