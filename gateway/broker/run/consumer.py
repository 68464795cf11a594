"""One consumer of one queue: the pika shell around `core.flow.Flow`.

It consumes and acknowledges on one channel and publishes, with confirms, on another, so
that a publish the broker refuses with a channel error closes only the publishing channel:
nothing consumed goes back to its queue, nothing is delivered twice, and the channel is
opened again at once. Every decision and every piece of delivery state lives in the core;
this class turns pika's callbacks into the core's events and its actions into frames, and
keeps the one timer the core asks for.
"""

import logging
from typing import Any, Callable, Dict, List, Optional

import structlog
from pika import spec
from pika.channel import Channel
from pika.connection import Connection
from pika.exceptions import AMQPError
from prometheus_client import Counter as Count

from topology.names import Names

from gateway.broker.plumbing import lazy_properties, publish_frames, wire_connection
from gateway.broker.plumbing.amqp import login_user
from gateway.clock import steady_ms, wall_ms
from gateway.core import envelope, retries, writers
from gateway.core.actions import Forward, Publish
from gateway.core.inputs import Delivery
from gateway.core.routes import Way
from gateway.core.carrier import Batcher
from gateway.core.catch_up import CatchUp
from gateway.core.effects import Effects, Handler
from gateway.core.flow import Flow
from gateway.core.index_records import Recorder
from gateway.core.stranded import Stranded
from gateway.core.wire import Properties
from gateway.metrics import Metrics

# The records appended to the streams: signed (writers.py)
SIGNED = (Way.CANCEL, Way.INDEX)
# Channel errors that no message causes: the topology or the permissions are wrong, and
# retrying the message cannot help (the worker reports them and gives up).
NOT_THE_MESSAGE = (403, 404)


class Telemetry:
    """The core's observer: metrics and logs of one consumer."""

    def __init__(self, queue: str, metrics: Metrics, log: Any) -> None:
        self._queue, self._metrics, self._log = queue, metrics, log
        # Per-message hot path: .labels() costs a lock and a lookup; look each one up once,
        # and count an event's messages here, into the metric once per event (`flush`).
        self._counters: Dict[Way, Count] = {}
        self._counted: Dict[Way, int] = {}
        # Exposed at 0 from the start: an alert's increase() sees this consumer's first park too.
        metrics.parked.labels(queue)

    def forwarded(self, action: Publish) -> None:
        self._counted[action.way] = self._counted.get(action.way, 0) + 1
        if action.way is Way.PARKED:
            self._metrics.parked.labels(self._queue).inc()
            reason = getattr(action, "reason", None) or ""
            self._log.warning("parked", reason=reason, routing_key=envelope.readable_key(action.routing_key))
            if action.entry is not None and action.entry.exchange == "" and not reason.startswith(retries.GAVE_UP):
                # a retry that could not go back (its queue gone, refused): not delivered back
                self._metrics.retries.labels(envelope.readable_key(action.entry.routing_key), "parked").inc()

    def flush(self) -> None:
        """What `forwarded` counted, into the metrics (after each event, before its frames go)."""
        if not self._counted:
            return
        for way, n in self._counted.items():
            counter = self._counters.get(way)
            if counter is None:
                counter = self._counters[way] = self._metrics.forwarded.labels(self._queue, way.value)
            counter.inc(n)
        self._counted.clear()

    def landed(self, forward: Forward) -> None:
        if forward.way is Way.RETRIED and forward.entry is not None:
            self._metrics.retries.labels(envelope.readable_key(forward.entry.routing_key), "delivered").inc()

    def batched(self, way: Way, messages: int) -> None:
        self._metrics.batch_publishes.labels(self._queue, way.value).inc()
        self._metrics.batched_messages.labels(self._queue, way.value).inc(messages)

    def late(self, ms: int) -> None:
        self._metrics.lateness.observe(ms / 1000)

    def note(self, level: str, event: str, **fields: object) -> None:
        getattr(self._log, level)(event, **fields)


