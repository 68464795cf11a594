"""One channel that consumes a queue and forwards each message with publisher confirms.

A delivery is acknowledged only after the broker has confirmed the message it became, so
at every moment each message is owned by a queue: a crash or a lost connection means
redelivery (a possible duplicate), never a loss. Confirms arrive asynchronously and acks go
out in batches, so throughput is not bound by round trips.
"""

import logging
import struct
import time
from typing import Callable, Dict, Optional, Set

import structlog
from pika import spec
from pika.exceptions import AMQPError, ProtocolSyntaxError

from .actions import Delivery, Forward
from .metrics import Metrics

Handler = Callable[[Delivery], Forward]
ACK_FLUSH_S = 0.005
ACK_BATCH = 500
# A publish the broker refuses (basic.nack: a quorum queue without a leader during a
# failover, a full queue) is retried after this long while we keep the delivery. Requeueing
# it instead would spin: each requeue counts against the queue's delivery limit, which a
# failover of a few seconds exhausts, and the message would be parked for nothing.
RETRY_REFUSED_S = 1.0
# After this many refusals of one message, start over on a new connection: in a cluster
# failover a channel opened while a quorum queue's leader was moving can keep being refused
# while a fresh channel is accepted (seen on 3.10.8 with a 3-node cluster).
REFUSED_RECONNECT = 3


def wall_ms() -> int:
    return time.time_ns() // 1_000_000


