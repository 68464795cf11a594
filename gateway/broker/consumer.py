"""One consumer of one queue: the pika side of `deliveries.Deliveries`.

It consumes and acknowledges on one channel and publishes, with confirms, on another, so
that a publish the broker refuses with a channel error closes only the publishing channel:
nothing consumed goes back to its queue, nothing is delivered twice, and the channel is
opened again at once. Everything about which delivery may be acknowledged when lives in
`Deliveries`; batching into carriers in `carrier.Batcher`; this class turns pika's
callbacks into their events and their answers into frames.
"""

import logging
from collections import Counter
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import structlog
from pika import spec
from pika.exceptions import AMQPError

from gateway.broker import codec
from gateway.core import envelope, handlers
from gateway.core.actions import Action, Delivery, Enqueue, Forward
from gateway.core.carrier import Batch, Batcher, Entry, Holds
from gateway.clock import wall_ms
from gateway.core.deliveries import Deliveries, Outcome, Publication
from gateway.metrics import Metrics

Handler = Callable[[Delivery], List[Action]]
ACK_FLUSH_S = 0.005
ACK_BATCH = 500
# A publish the broker refuses (basic.nack: a quorum queue without a leader during a
# failover) is retried after this long while we keep the delivery. Requeueing it instead
# would spin: each requeue counts against the queue's delivery limit, which a failover of a
# few seconds exhausts, and the message would be parked for nothing.
RETRY_REFUSED_S = 1.0
# After this many refusals of one message, start over on a new connection: in a cluster
# failover a channel opened while a quorum queue's leader was moving can keep being refused
# while a fresh channel is accepted (seen on 3.10.8 with a 3-node cluster).
REFUSED_RECONNECT = 3
# Channel errors that no message causes: the topology or the permissions are wrong, and
# retrying the message cannot help (the worker reports them and gives up).
NOT_THE_MESSAGE = (403, 404)

Member = Tuple[int, Optional[Entry]]  # a delivery tag, and the publisher's message if it is one


@dataclass
class Out:
    """What one publication is: the frame to send, and whose messages it holds."""

    forward: Forward
    members: Sequence[Member]


