"""One publisher with confirms and a window: the Spark job's partitions and the benchmark.

pika's BlockingConnection waits for each confirm before the next publish (a few hundred
messages a second); this SelectConnection keeps up to `window` publishes unconfirmed and
moves on as confirms arrive (core/confirms.Window numbers the publishes and settles them, as
it does for the gateway's consumers), so a message counts as published only once the broker
confirmed it and a bulk load is still fast. Optionally paced (`max_rate` a second).

A negative confirm (a quorum queue between leaders, a full queue) is retried after
`retry_s`, up to `nack_attempts` publishes in all, then the run fails; with
`nack_attempts=0` a negative confirm is final and only counted (the benchmark's loss
figure). A mandatory publish returned as unroutable fails the run at once, as does a lost
connection or channel. With `confirm_timeout_s`, confirms that stop coming end the run once
everything is sent, counted as unconfirmed.
"""

import time
from collections import deque
from typing import Any, Deque, Dict, Iterator, List, Optional, Sequence, Tuple

import pika
from pika import spec

from gateway.broker.plumbing import lazy_properties, wire_connection
from gateway.broker.plumbing.amqp import parameters
from gateway.core.confirms import Publication, Window
from gateway.settings import Tls
from gateway.urls import redact

# exchange, routing key, properties (pika's, with Python values; or bytes as they are), body
Outgoing = Tuple[str, str, Any, bytes]


class PublishError(RuntimeError):
    """One line: why the messages could not all be published."""


