"""Publishing one partition's rows to check-in: one connection, confirms with a window.

Runs inside a Spark task (an executor's Python worker). pika's BlockingConnection waits
for each confirm before the next publish (a few hundred messages a second); the
SelectConnection used here keeps up to `window` publishes unconfirmed and moves on as
confirms arrive, which is what makes a bulk load fast and still makes each publish the
gateway's promise (a row counts as published only once the broker confirmed it).

A negative confirm (a quorum queue between leaders, the check-in queue full) is retried
after a second, three times; a message returned as unroutable means check-in has no
queue (topology not declared for this prefix) and fails the partition at once, as does a
lost connection. A failed partition is published again, whole, by the next run: rows are
published at least once, with the same message ids, never lost.
"""

import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import pika

from gateway.broker import codec
from gateway.broker.amqp import parameters
from gateway.settings import Tls, redact

NACK_RETRY_S = 1.0
NACK_ATTEMPTS = 3

Outgoing = Tuple[str, bytes, pika.BasicProperties]  # routing key, body, properties


class PublishError(RuntimeError):
    """One line: why this partition could not be published."""


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
        self.target, self.items, self.make, self.name = target, items, make, name
        self.pending: Dict[int, Tuple[Outgoing, int]] = {}  # sequence number -> (message, attempt)
        self.retry: List[Tuple[float, Outgoing, int]] = []  # (not before, message, attempt)
        self.seq = 0
        self.sent = 0  # first publishes (not retries), for the rate limit
        self.confirmed = 0
        self.exhausted = False
        self.error: Optional[str] = None
        self.connection = None
        self.channel = None
        self.start = 0.0
        self._closing = False

    # -- running ---------------------------------------------------------------------------
    def run(self) -> Published:
        self.start = time.monotonic()
        self.connection = self._connect()
        try:
            self.connection.ioloop.start()
        finally:
            if self.connection.is_open:
                self.connection.close()
                self.connection.ioloop.start()  # until closed
        if self.error:
            raise PublishError(self.error)
        return Published(self.confirmed, time.monotonic() - self.start)

    def _connect(self):
        errors = []
        deadline = time.monotonic() + self.target.connect_timeout
        delay = 0.2
        while True:
            for url in self.target.urls:
                try:  # _Select returns once connected, or raises: then the next URL
                    return _Select(self, parameters(url, self.name, self.target.tls))
                except Exception as exc:  # noqa: BLE001: reported below, in one line
                    errors.append(f"{redact(url)}: {exc!r}")
            if time.monotonic() + delay > deadline:
                raise PublishError("cannot connect: " + "; ".join(errors[-len(self.target.urls):]))
            time.sleep(delay)
            delay = min(delay * 2, 5.0)

    def fail(self, message: str) -> None:
        if self.error is None:
            self.error = message
        self._close()

    def _close(self) -> None:
        if self._closing:
            return
        self._closing = True
        if self.connection.is_open:
            self.connection.close()
        else:
            self.connection.ioloop.stop()

    # -- callbacks -------------------------------------------------------------------------
    def on_channel(self, channel) -> None:
        self.channel = channel
        channel.add_on_close_callback(self.on_channel_closed)
        channel.add_on_return_callback(self.on_return)
        channel.confirm_delivery(self.on_confirm, callback=lambda _frame: self.fill())

    def on_channel_closed(self, _channel, reason) -> None:
        if not self._closing:
            self.fail(f"the broker closed the channel: {reason}")

    def on_connection_closed(self, _connection, reason) -> None:
        if not self._closing:
            self.error = self.error or f"lost the connection: {reason}"
        self.connection.ioloop.stop()

    def on_return(self, _channel, method, _properties, _body) -> None:
        self.fail(f"{self.target.exchange} routed a message to no queue ({method.reply_text}): is the "
                  "gateway's topology declared with this --prefix? (`delay-gateway declare`)")

    def on_confirm(self, frame) -> None:
        m = frame.method
        if m.multiple:
            tags = [tag for tag in self.pending if tag <= m.delivery_tag]
        else:
            tags = [m.delivery_tag] if m.delivery_tag in self.pending else []
        nack = isinstance(m, pika.spec.Basic.Nack)
        for tag in tags:
            message, attempt = self.pending.pop(tag)
            if not nack:
                self.confirmed += 1
            elif attempt + 1 >= NACK_ATTEMPTS:
                self.fail(f"the broker refused a message {NACK_ATTEMPTS} times (negative confirms): "
                          "is the check-in queue full or without a leader?")
                return
            else:
                self.retry.append((time.monotonic() + NACK_RETRY_S, message, attempt + 1))
        self.fill()

    # -- publishing ------------------------------------------------------------------------
    def fill(self) -> None:
        if self._closing:
            return
        window = self.target.window
        now = time.monotonic()
        while self.retry and len(self.pending) < window and self.retry[0][0] <= now:
            _, message, attempt = self.retry.pop(0)
            self._send(message, attempt)
        allowed = self._allowed(now)
        while not self.exhausted and len(self.pending) < window and self.sent < allowed:
            try:
                item = next(self.items)
            except StopIteration:
                self.exhausted = True
                break
            self._send(self.make(item), 0)
            self.sent += 1
        if self.exhausted and not self.pending and not self.retry:
            self._close()
        elif self.retry or (not self.exhausted and self.sent >= allowed):
            self.connection.ioloop.call_later(0.01, self.fill)

    def _allowed(self, now: float) -> float:
        if self.target.max_rate <= 0:
            return float("inf")
        return (now - self.start) * self.target.max_rate + 1

    def _send(self, message: Outgoing, attempt: int) -> None:
        routing_key, body, properties = message
        # JSON headers have floats: sent as AMQP doubles, as the gateway sends them
        self.channel.basic_publish(self.target.exchange, routing_key, body, codec.encoded(properties), mandatory=True)
        self.seq += 1  # delivery tags of a confirming channel count publishes from 1
        self.pending[self.seq] = (message, attempt)


def _Select(publisher: PartitionPublisher, params: pika.ConnectionParameters):
    """A SelectConnection wired to `publisher`; raises if the broker cannot be reached."""
    failure: List[BaseException] = []

    def opened(connection):
        connection.ioloop.stop()

    def open_failed(connection, error):
        failure.append(error)
        connection.ioloop.stop()

    connection = pika.SelectConnection(params, on_open_callback=opened, on_open_error_callback=open_failed)
    connection.ioloop.start()
    if failure:
        raise failure[0] if isinstance(failure[0], BaseException) else RuntimeError(str(failure[0]))
    connection.add_on_close_callback(publisher.on_connection_closed)
    connection.channel(on_open_callback=publisher.on_channel)
    return connection