# A consumer's own acknowledgement timeout (RabbitMQ 3.11.15 and later; 3.10 ignores it and
# applies its consumer_timeout, 30 min by default): longer than any delivery a gateway holds,
# so that a broker whose consumer_timeout is shorter does not close the channel under a hold
# (and hand back, on 4.x counting toward the delivery limit, everything it held).
CONSUMER_TIMEOUT = "x-consumer-timeout"
CONSUMER_TIMEOUT_MS = 3_600_000


class Pipe:
    def __init__(self, connection: Connection, queue: str, handler: Handler, prefetch: int, metrics: Metrics,
                 names: Names, clock: Callable[[], int] = wall_ms,
                 on_fatal: Optional[Callable[[Exception], None]] = None,
                 batcher: Optional[Batcher] = None, still_wanted: Optional[Callable[[Forward], bool]] = None,
                 on_caught_up: Optional[Callable[[], None]] = None, recorder: Optional[Recorder] = None,
                 timeout_ms: Optional[int] = CONSUMER_TIMEOUT_MS, stranded: Optional[Stranded] = None,
                 catch_up: Optional[CatchUp] = None) -> None:
        self._connection, self.queue, self._prefetch, self._clock = connection, queue, prefetch, clock
        # (x-consumer-timeout: longer than anything this consumer holds; None: not asked for, on
        # a classic queue, which RabbitMQ 4.3 refuses it on and times out no consumer of)
        self._timeout_ms = timeout_ms
        # holds are timed on a steady clock (flow.Flow): the wall clock's own, unless given another
        self._steady = steady_ms if clock is wall_ms else clock
        self._cork = wire_connection.cork(connection)  # what an event makes us send goes out in one write
        self._on_fatal = on_fatal or (lambda exc: None)
        # The records it appends to the streams are signed with the user it logged in as
        # (gateway/core/writers.py: readers trust only the gateway user's).
        self._user = login_user(connection)
        self._signed: Dict[Properties, Properties] = {}
        self._log = structlog.get_logger("gateway").bind(queue=queue)
        # A debug event costs structlog's processors even when the level filters it out later.
        self._debug = logging.getLogger("gateway").isEnabledFor(logging.DEBUG)
        self._telemetry = Telemetry(queue, metrics, self._log)
        self.flow = Flow(queue, names, handler, self._telemetry, batcher, still_wanted, prefetch, recorder, stranded,
                         catch_up)
        metrics.held.labels(queue).set_function(lambda: self.flow.held)
        metrics.overdue.labels(queue).set_function(lambda: self.flow.behind)
        metrics.held_deliveries.labels(queue).set_function(lambda: self.flow.ledger.holding)
        self._consume: Optional[Channel] = None
        self._publish: Optional[Channel] = None
        self._consumer_tag: Optional[str] = None
        self._timer: object = None
        self._timer_at: Optional[int] = None
        self._on_stopped: Optional[Callable[[], None]] = None
        self.consuming = False
        # Told once this consumer has read what its queue held when it started, and the broker
        # confirmed the record of every cancel among it (session.Session: check-in, before the
        # distributor).
        self._on_caught_up = on_caught_up
        self._backlog: Optional[int] = None  # what the queue held as we started consuming
        self._read = 0

    # -- life cycle --------------------------------------------------------------------
    def open(self) -> None:
        self._connection.channel(on_open_callback=self._on_publish_open)
        self._connection.channel(on_open_callback=self._on_consume_open)

    def _on_publish_open(self, channel: Channel) -> None:
        self._publish = channel
        channel.add_on_close_callback(self._on_publish_closed)
        channel.add_on_return_callback(self._on_return)
        wire_connection.confirm_delivery(channel, self._on_confirm,
                               callback=lambda _: self._do(self.flow.publishing_opened(self._clock())))

    def _on_consume_open(self, channel: Channel) -> None:
        self._consume = channel
        channel.add_on_close_callback(self._on_consume_closed)
        channel.add_on_cancel_callback(self._on_cancelled)
        channel.basic_qos(prefetch_count=self._prefetch, callback=lambda _: self._start_consuming(channel))

    def _start_consuming(self, channel: Channel) -> None:
        # Another channel's error (a queue we may not read) can close the connection between
        # our basic.qos and its answer: consuming then is pika's error, not ours to raise.
        if not channel.is_open:
            return
        if self._on_caught_up is not None and self._backlog is None:
            channel.queue_declare(self.queue, passive=True, callback=lambda frame: self._counted(channel, frame))
            return
        self._consumer_tag = wire_connection.consume(channel, self.queue, self._on_deliveries, self._on_message,
                                                     callback=lambda _: self._consuming(),
                                                     arguments={CONSUMER_TIMEOUT: self._timeout_ms}
                                                     if self._timeout_ms else {})

    def _counted(self, channel: Channel, frame: Any) -> None:
        self._backlog = frame.method.message_count
        self._start_consuming(channel)

    def _consuming(self) -> None:
        self.consuming = True
        self.flow.consuming_started(self._clock(), self._steady())
        self._log.info("consuming", prefetch=self._prefetch)
        self._do(Effects())  # (an empty queue: caught up at once)

    def _on_cancelled(self, frame: object) -> None:
        # The broker cancelled our consumer (its queue was deleted, or its node went away, or
        # on RabbitMQ 4 a delivery was held past a consumer timeout that ignores ours): start
        # over on a fresh connection, where the worker finds out what is wrong.
        self._log.warning("consumer_cancelled_by_broker",
                          why="its queue deleted, its node gone, or (RabbitMQ 4) a delivery held longer than "
                              "the queue's consumer timeout (a policy's consumer-timeout, or x-consumer-timeout)")
        self.consuming = False
        if self._connection.is_open:
            self._connection.close()

    def _on_consume_closed(self, channel: Channel, reason: Exception) -> None:
        self.consuming = False
        self.flow.consuming_lost(self._clock())
        self._cancel_timer()
        if self._on_stopped is not None:
            return self._finish()
        if not self._connection.is_open:
            return  # the connection went first: the worker hears its reason
        # The broker closed it (the queue is missing, no permission, ...): start over on a
        # fresh connection; unacked deliveries return to their queue. The worker decides
        # from the reason whether that can help, and says it once.
        self._on_fatal(reason)
        self._connection.close()

    def _on_publish_closed(self, channel: Channel, reason: Exception) -> None:
        self._publish = None
        if self._on_stopped is not None or not self._connection.is_open or self._consume is None \
                or not self._consume.is_open:
            return self.flow.publishing_gone()
        # (a retry goes back to its queue through the default exchange: a gateway without
        # permission there refuses that message, not its whole work)
        if getattr(reason, "reply_code", 0) in NOT_THE_MESSAGE and "amq.default" not in str(reason):
            self.flow.publishing_gone()
            self._on_fatal(reason)
            self._connection.close()
            return
        # The broker refused a publish of one message (e.g. PRECONDITION_FAILED): find out
        # which one, without sending anything else back to its queue, and park it.
        # What was sent before it and not yet confirmed is sent again: what of it the broker
        # had already taken arrives twice (messages counted; docs/contract.md, Duplicates).
        publishes, messages = self.flow.unconfirmed()
        self._log.warning("publish_refused_by_broker", reason=str(reason), unconfirmed=publishes,
                          may_repeat=messages)
        self._do(self.flow.publishing_closed(str(reason), self._clock()))
        self._connection.channel(on_open_callback=self._on_publish_open)

    def stop(self, on_stopped: Callable[[], None]) -> None:
        """Stop consuming; then the core drains (see Flow.drain) and says when it is done."""
        self._on_stopped = on_stopped
        if self._consume is None or not self._consume.is_open:
            return self._finish()
        if self._consumer_tag is None:
            return self._drain()
        self._consume.basic_cancel(self._consumer_tag, callback=lambda _: self._drain())

    def _drain(self) -> None:
        self._consumer_tag = None
        self.consuming = False
        self._do(self.flow.drain(self._clock()))

    def _finish(self) -> None:
        callback, self._on_stopped = self._on_stopped, lambda: None
        if callback:
            callback()

    def waiting_for_confirm_ms(self, now_ms: int) -> int:
        return self.flow.waiting_for_confirm_ms(now_ms)

    # -- frames in -----------------------------------------------------------------------
    def _on_message(self, channel: Channel, method: spec.Basic.Deliver, properties: lazy_properties.WireProperties,
                    body: bytes) -> None:
        """A delivery pika assembled (the fast path hands the others to `_on_deliveries`)."""
        self._read += 1
        d = Delivery(method.exchange, envelope.as_bytes(method.routing_key), properties.wire, body, method.redelivered)
        self._do(self.flow.delivered(method.delivery_tag, d, self._clock(), self._steady()))

    def _on_deliveries(self, raw: List[wire_connection.RawDelivery]) -> None:
        """The deliveries of one read, in order: one event of the core, one write of what it says."""
        self._read += len(raw)
        deliveries = [(tag, Delivery(exchange, routing_key, props, body, redelivered))
                      for tag, redelivered, exchange, routing_key, props, body in raw]
        self._do(self.flow.delivered_all(deliveries, self._clock(), self._steady()))

    def _on_return(self, channel: Channel, method: spec.Basic.Return, properties: lazy_properties.WireProperties,
                   body: bytes) -> None:
        self.flow.returned(envelope.as_bytes(method.routing_key), properties.wire.raw, body)

    def _on_confirm(self, frame: Any) -> None:
        method = frame.method
        self._do(self.flow.confirmed(method.delivery_tag, method.multiple, isinstance(method, spec.Basic.Ack),
                                     self._clock()))

    def _on_synced(self, frame: object) -> None:
        self._do(self.flow.synced(self._clock()))

    def _on_timer(self) -> None:
        self._timer = self._timer_at = None
        # A closing connection hands every delivery back: nothing is left worth sending.
        if self._connection.is_open:
            self._do(self.flow.tick(self._clock(), self._steady()))

    # -- frames out ----------------------------------------------------------------------
    def _do(self, actions: Effects) -> None:
        self._telemetry.flush()
        with self._cork:
            self._act(actions)
        self._schedule()
        if self._on_caught_up is not None and self._backlog is not None and self._read >= self._backlog \
                and not self.flow.unsettled_fences:
            told, self._on_caught_up = self._on_caught_up, None
            told()

    def _act(self, actions: Effects) -> None:
        if actions.publish and self._publish is not None:
            self._send(self._publish, actions)
        if self._consume is not None and self._consume.is_open:
            # Rejections first: a `multiple` ack after them covers only what is done (the core
            # no longer counts a delivery it gave up; sent before, the ack would cover it).
            for tag in actions.reject:
                self._consume.basic_nack(tag, requeue=False)
            for tag, multiple in actions.ack:
                self._consume.basic_ack(tag, multiple=multiple)
            if actions.sync:  # the same prefetch again: only the answer matters
                self._consume.basic_qos(prefetch_count=self._prefetch, callback=self._on_synced)
        if actions.reconnect and self._connection.is_open:
            self._connection.close()
        if actions.finished:
            self._finish()

    def _send(self, channel: Channel, actions: Effects) -> None:
        forwards = [pub.payload.forward for pub in actions.publish]
        try:
            publish_frames.publish_all(channel, [
                (f.exchange, f.routing_key, f.body, self._signed_props(f.props) if f.way in SIGNED else f.props,
                 f.mandatory) for f in forwards])
        except AMQPError as exc:  # the channel is going away; its close callback takes over
            self._log.warning("publish_failed", error=str(exc))
            return
        if self._debug:
            for f in forwards:
                self._log.debug(f.way.value, exchange=f.exchange, routing_key=envelope.readable_key(f.routing_key))

    def _signed_props(self, props: Properties) -> Properties:
        """A record's properties with the gateway's user_id (the index's records share one
        set of properties: signed once)."""
        if self._user is None:
            return props
        found = self._signed.get(props)
        if found is None:
            found = writers.signed(props, self._user)
            if len(self._signed) < 16:  # (the index's few; a cancel's are its own)
                self._signed[props] = found
        return found

    def _schedule(self) -> None:
        at = self.flow.next_wake()
        if at == self._timer_at:
            return
        self._cancel_timer()
        if at is not None:
            self._timer_at = at
            self._timer = self._connection.ioloop.call_later(max(0, at - self._clock()) / 1000, self._on_timer)

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._connection.ioloop.remove_timeout(self._timer)
        self._timer = self._timer_at = None