class WindowPublisher:
    """Publishes every message of `items` (read just before each is sent); `run` returns
    once each is confirmed (or, without retries, refused), or raises PublishError."""

    def __init__(self, urls: Sequence[str], items: Iterator[Outgoing], name: str, tls: Optional[Tls] = None,
                 window: int = 1000, max_rate: float = 0.0, mandatory: bool = True, nack_attempts: int = 3,
                 retry_s: float = 1.0, connect_timeout: float = 30.0, confirm_timeout_s: float = 0.0,
                 tick_s: float = 0.01, unroutable: str = "the exchange routed a message to no queue",
                 unroutable_hint: str = "", queue: str = "the queue") -> None:
        self.urls, self.items, self.name, self.tls = tuple(urls), items, name, tls
        self.window, self.max_rate, self.mandatory = window, max_rate, mandatory
        self.nack_attempts, self.retry_s, self.connect_timeout = nack_attempts, retry_s, connect_timeout
        self.confirm_timeout_s, self.tick_s, self.queue = confirm_timeout_s, tick_s, queue
        self.unroutable, self.unroutable_hint = unroutable, unroutable_hint
        # What is sent and not confirmed yet, by sequence number (a publication's `refused`
        # counts the broker's negative confirms: the attempts before its latest).
        self.confirms: Window[Outgoing] = Window()
        self._retry: Deque[Tuple[float, Publication[Outgoing]]] = deque()  # (not before, to send again)
        self.sent = self.acked = self.nacked = 0  # sent: first publishes, not retries
        self.confirm_times: List[float] = []  # one per confirmed message: s since start
        self.exhausted = False
        self.error: Optional[str] = None
        self.start = self.end = self._last_confirm = 0.0
        self._connection: Any = None
        self._channel: Any = None
        self._closing = False
        self._ticking = self._watching = False  # timers scheduled (one each: every confirm calls fill)

    @property
    def pending(self) -> Dict[int, Tuple[Outgoing, int]]:
        """Sent and not confirmed: sequence number -> (message, attempt), in order."""
        return {p.seq: (p.payload, p.refused) for p in self.confirms.inflight()}

    @property
    def retry(self) -> List[Tuple[float, Outgoing, int]]:
        """Refused, to be sent again: (not before, message, attempt)."""
        return [(at, p.payload, p.refused) for at, p in list(self._retry)]

    @property
    def unconfirmed(self) -> int:
        return self.confirms.unconfirmed + len(self._retry)

    @property
    def seconds(self) -> float:
        return self.end - self.start

    # -- running ---------------------------------------------------------------------------
    def run(self) -> "WindowPublisher":
        self.start = time.monotonic()
        self._connection = self._connect()
        try:
            self._connection.ioloop.start()
        finally:
            if self._connection.is_open:
                self._connection.close()
                self._connection.ioloop.start()  # until closed
        self.end = self.end or time.monotonic()
        if self.error:
            raise PublishError(self.error)
        return self

    def _connect(self) -> Any:
        errors = []
        deadline = time.monotonic() + self.connect_timeout
        delay = 0.2
        while True:
            for url in self.urls:
                try:  # returns once connected, or raises: then the next URL
                    return _opened(self, parameters(url, self.name, self.tls))
                except Exception as exc:  # reported below, in one line
                    errors.append(f"{redact(url)}: {exc!r}")
            if time.monotonic() + delay > deadline:
                raise PublishError("cannot connect: " + "; ".join(errors[-len(self.urls):]))
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
        self.end = time.monotonic()
        if self._connection.is_open:
            self._connection.close()
        else:
            self._connection.ioloop.stop()

    # -- callbacks -------------------------------------------------------------------------
    def on_channel(self, channel: Any) -> None:
        self._channel = channel
        channel.add_on_close_callback(self.on_channel_closed)
        channel.add_on_return_callback(self.on_return)
        wire_connection.confirm_delivery(channel, self.on_confirm, callback=lambda _frame: self._begin())

    def _begin(self) -> None:
        self.start = time.monotonic()  # the rate counts from here
        self.confirms.open()  # (nothing waits to be sent yet)
        self.fill()

    def on_channel_closed(self, _channel: Any, reason: Exception) -> None:
        if not self._closing:
            self.fail(f"the broker closed the channel: {reason}")

    def on_connection_closed(self, _connection: Any, reason: Exception) -> None:
        if not self._closing:
            self.error = self.error or f"lost the connection: {reason}"
        self._connection.ioloop.stop()

    def on_return(self, _channel: Any, method: Any, _properties: Any, _body: bytes) -> None:
        hint = f": {self.unroutable_hint}" if self.unroutable_hint else ""
        self.fail(f"{self.unroutable} ({method.reply_text}){hint}")

    def on_confirm(self, frame: Any) -> None:
        m = frame.method
        self._last_confirm = time.monotonic()
        # Confirms may come out of order (a single ack for a later message before a multiple
        # ack that covers earlier ones): the window settles each publish, never counts by tag.
        settled = self.confirms.confirmed(m.delivery_tag, m.multiple, not isinstance(m, spec.Basic.Nack))
        for _ in settled.confirmed:
            self.acked += 1
            self.confirm_times.append(self._last_confirm - self.start)
        for pub in settled.refused:
            if self.nack_attempts <= 0:
                self.nacked += 1
            elif pub.refused >= self.nack_attempts:
                self.fail(f"the broker refused a message {self.nack_attempts} times (negative confirms): "
                          f"is {self.queue} full or without a leader?")
                return
            else:
                self._retry.append((self._last_confirm + self.retry_s, pub))
        self.fill()

    # -- publishing ------------------------------------------------------------------------
    def fill(self) -> None:
        if self._closing:
            return
        now = time.monotonic()
        while self._retry and self.confirms.unconfirmed < self.window and self._retry[0][0] <= now:
            self._send(self._retry.popleft()[1])
        allowed = self._allowed(now)
        while not self.exhausted and self.confirms.unconfirmed < self.window and self.sent < allowed:
            try:
                message = next(self.items)
            except StopIteration:
                self.exhausted = True
                break
            self._send(Publication((), message))
            self.sent += 1
        if self.exhausted and not self.confirms.unconfirmed and not self._retry:
            self._close()
        elif (self._retry or (not self.exhausted and self.sent >= allowed)) and not self._ticking:
            self._ticking = True
            self._connection.ioloop.call_later(self.tick_s, self._tick)
        elif self.exhausted and self.confirm_timeout_s and self.confirms.unconfirmed and not self._watching:
            self._watching = True
            self._connection.ioloop.call_later(0.5, self._watch)

    def _tick(self) -> None:
        self._ticking = False
        self.fill()

    def _watch(self) -> None:
        """All sent: give up on confirms that do not come (they count as unconfirmed)."""
        if self._closing or not self.confirms.unconfirmed:
            return
        if time.monotonic() - max(self._last_confirm, self.start) > self.confirm_timeout_s:
            self._close()
        else:
            self._connection.ioloop.call_later(0.5, self._watch)

    def _allowed(self, now: float) -> float:
        if self.max_rate <= 0:
            return float("inf")
        return int((now - self.start) * self.max_rate) + 1

    def _send(self, pub: Publication[Outgoing]) -> None:
        for sent in self.confirms.add(pub).send:  # (numbered as the channel numbers its publishes)
            exchange, routing_key, properties, body = sent.payload
            # pika cannot encode floats (JSON headers have them): sent as AMQP doubles, as the gateway does
            self._channel.basic_publish(exchange, routing_key, body, lazy_properties.encoded(properties),
                                        mandatory=self.mandatory)


def _opened(publisher: WindowPublisher, params: pika.ConnectionParameters) -> Any:
    """A connection wired to `publisher`; raises if the broker cannot be reached."""
    failure: List[BaseException] = []

    def opened(connection: Any) -> None:
        connection.ioloop.stop()

    def open_failed(connection: Any, error: Any) -> None:
        failure.append(error if isinstance(error, BaseException) else RuntimeError(str(error)))
        connection.ioloop.stop()

    connection = pika.SelectConnection(params, on_open_callback=opened, on_open_error_callback=open_failed)
    connection.ioloop.start()
    if failure:
        raise failure[0]
    connection.add_on_close_callback(publisher.on_connection_closed)
    connection.channel(on_open_callback=publisher.on_channel)
    return connection