class Pipe:
    def __init__(self, connection, queue: str, handler: Handler, prefetch: int,
                 metrics: Metrics, clock: Callable[[], int] = wall_ms,
                 fallback: Optional[Callable[[Forward], Forward]] = None) -> None:
        self._connection, self._queue, self._handler = connection, queue, handler
        self._fallback = fallback  # what to publish instead when a Forward cannot be encoded
        self._prefetch, self._metrics, self._clock = prefetch, metrics, clock
        self._log = structlog.get_logger("gateway").bind(queue=queue)
        # Per-message hot path: a debug event costs structlog's processors even when the
        # level filters it out later, and .labels() a lock and a lookup; decide/lookup once.
        self._debug = logging.getLogger("gateway").isEnabledFor(logging.DEBUG)
        self._forwarded: Dict[str, object] = {}
        self._channel = None
        self._consumer_tag: Optional[str] = None
        self._seq = 0
        self._unconfirmed: Dict[int, int] = {}  # publish sequence number -> delivery tag
        self._outstanding: Dict[int, None] = {}  # delivery tags not yet acked, in order
        self._done: Set[int] = set()  # outstanding tags whose forward is confirmed
        self._held: Dict[int, object] = {}  # delivery tag -> timer that publishes it
        self._forwards: Dict[int, Forward] = {}  # delivery tag -> what it became, until confirmed
        self._refused: Dict[int, int] = {}  # delivery tag -> how often its publish was refused
        self._flush_timer = None
        self._on_stopped: Optional[Callable[[], None]] = None

    # -- life cycle --------------------------------------------------------------------
    def open(self) -> None:
        self._connection.channel(on_open_callback=self._on_channel_open)

    def _on_channel_open(self, channel) -> None:
        self._channel = channel
        channel.add_on_close_callback(self._on_channel_closed)
        channel.confirm_delivery(self._on_confirm, callback=lambda _: channel.basic_qos(
            prefetch_count=self._prefetch, callback=lambda _: self._consume()))

    def _consume(self) -> None:
        self._consumer_tag = self._channel.basic_consume(self._queue, self._on_message)
        self._log.info("consuming", prefetch=self._prefetch)

    def _on_channel_closed(self, channel, reason) -> None:
        for timer in self._held.values():
            self._connection.ioloop.remove_timeout(timer)
        self._held.clear()
        if self._on_stopped is None:
            # The broker closed the channel (a protocol error): start over on a fresh
            # connection; unacked deliveries return to their queue.
            self._log.error("channel closed", reason=str(reason))
            if self._connection.is_open:
                self._connection.close()
        else:
            self._finish()

    def stop(self, on_stopped: Callable[[], None]) -> None:
        """Stop consuming, return held messages, wait for outstanding confirms."""
        self._on_stopped = on_stopped
        if self._channel is None or not self._channel.is_open:
            return self._finish()
        if self._consumer_tag is None:
            return self._drain()
        self._channel.basic_cancel(self._consumer_tag, callback=lambda _: self._drain())

    def _drain(self) -> None:
        self._consumer_tag = None
        for tag, timer in list(self._held.items()):
            self._connection.ioloop.remove_timeout(timer)
            self._channel.basic_nack(tag, requeue=True)
            self._outstanding.pop(tag, None)
        self._log.info("stopping", returned=len(self._held), unconfirmed=len(self._unconfirmed))
        self._held.clear()
        self._metrics.held.set(0)
        self._maybe_finished()

    def _maybe_finished(self) -> None:
        if self._on_stopped is not None and self._consumer_tag is None and not self._unconfirmed:
            self._flush()
            self._finish()

    def _finish(self) -> None:
        callback, self._on_stopped = self._on_stopped, lambda: None
        if callback:
            callback()

    # -- messages ----------------------------------------------------------------------
    def _on_message(self, channel, method, properties, body) -> None:
        tag = method.delivery_tag
        self._outstanding[tag] = None
        d = Delivery(method.exchange, method.routing_key, properties, body, method.redelivered)
        try:
            action = self._handler(d)
        except Exception:  # a bug must not stop the gateway: the message is parked by the broker
            self._log.exception("handler failed; rejecting to parking", routing_key=method.routing_key)
            self._outstanding.pop(tag, None)
            channel.basic_nack(tag, requeue=False)
            return
        counter = self._forwarded.get(action.outcome)
        if counter is None:
            counter = self._forwarded[action.outcome] = self._metrics.forwarded.labels(self._queue, action.outcome)
        counter.inc()
        if action.outcome == "parked":
            self._metrics.parked.labels(self._queue).inc()
            self._log.warning("parked", reason=action.reason, routing_key=action.routing_key,
                              message_id=properties.message_id)
        wait_ms = (action.not_before_ms - self._clock()) if action.not_before_ms else 0
        if wait_ms > 0:
            self._held[tag] = self._connection.ioloop.call_later(
                wait_ms / 1000, lambda: self._release(tag, action))
            self._metrics.held.inc()
        else:
            self._publish(tag, action)

    def _release(self, tag: int, action: Forward) -> None:
        if self._held.pop(tag, None) is not None:
            self._metrics.held.dec()
            self._publish(tag, action)

    def _publish(self, tag: int, action: Forward) -> None:
        if action.not_before_ms is not None:
            self._metrics.lateness.observe(max(0, self._clock() - action.not_before_ms) / 1000)
        try:
            self._channel.basic_publish(action.exchange, action.routing_key, action.body,
                                        action.properties)
        except (ProtocolSyntaxError, struct.error, TypeError, ValueError) as exc:
            # Its properties cannot be written back (a value pika decodes but cannot
            # encode). Checked here, on failure, rather than for every message up front.
            if self._fallback is not None and action.outcome != "parked":
                parked = self._fallback(action)
                self._metrics.parked.labels(self._queue).inc()
                self._log.warning("parked", reason=parked.reason, routing_key=parked.routing_key)
                return self._publish(tag, parked)
            # Parking failed too: reject it, and the broker dead-letters it to parking and
            # on to parked without anyone re-encoding it.
            self._log.error("cannot re-encode message; rejecting to parking", error=repr(exc))
            self._outstanding.pop(tag, None)
            self._channel.basic_nack(tag, requeue=False)
            return
        except AMQPError as exc:  # channel gone: the delivery comes back on reconnect
            self._log.warning("publish failed", error=str(exc))
            return
        self._seq += 1
        self._unconfirmed[self._seq] = tag
        self._forwards[tag] = action
        if self._debug:
            self._log.debug(action.outcome, exchange=action.exchange, routing_key=action.routing_key)

    def _on_confirm(self, frame) -> None:
        method = frame.method
        if method.multiple:
            tags = []
            while self._unconfirmed:
                seq = next(iter(self._unconfirmed))
                if seq > method.delivery_tag:
                    break
                tags.append(self._unconfirmed.pop(seq))
        else:
            tags = [self._unconfirmed.pop(method.delivery_tag)]
        forwards = [self._forwards.pop(tag, None) for tag in tags]
        if isinstance(method, spec.Basic.Ack):
            for tag in tags:
                self._refused.pop(tag, None)
            self._done.update(tags)
            if len(self._done) >= ACK_BATCH:
                self._flush()
            elif self._flush_timer is None:
                self._flush_timer = self._connection.ioloop.call_later(ACK_FLUSH_S, self._flush)
        else:  # the broker could not take it (e.g. no quorum leader yet): try again later
            self._log.warning("publish refused by broker; retrying", count=len(tags), after_s=RETRY_REFUSED_S)
            for tag in tags:
                self._refused[tag] = self._refused.get(tag, 0) + 1
            if max(self._refused[tag] for tag in tags) > REFUSED_RECONNECT and self._connection.is_open:
                self._log.error("broker keeps refusing; reconnecting (unacked messages are redelivered)")
                self._connection.close()
                return
            for tag, action in zip(tags, forwards):
                self._held[tag] = self._connection.ioloop.call_later(
                    RETRY_REFUSED_S, lambda tag=tag, action=action: self._release(tag, action))
                self._metrics.held.inc()
        self._maybe_finished()

    def _flush(self) -> None:
        if self._flush_timer is not None:
            self._connection.ioloop.remove_timeout(self._flush_timer)
            self._flush_timer = None
        if not self._done or self._channel is None or not self._channel.is_open:
            return
        last = None
        while self._outstanding:
            tag = next(iter(self._outstanding))
            if tag not in self._done:
                break
            del self._outstanding[tag]
            self._done.discard(tag)
            last = tag
        if last is not None:
            self._channel.basic_ack(last, multiple=True)
        for tag in self._done:  # confirmed behind a message still held or in flight
            del self._outstanding[tag]
            self._channel.basic_ack(tag)
        self._done.clear()
