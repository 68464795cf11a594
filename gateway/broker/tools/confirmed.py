"""Publishes in batches with publisher confirms, on a BlockingConnection: every publish of a
batch goes out at once, and `wait` returns once the broker confirmed them all.

pika's BlockingChannel in confirm mode waits for each publish's confirm before the next: a
round trip and, on a quorum queue or a stream, a disk write per message, a few hundred a
second. Here the channel's own pika channel (`_impl`, pinned in pyproject.toml) is put in
confirm mode and written to directly (publish_frames.publish_all), and the confirms are
counted as they arrive (`process_data_events`). A negative confirm, a publish returned
unroutable (they are all mandatory) or no confirm within `timeout_s` raises PublishError.
"""

import time
from typing import Any, Sequence, Set, Tuple

from pika import spec

from gateway.broker.plumbing import wire_connection
from gateway.broker.plumbing.publish_frames import publish_all
from gateway.broker.tools.window import PublishError
from gateway.core.wire import Properties


class Confirmed:
    def __init__(self, connection: Any, timeout_s: float = 120.0) -> None:
        self.connection, self.timeout_s = connection, timeout_s
        self.channel = connection.channel()
        self.channel.add_on_return_callback(self._on_return)
        self._seq = 0
        self._open: Set[int] = set()  # sent, not confirmed
        self._error = ""
        ready: list = []
        wire_connection.confirm_delivery(self.channel._impl, self._on_confirm, callback=ready.append)
        while not ready:
            connection.process_data_events(time_limit=0.001)

    def publish(self, messages: Sequence[Tuple[str, bytes, Properties, bytes]]) -> None:
        """(exchange, routing key, properties, body) of each, mandatory, written at once
        (publish_frames.publish_all: their exact bytes)."""
        self._open.update(range(self._seq + 1, self._seq + len(messages) + 1))
        self._seq += len(messages)
        publish_all(self.channel._impl, [(x, k, body, props, True) for x, k, props, body in messages])

    def wait(self) -> None:
        """Until every publish so far is confirmed; raises PublishError if one was refused."""
        deadline = time.monotonic() + self.timeout_s
        while self._open and not self._error:
            if time.monotonic() > deadline:
                self._error = f"no confirm from the broker for {len(self._open)} publish(es) in {self.timeout_s:g} s"
            # (a confirm is no event of BlockingConnection's: it would wait out a longer limit)
            self.connection.process_data_events(time_limit=0.001)
        if self._error:
            raise PublishError(self._error)

    def _on_confirm(self, frame: Any) -> None:
        m = frame.method
        done = {s for s in self._open if s <= m.delivery_tag} if m.multiple else {m.delivery_tag}
        self._open -= done
        if isinstance(m, spec.Basic.Nack):
            self._error = self._error or "the broker refused a publish (a negative confirm): is the queue full or " \
                                         "without a leader?"

    def _on_return(self, _channel: Any, method: Any, _properties: Any, _body: bytes) -> None:
        self._error = self._error or f"exchange {method.exchange!r} routed a message to no queue ({method.reply_text})"