class Pipe:
    def __init__(self, connection, queue: str, handler: Handler, prefetch: int, metrics: Metrics,
                 names, clock: Callable[[], int] = wall_ms,
                 on_fatal: Optional[Callable[[Exception], None]] = None,
                 batcher: Optional[Batcher] = None) -> None:
        self._connection, self._queue, self._handler = connection, queue, handler
        self._prefetch, self._metrics, self._clock, self._names = prefetch, metrics, clock, names
        self._on_fatal = on_fatal or (lambda exc: None)
        self._batcher = batcher if batcher is not None else Batcher(1, 1, 0)  # (an empty one is falsy)
        self._log = structlog.get_logger("gateway").bind(queue=queue)
        # Per-message hot path: a debug event costs structlog's processors even when the
        # level filters it out later, and .labels() a lock and a lookup; decide/look up once.
        self._debug = logging.getLogger("gateway").isEnabledFor(logging.DEBUG)
        self._counters: Dict[str, object] = {}
        self._held_gauge = metrics.held.labels(queue)
        self._state = Deliveries()
        self._delivered: Dict[int, Delivery] = {}  # outstanding deliveries (to park them)
        self._left: Counter = Counter()  # tag -> its messages not yet in a sent publication
        self._holds = Holds()  # (tag, n) -> the Forward to release at its due time
        self._hold_timer = None
        self._hold_timer_at: Optional[int] = None
        self._batch_timer = None
        self._consume = None
        self._publish = None
        self._refusal = "?"
        self._consumer_tag: Optional[str] = None
        self._flush_timer = None
        self._on_stopped: Optional[Callable[[], None]] = None
        self.consuming = False

    # -- life cycle --------------------------------------------------------------------
    def open(self) -> None:
        self._connection.channel(on_open_callback=self._on_publish_open)
        self._connection.channel(on_open_callback=self._on_consume_open)

    def _on_publish_open(self, channel) -> None:
        self._publish = channel
        channel.add_on_close_callback(self._on_publish_closed)
        channel.add_on_return_callback(self._on_return)
        channel.confirm_delivery(self._on_confirm, callback=lambda _: self._do(self._state.channel_open()))

    def _on_consume_open(self, channel) -> None:
        self._consume = channel
        channel.add_on_close_callback(self._on_consume_closed)
        channel.add_on_cancel_callback(self._on_cancelled)
        channel.basic_qos(prefetch_count=self._prefetch, callback=lambda _: self._start_consuming())

    def _start_consuming(self) -> None:
        # Another channel's error (a queue we may not read) can close the connection between
        # our basic.qos and its answer: consuming then is pika's error, not ours to raise.
        if not self._consume.is_open:
            return
        self._consumer_tag = self._consume.basic_consume(
            self._queue, self._on_message, callback=lambda _: self._consuming())

    def _consuming(self) -> None:
        self.consuming = True
        self._log.info("consuming", prefetch=self._prefetch)

    def _on_cancelled(self, frame) -> None:
        # The broker cancelled our consumer (its queue was deleted, or its node went away):
        # start over on a fresh connection, where the worker finds out what is wrong.
        self._log.warning("consumer_cancelled_by_broker")
        self.consuming = False
        if self._connection.is_open:
            self._connection.close()

    def _on_consume_closed(self, channel, reason) -> None:
        self.consuming = False
        self._forget()
        if self._on_stopped is not None:
            return self._finish()
        if not self._connection.is_open:
            return  # the connection went first: the worker hears its reason
        # The broker closed it (the queue is missing, no permission, ...): start over on a
        # fresh connection; unacked deliveries return to their queue. The worker decides
        # from the reason whether that can help, and says it once.
        self._on_fatal(reason)
        self._connection.close()

    def _on_publish_closed(self, channel, reason) -> None:
        self._publish = None
        if self._on_stopped is not None or not self._connection.is_open or self._consume is None \
                or not self._consume.is_open:
            return
        code = getattr(reason, "reply_code", 0)
        if code in NOT_THE_MESSAGE:
            self._on_fatal(reason)
            self._connection.close()
            return
        # The broker refused a publish of one message (e.g. PRECONDITION_FAILED): find out
        # which one, without sending anything else back to its queue, and park it.
        self._log.warning("publish_refused_by_broker", reason=str(reason), unconfirmed=self._state.unconfirmed)
        self._refusal = str(reason)
        self._do(self._state.channel_closed())
        self._connection.channel(on_open_callback=self._on_publish_open)

    def stop(self, on_stopped: Callable[[], None]) -> None:
        """Stop consuming; send on what waits in batches; hand held messages back to the
        distributor queue (for another gateway); wait for outstanding confirms."""
        self._on_stopped = on_stopped
        if self._consume is None or not self._consume.is_open:
            return self._finish()
        if self._consumer_tag is None:
            return self._drain()
        self._consume.basic_cancel(self._consumer_tag, callback=lambda _: self._drain())

    def _drain(self) -> None:
        self._consumer_tag = None
        self.consuming = False
        for batch in self._batcher.drain():
            self._flush_batch(batch)
        # A held message is due within a unit or so: it goes back into the distributor
        # queue, where another gateway (or this one, restarted) holds it until due. Handing
        # back the delivery instead would repeat those of a carrier already published.
        self._cancel_hold_timer()
        held = self._holds.drain()
        for (tag, _), release in held:
            self._state.release(tag)
            e = release.entry
            self._send([tag], Forward(self._names.distributor, b"", envelope.inside(e.user, e.routing_key, e.due_ms),
                                      e.body, "handed back", entry=e), [(tag, e)])
        self._held_gauge.set(self._state.held)
        self._log.info("stopping", returned=len(held), unconfirmed=self._state.unconfirmed)
        self._maybe_finished()

    def _maybe_finished(self) -> None:
        if self._on_stopped is not None and self._consumer_tag is None and not self._state.unconfirmed:
            self._flush()
            self._finish()

    def _finish(self) -> None:
        callback, self._on_stopped = self._on_stopped, lambda: None
        if callback:
            callback()

    def _forget(self) -> None:
        self._state.lost()
        self._cancel_hold_timer()
        self._holds.drain()
        self._batcher.drain()
        self._delivered.clear()
        self._left.clear()
        self._held_gauge.set(0)

    # -- messages ----------------------------------------------------------------------
    def _on_message(self, channel, method, properties, body) -> None:
        self._release_due()  # a stream of deliveries must not keep due messages waiting
        tag = method.delivery_tag
        d = Delivery(method.exchange, envelope.as_bytes(method.routing_key), properties.wire, body,
                     method.redelivered)
        self._state.received(tag)
        self._delivered[tag] = d
        try:
            actions = self._handler(d)
        except Exception as exc:  # a bug must not stop the gateway, nor lose the message
            self._log.exception("handler_failed", routing_key=method.routing_key)
            reason = f"the gateway failed on it: {exc!r}"
            actions = [handlers.park(self._names, d.props, d.routing_key, d.body, reason)] \
                if self._queue == self._names.check_in else handlers.park_delivery(self._names, d, reason)
        self._left[tag] = len(actions)
        if not actions:
            self._state.finish(tag)
        now = self._clock()
        for n, action in enumerate(actions):
            self._count(action)
            if isinstance(action, Enqueue):
                for batch in self._batcher.add((action.exchange, action.routing_key, action.outcome), tag,
                                               action.entry, now):
                    self._flush_batch(batch)
            elif action.not_before_ms is not None and action.not_before_ms > now:
                self._state.hold(tag)
                self._holds.add(action.not_before_ms, (tag, n), action)
            else:
                self._send([tag], action, [(tag, action.entry)])
        self._held_gauge.set(self._state.held)
        self._schedule_holds()
        self._schedule_batches()

    def _count(self, action: Action) -> None:
        counter = self._counters.get(action.outcome)
        if counter is None:
            counter = self._counters[action.outcome] = self._metrics.forwarded.labels(self._queue, action.outcome)
        counter.inc()
        if action.outcome == "parked":
            self._metrics.parked.labels(self._queue).inc()
            self._log.warning("parked", reason=action.reason, routing_key=envelope.shown(action.routing_key))

    def _release_due(self) -> None:
        """Publish every held message whose time has come, in due order."""
        released = self._holds.due(self._clock()) if self._holds.next_due() is not None else ()
        for (tag, _), action in released:
            if self._state.release(tag):
                self._send([tag], action, [(tag, action.entry)])
        if released:
            self._held_gauge.set(self._state.held)

    def _schedule_holds(self) -> None:
        due = self._holds.next_due()
        if due is None or due == self._hold_timer_at:
            return
        self._cancel_hold_timer()
        self._hold_timer_at = due
        self._hold_timer = self._connection.ioloop.call_later(max(0, due - self._clock()) / 1000, self._holds_due)

    def _cancel_hold_timer(self) -> None:
        if self._hold_timer is not None:
            self._connection.ioloop.remove_timeout(self._hold_timer)
        self._hold_timer = self._hold_timer_at = None

    def _holds_due(self) -> None:
        self._hold_timer = self._hold_timer_at = None
        self._release_due()
        self._schedule_holds()

    def _schedule_batches(self) -> None:
        deadline = self._batcher.next_deadline()
        if deadline is None or self._batch_timer is not None:
            return
        self._batch_timer = self._connection.ioloop.call_later(
            max(0, deadline - self._clock()) / 1000, self._batches_due)

    def _batches_due(self) -> None:
        self._batch_timer = None
        for batch in self._batcher.expired(self._clock()):
            self._flush_batch(batch)
        self._schedule_batches()

    def _flush_batch(self, batch: Batch) -> None:
        exchange, key, outcome = batch.key
        self._metrics.batch_publishes.labels(self._queue, outcome).inc()
        self._metrics.batched_messages.labels(self._queue, outcome).inc(len(batch.items))
        self._send([tag for tag, _ in batch.items],
                   handlers.carry(exchange, key, outcome, [e for _, e in batch.items]), batch.items)

    def _send(self, tags: List[int], forward: Forward, members: Sequence[Member]) -> None:
        """Publish `forward` for the messages of these deliveries (one tag per message)."""
        if forward.not_before_ms is not None:
            self._metrics.lateness.observe(max(0, self._clock() - forward.not_before_ms) / 1000)
        finishing = []
        for tag, n in Counter(tags).items():
            self._left[tag] -= n
            if self._left[tag] <= 0:
                del self._left[tag]
                finishing.append(tag)
        self._do(self._state.publish(tuple(dict.fromkeys(tags)), Out(forward, members), finishing,
                                     parking=forward.outcome == "parked"))

    def waiting_for_confirm_ms(self, now_ms: int) -> int:
        """How long the oldest publish not yet confirmed has been waiting (0: none)."""
        pub = self._state.oldest_unconfirmed()
        return now_ms - pub.sent_ms if pub is not None else 0

    def _do(self, outcome: Outcome) -> None:
        if outcome.send and self._publish is None:
            return  # the publishing channel is gone; its close callback has taken over
        now = self._clock() if outcome.send else 0
        for pub in outcome.send:
            pub.sent_ms = now
            f: Forward = pub.payload.forward
            try:
                self._publish.basic_publish(f.exchange, f.routing_key, f.body, codec.RawProperties(f.props),
                                            mandatory=f.mandatory)
            except AMQPError as exc:  # the channel is going away; its close callback takes over
                self._log.warning("publish_failed", error=str(exc))
                return
            if self._debug:
                self._log.debug(f.outcome, exchange=f.exchange, routing_key=envelope.shown(f.routing_key))
        for pub in outcome.refused:
            self._refused(pub)
        for pub in outcome.returned:
            self._park(pub, lambda e: self._handler.unroutable(e))
        for pub in outcome.guilty:
            reason = f"the broker refused to take it: {self._refusal}"
            self._park(pub, lambda e: handlers.park_entry(self._names, e, reason), reason)
        for tag in outcome.reject:
            self._log.error("rejected_to_dead_letter", delivery_tag=tag)
            self._delivered.pop(tag, None)
            self._consume.basic_nack(tag, requeue=False)

    def _park(self, pub: Publication, parked: Callable[[Entry], Forward], reason: str = "") -> None:
        """Publish a parked copy of each message of a publication that cannot go on."""
        for tag, entry in pub.payload.members:
            if tag not in self._state:
                continue
            if entry is not None:
                copies = [parked(entry)]
            else:  # not a publisher's message of its own: park the delivery it came from
                d = self._delivered[tag]
                copies = [handlers.park(self._names, d.props, d.routing_key, d.body, reason)] \
                    if self._queue == self._names.check_in else handlers.park_delivery(self._names, d, reason)
            for copy in copies:
                self._count(copy)
                self._do(self._state.publish((tag,), Out(copy, [(tag, copy.entry)]), (), parking=True))

    def _refused(self, pub: Publication) -> None:
        if pub.refused > REFUSED_RECONNECT:
            self._log.error("broker_keeps_refusing", refusals=pub.refused)
            if self._connection.is_open:
                self._connection.close()
            return
        self._log.warning("publish_nacked_by_broker", after_s=RETRY_REFUSED_S)
        self._connection.ioloop.call_later(RETRY_REFUSED_S, lambda: self._retry(pub))

    def _retry(self, pub: Publication) -> None:
        # The connection may have gone meanwhile (a node stopping nacks, then closes): the
        # broker then redelivers the deliveries, and this consumer is done with.
        if self._connection.is_open:
            self._do(self._state.retry(pub))

    def _on_return(self, channel, method, properties, body) -> None:
        key = envelope.as_bytes(method.routing_key)
        for pub in self._state.inflight():
            f: Forward = pub.payload.forward
            if f.mandatory and f.routing_key == key and f.body == body and f.props.raw == properties.wire.raw:
                self._state.returned(pub.seq)
                return
        self._log.error("unmatched_return", routing_key=method.routing_key)

    def _on_confirm(self, frame) -> None:
        method = frame.method
        outcome = self._state.confirmed(method.delivery_tag, method.multiple, isinstance(method, spec.Basic.Ack))
        self._do(outcome)
        self._schedule_flush()
        self._maybe_finished()

    def _schedule_flush(self) -> None:
        if self._state.done_count >= ACK_BATCH:
            self._flush()
        elif self._flush_timer is None and self._state.done_count:
            self._flush_timer = self._connection.ioloop.call_later(ACK_FLUSH_S, self._flush)

    def _flush(self) -> None:
        if self._flush_timer is not None:
            self._connection.ioloop.remove_timeout(self._flush_timer)
            self._flush_timer = None
        if self._consume is None or not self._consume.is_open:
            return
        last, singles, gone = self._state.acks()
        if last is not None:
            self._consume.basic_ack(last, multiple=True)
        for tag in singles:
            self._consume.basic_ack(tag)
        for tag in gone:
            self._delivered.pop(tag, None)
