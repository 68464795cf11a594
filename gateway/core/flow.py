"""One consumer's core (pure): every decision about its deliveries, and all their state.

The pika adapter (broker.run.consumer.Pipe) turns frames into the events below and does what
the returned `Effects` say, nothing more. The core keeps:

- the outstanding deliveries and the publishes they became (`Deliveries`, with the
  publishing channel's confirm window inside it): what may be acknowledged when;
- each outstanding delivery as it arrived, to park it whole if what it became cannot go on;
- per delivery, how many of its messages are not yet in a sent publish;
- the held messages (inside `Deliveries` too), released at their due time: `held` is their
  count, the one the held-messages gauge reads;
- the open batches (`Batcher`), closed by count, bytes or age;
- the fences waiting for their turn (a cancel's record: published once every delivery
  before it is acknowledged and the broker has taken those acks, so that a crash at any
  moment hands back, in their first order, the messages and the cancels a crash undid);
- when acknowledgements are due; the refused publishes (basic.nack) waiting to be retried,
  and why the broker last closed the publishing channel.

The broker's answers to its publishes: sends go out in order; a refused publish is retried
later, or after too many refusals the connection starts over; a returned one (unroutable)
and the one the broker closed the channel over are parked instead; a delivery whose parked
copy is refused too is given up (the broker dead-letters it).

Time comes in with each event (epoch ms); `next_wake()` says when the core wants a `tick`.
"""

from collections import Counter, deque
from typing import Callable, Deque, Dict, List, Optional, Sequence, Tuple

from topology.names import Names
from topology.index_bands import DONE

from gateway.core import envelope, handlers, index_records
from gateway.core.actions import Drop, Enqueue, Forward
from gateway.core.inputs import Delivery
from gateway.core.routes import LEAVES, STAYS, Way
from gateway.core.effects import Effects, Handler, Member, Observer, Payload, Sent
from gateway.core.carrier import Batch, Batcher, Entry
from gateway.core.catch_up import CatchUp
from gateway.core.deliveries import Deliveries, Outcome
from gateway.core.stranded import Stranded
from gateway.core.wire import Properties

RECORD = Properties.build(delivery_mode=2)  # a record of what waits (streams keep everything anyway)
ACK_FLUSH_MS = 5  # acknowledgements wait this long for others to share one frame
ACK_BATCH = 500  # ... or until this many are due
# A publish the broker refuses (basic.nack: a quorum queue without a leader during a
# failover) is retried after this long while we keep the delivery. Requeueing it instead
# would spin: each requeue counts against the queue's delivery limit, which a failover of a
# few seconds exhausts, and the message would be parked for nothing.
RETRY_REFUSED_MS = 1000
# After this many refusals of one message, start over on a new connection: in a cluster
# failover a channel opened while a quorum queue's leader was moving can keep being refused
# while a fresh channel is accepted (seen on 3.10.8 with a 3-node cluster).
REFUSED_RECONNECT = 3
# What goes to the distributor to be held travels in carriers of messages due within the same
# second: the distributor acknowledges a carrier once its last message is released, and after
# its crash the broker hands the whole carrier back, to be released again: so what one crash
# can repeat is about a second of releases and what was in flight, not what was held.
HOLD_BUCKET_MS = 1000
# Open batches close once they hold this share of the prefetch: the broker goes on
# delivering the rest of it while their publishes wait for confirms, so a consumer reading a
# backlog is not stopped at every full prefetch until the last confirm (bench `roles`).
WINDOW_SHARE = 0.5
# The member tag of a release from memory (stranded.Stranded): no delivery waits for it.
STRANDED = -1


class Flow:
    """The core of one consumer (see the module doc): events in, `Effects` out."""

    def __init__(self, queue: str, names: Names, handler: Handler, observer: Observer,
                 batcher: Optional[Batcher] = None, still_wanted: Optional[Callable[[Forward], bool]] = None,
                 prefetch: int = 0, recorder: Optional[index_records.Recorder] = None,
                 stranded: Optional[Stranded] = None, catch_up: Optional[CatchUp] = None) -> None:
        self._names, self._handler, self._observer = names, handler, observer
        # overdue releases paced (catch_up.py; None: released as they come, the default)
        self._catch_up = catch_up
        # what the process held when a channel of this queue was lost (None: it holds nothing)
        self._stranded = stranded
        self._recorder = recorder  # the index of what waits (None: not kept)
        self._refused_records = 0
        # With this many deliveries outstanding the broker sends no more until we acknowledge
        # some: open batches then close at once, as no message can join them (0: no limit).
        self._prefetch = prefetch
        # asked again as a held message is released: False drops it (it was cancelled)
        self._still_wanted = still_wanted
        self._park = handlers.parker(names, queue)
        self._batcher = batcher if batcher is not None else Batcher(1, 1, 0)  # (an empty one is falsy)
        self.ledger: Deliveries[Payload, Forward] = Deliveries()
        self._delivered: Dict[int, Delivery] = {}  # outstanding deliveries (to park them whole)
        self._unsent: Dict[int, int] = {}  # tag -> its messages not yet in a sent publication
        self._flush_at: Optional[int] = None
        self._fenced: Deque[Tuple[int, Forward]] = deque()  # fences not yet published, in order
        self._syncing = False  # a sync is under way
        self._acked_since_sync: Optional[int] = None  # the lowest tag acknowledged after it was asked for
        self._draining = False
        self._retries: List[Tuple[int, Sent]] = []  # (when, a refused publication)
        self._refusal = "?"  # why the broker last closed the publishing channel
        self._done_sent_ms = 0  # when the last record of done keys went out
        # The wall clock less a steady one (clock.steady_ms), as of the last event that told
        # both: held messages are timed on the steady clock (their wall due time less this, as
        # of when they were held), so no step of the wall clock after a message was held
        # releases it earlier; and never before their wall due time either.
        self._step = 0

    @property
    def held(self) -> int:
        """Messages held until their time (the held-messages gauge)."""
        return self.ledger.held

    @property
    def reading(self) -> int:
        """Deliveries with messages read and not yet in a sent publish (waiting for company in
        a carrier, or behind a fence): no entry of the index lists them yet. (One `len`: other
        threads ask.)"""
        return len(self._unsent)

    @property
    def unsettled_fences(self) -> int:
        """Cancels read and not yet acknowledged (their records not all confirmed)."""
        return self.ledger.fences

    def unconfirmed(self) -> Tuple[int, int]:
        """(publishes sent and not yet confirmed, the messages in them)."""
        inflight = self.ledger.inflight()
        return len(inflight), sum(len(pub.payload.members) for pub in inflight)

    def waiting_for_confirm_ms(self, now: int) -> int:
        """How long the oldest publish not yet confirmed has waited (0: none)."""
        return self.ledger.waiting_for_confirm_ms(now)

    @property
    def behind(self) -> int:
        """Overdue messages waiting for the catch-up's pace (the overdue gauge)."""
        return self.ledger.behind

    def held_due(self, behind: bool = True) -> Optional[int]:
        """When the first held message is due (epoch ms, by the wall clock), if any (`behind`:
        counting the overdue ones that wait for the catch-up's pace)."""
        due = self.ledger.first_due() if behind else self.ledger.next_due()
        stranded = self._stranded.next_due(self._step) if self._stranded else None
        if stranded is not None and (due is None or stranded < due):
            due = stranded
        return None if due is None else due + self._step

    def _steady(self, now: int, steady: Optional[int]) -> None:
        """An event told the steady clock beside the wall clock (None: they are one)."""
        if steady is not None:
            self._step = now - steady

    def next_wake(self) -> Optional[int]:
        """When the next `tick` is due (epoch ms), if any."""
        at = self.held_due(behind=False)
        if self.ledger.behind and self._catch_up is not None:
            paced = self._catch_up.next_at() + self._step
            at = paced if at is None or paced < at else at
        recorded = self._recorder.next_deadline() if self._recorder is not None else None
        for t in (self._batcher.next_deadline(), self._flush_at, min((at for at, _ in self._retries), default=None),
                  recorded):
            if t is not None and (at is None or t < at):
                at = t
        return at

    # -- events ---------------------------------------------------------------------------
    def delivered(self, tag: int, d: Delivery, now: int, steady: Optional[int] = None) -> Effects:
        return self.delivered_all(((tag, d),), now, steady)

    def delivered_all(self, deliveries: Sequence[Tuple[int, Delivery]], now: int,
                      steady: Optional[int] = None) -> Effects:
        """Deliveries that came together (one read of the socket), in order: what they make
        us do, in one answer."""
        out = Effects()
        self._steady(now, steady)
        self._release_due(now, out)  # a stream of deliveries must not keep due messages waiting
        for tag, d in deliveries:
            self._take(tag, d, now, out)
        self._release_behind(now, out)
        self._record(now, out)
        return out

    def _take(self, tag: int, d: Delivery, now: int, out: Effects) -> None:
        self._delivered[tag] = d
        try:
            actions = self._handler(d, now)
        except Exception as exc:  # a bug must not stop the gateway, nor lose the message
            self._observer.note("exception", "handler_failed", routing_key=envelope.readable_key(d.routing_key))
            actions = list(self._park(d, f"the gateway failed on it: {exc!r}"))
        if self._stranded is not None:  # handed back by the broker: released from memory already, or ours again
            actions = [Drop(a.entry) if not isinstance(a, Drop) and a.entry is not None
                       and self._stranded.claim(a.entry) else a for a in actions]
        fence = False
        for a in actions:  # (a loop, not any(): no generator made for every message read)
            if isinstance(a, Forward) and a.fence:
                fence = True
                break
        self.ledger.received(tag, fence)
        if not actions:
            self.ledger.finish(tag)
            self._ack_soon(now, out)
        else:
            self._unsent[tag] = len(actions)
        sends: List[Tuple[int, Forward]] = []  # due now: published together, in order, before anything else
        for action in actions:
            if isinstance(action, Forward) and not action.fence and (action.not_before_ms is None
                                                                     or action.not_before_ms <= now):
                self._observer.forwarded(action)
                if self._catch_up is not None and action.not_before_ms is not None and action.entry is not None:
                    since = self._catch_up.since(action.not_before_ms, action.entry.accepted_us)
                    if self._catch_up.overdue(since, now):
                        self.ledger.hold_behind(tag, since - self._step, action)
                        continue
                sends.append((tag, action))
                continue
            if sends:
                self._send_each(sends, now, out)
                sends = []
            if isinstance(action, Drop):
                self._drop(tag, action.entry, now, out)
                continue
            self._observer.forwarded(action)
            if isinstance(action, Enqueue):
                bucket = action.entry.due_ms // HOLD_BUCKET_MS if action.way is Way.DISTRIBUTOR else 0
                route = (action.exchange, action.routing_key, action.way, action.entry.exchange, bucket)
                for batch in self._batcher.add(route, tag, action.entry, now, action.send_by_ms):
                    self._flush_batch(batch, now, out)
            elif action.fence:
                self._fenced.append((tag, action))
            else:  # due later: held until then
                assert action.not_before_ms is not None
                self.ledger.hold(tag, action.not_before_ms - self._step, action)
        if sends:
            self._send_each(sends, now, out)
        if fence or (self._prefetch and (len(self._delivered) >= self._prefetch
                                         or len(self._batcher) >= self._prefetch * WINDOW_SHARE)):
            # A fence waits for every delivery before it: what waits for company goes now.
            for batch in self._batcher.drain():
                self._flush_batch(batch, now, out)
        if fence:
            self._open_fences(out)

    def publishing_opened(self, now: int) -> Effects:
        out = Effects()
        self._apply(self.ledger.channel_open(), now, out)
        return out

    def publishing_closed(self, refusal: str, now: int) -> Effects:
        """The broker closed the publishing channel over a message (a new one is opening)."""
        self._refusal = refusal
        out = Effects()
        self._apply(self.ledger.channel_closed(), now, out)
        self._ack_soon(now, out)  # (a record the broker refused: its deliveries may be done)
        self._record(now, out)
        return out

    def publishing_gone(self) -> None:
        """The publishing channel closed and will not be opened again."""
        self.ledger.channel_gone()

    def returned(self, routing_key: bytes, props: bytes, body: bytes) -> None:
        """basic.return: the confirm that follows reports it (then it is parked)."""
        for pub in self.ledger.inflight():
            f = pub.payload.forward
            if f.mandatory and f.routing_key == routing_key and f.body == body and f.props.raw == props:
                self.ledger.returned(pub.seq)
                return
        self._observer.note("error", "unmatched_return", routing_key=envelope.readable_key(routing_key))

    def confirmed(self, seq: int, multiple: bool, ack: bool, now: int) -> Effects:
        out = Effects()
        self._apply(self.ledger.confirmed(seq, multiple, ack), now, out)
        self._ack_soon(now, out)
        self._open_fences(out)  # (a delivery before a fence may have been given up)
        self._record(now, out)
        self._maybe_finished(out)
        return out

    def synced(self, now: int) -> Effects:
        """The broker answered the sync: it has taken every ack sent before it, so each fence
        whose deliveries before it were all acknowledged by then is published now."""
        out = Effects()
        since, self._syncing, self._acked_since_sync = self._acked_since_sync, False, None
        while self._fenced and self.ledger.settled_before(self._fenced[0][0]) \
                and (since is None or self._fenced[0][0] < since):
            tag, forward = self._fenced.popleft()
            self._send([tag], forward, [(tag, None)], now, out)
        self._open_fences(out)
        self._record(now, out)
        self._maybe_finished(out)
        return out

    def tick(self, now: int, steady: Optional[int] = None) -> Effects:
        out = Effects()
        self._steady(now, steady)
        self._release_due(now, out)
        for batch in self._batcher.expired(now):
            self._flush_batch(batch, now, out)
        if self._flush_at is not None and now >= self._flush_at:
            self._flush(out)
        self._retry_due(now, out)
        self._record(now, out)
        return out

    def drain(self, now: int) -> Effects:
        """Stopping, and no more deliveries come: send on what waits in batches, hand held
        messages back to the distributor queue (for another gateway), wait for confirms."""
        out = Effects()
        self._draining = True
        if self._stranded is not None:
            self._stranded.clear()  # (the broker hands their originals to another gateway)
        for batch in self._batcher.drain():
            self._flush_batch(batch, now, out)
        # A held message is due within a unit or so: it goes back into the distributor
        # queue, where another gateway (or this one, restarted) holds it until due. Handing
        # back the delivery instead would repeat those of a carrier already published.
        held = self.ledger.drain_holds()
        for tag, release in held:
            assert release.entry is not None  # (only the distributor holds, one entry each)
            self._send([tag], handlers.hand_back(self._names, release.entry), [(tag, release.entry)], now, out)
        self._record(now, out)
        self._observer.note("info", "stopping", returned=len(held), unconfirmed=self.ledger.unconfirmed)
        self._maybe_finished(out)
        return out

    def consuming_started(self, now: int, steady: Optional[int] = None) -> None:
        """Consuming (again): what a lost channel held may be handed back from now on."""
        self._steady(now, steady)
        if self._stranded is not None:
            self._stranded.resumed(now - self._step)

    def consuming_lost(self, now: int = 0) -> None:
        """The consuming channel is gone: its deliveries return to their queue by themselves
        (on RabbitMQ 4.3, from a node it cannot reach, only after a timeout: what they held
        is kept, to be released from memory if they do not come back in time)."""
        if self._stranded is not None:
            # held, and released without a confirm yet (it may not have reached the broker)
            unsure = [pub.payload.forward for pub in [*self.ledger.not_confirmed(), *(p for _, p in self._retries)]
                      if pub.tags and pub.payload.forward.way in (Way.DELIVERED, Way.RETRIED)]
            self._stranded.lost([(f.not_before_ms - self._step, f)
                                 for f in [*(f for _, f in self.ledger.drain_holds()), *unsure]
                                 if f.not_before_ms is not None and f.entry is not None], now - self._step)
        self.ledger.lost()
        if self._recorder is not None:
            self._recorder.forget_tags()
        self._batcher.drain()
        self._delivered.clear()
        self._unsent.clear()
        self._retries.clear()
        self._flush_at = None
        self._fenced.clear()
        self._syncing, self._acked_since_sync = False, None

    # -- decisions ------------------------------------------------------------------------
    def _release_due(self, now: int, out: Effects) -> None:
        """Publish every held message whose time has come, in due order: by the steady clock,
        and by the wall clock too (one stepped back since: held again, that much longer)."""
        if self._stranded:
            released = sum(self._release_stranded(f, now, out) for f in self._stranded.due(now - self._step, now))
            if released:
                self._observer.note("warning", "released_from_memory", messages=released,
                                    why="the broker has not handed back what a lost connection held (RabbitMQ "
                                        "4.3 keeps it for consumer_disconnected_timeout after losing a node)")
        sends: List[Tuple[int, Forward]] = []
        if self.ledger.next_due() is not None:
            for tag, action in self.ledger.due(now - self._step):
                assert action.not_before_ms is not None  # (what is held has a time)
                if action.not_before_ms > now:
                    self.ledger.hold(tag, action.not_before_ms - self._step, action)
                elif self._still_wanted is None or self._still_wanted(action):
                    sends.append((tag, action))
                else:  # (before the sends: a delivery finishes with its last message counted, either way)
                    self._drop(tag, action.entry, now, out)
        if sends:
            self._send_each(sends, now, out)
        self._release_behind(now, out)

    def _release_behind(self, now: int, out: Effects) -> None:
        """Publish as many overdue messages as the catch-up's pace allows, most overdue first."""
        if not self.ledger.behind or self._catch_up is None:
            return
        # (paced on the steady clock: a wall clock stepped back must not stop the catch-up)
        taken = self.ledger.take_behind(self._catch_up.allowance(now - self._step))
        self._catch_up.spent(len(taken))
        sends: List[Tuple[int, Forward]] = []
        for tag, action in taken:  # (a cancelled one costs its place in the pace too: it was read)
            if self._still_wanted is None or self._still_wanted(action):
                sends.append((tag, action))
            else:
                self._drop(tag, action.entry, now, out)
        if sends:
            self._send_each(sends, now, out)

    def _release_stranded(self, forward: Forward, now: int, out: Effects) -> bool:
        """Publish a message a lost channel held, from memory (stranded.Stranded): no delivery
        waits for it; the broker's copy is dropped if it comes back after the confirm. False:
        it was cancelled meanwhile (its copy is dropped as it comes back)."""
        assert self._stranded is not None and forward.entry is not None
        if self._still_wanted is not None and not self._still_wanted(forward):
            self._stranded.dropped(forward.entry)
            return False
        self._observer.late(max(0, now - (forward.not_before_ms or now)))
        self._apply(self.ledger.publish((), Payload(forward, [(STRANDED, forward.entry)]), ()), now, out)
        if self._recorder is not None:
            self._recorder.left([(STRANDED, forward.entry)], now)
        return True

    def _drop(self, tag: int, entry: Optional[Entry], now: int, out: Effects) -> None:
        """One of the delivery's messages will not be published (it was cancelled): the index
        notes it gone."""
        if self._recorder is not None:
            self.ledger.owe(self._recorder.left([(tag, entry)], now))
        left = self._unsent.get(tag, 0) - 1
        if left > 0:
            self._unsent[tag] = left
            return
        self._unsent.pop(tag, None)
        self.ledger.finish(tag)
        self._ack_soon(now, out)

    def _ack_soon(self, now: int, out: Effects) -> None:
        """Deliveries are done: acknowledge them now (a full batch, a fence waits for them, or
        no publish awaits its confirm, so none could join them soon) or within ACK_FLUSH_MS."""
        done = self.ledger.done_count
        if done >= ACK_BATCH or done and (self._fenced or not self.ledger.unconfirmed):
            self._flush(out)
        elif self._flush_at is None and done:
            self._flush_at = now + ACK_FLUSH_MS

    def _flush_batch(self, batch: Batch, now: int, out: Effects) -> None:
        exchange, key, way = batch.key[:3]
        self._observer.batched(way, len(batch.items))
        self._send([tag for tag, _ in batch.items],
                   handlers.carry(exchange, key, way, [e for _, e in batch.items]), batch.items, now, out)

    def _send(self, tags: List[int], forward: Forward, members: Sequence[Member], now: int, out: Effects) -> None:
        """Publish `forward` for the messages of these deliveries (one tag per message)."""
        if forward.not_before_ms is not None:
            self._observer.late(max(0, now - forward.not_before_ms))
        counted = ((tags[0], 1),) if len(tags) == 1 else Counter(tags).items()  # (one: a release, the busiest)
        finishing = [tag for tag, n in counted if self._sent_of(tag, n)]
        answer = self.ledger.publish(tuple(tags) if len(tags) == 1 else tuple(dict.fromkeys(tags)),
                                     Payload(forward, members), finishing, parking=forward.way is Way.PARKED)
        self._apply(answer, now, out)
        if self._recorder is not None:
            if forward.way in STAYS:
                self._recorder.waits(forward.way is Way.MEDITATION, members, now)
            elif forward.way in LEAVES:
                self.ledger.owe(self._recorder.left(members, now))

    def _sent_of(self, tag: int, n: int) -> bool:
        """`n` more of the delivery's messages are in a publication: whether that was its last."""
        left = self._unsent.get(tag, 0) - n
        if left <= 0:
            self._unsent.pop(tag, None)
            return True
        self._unsent[tag] = left
        return False

    def _send_each(self, sends: List[Tuple[int, Forward]], now: int, out: Effects) -> None:
        """`_send` for each (tag, forward) alone, in order: one message of that delivery each
        (the releases of an event), with one answer from the ledger for them all."""
        if len(sends) == 1:
            tag, forward = sends[0]
            self._send([tag], forward, [(tag, forward.entry)], now, out)
            return
        late, recorder = self._observer.late, self._recorder
        items = []
        leaving: List[Member] = []
        for tag, forward in sends:
            if forward.not_before_ms is not None:
                late(max(0, now - forward.not_before_ms))
            members = [(tag, forward.entry)]
            items.append((tag, Payload(forward, members), self._sent_of(tag, 1), forward.way is Way.PARKED))
            if recorder is not None:
                if forward.way in STAYS:
                    recorder.waits(forward.way is Way.MEDITATION, members, now)
                elif forward.way in LEAVES:
                    leaving += members
        self._apply(self.ledger.publish_each(items), now, out)
        if leaving:
            assert recorder is not None
            self.ledger.owe(recorder.left(leaving, now))

    def _record(self, now: int, out: Effects) -> None:
        """Publish what the recorder holds (index_records.Recorder), after the messages it speaks
        of, on the same channel, each record for the deliveries it speaks of: the entries at
        once, the done keys once they have waited for company."""
        if self._recorder is None:
            return
        for key, tags, body in self._recorder.take_entries():
            self._side_record(key, tags, body, now, out)
        taken = self._recorder.take_done(now, self._draining or self._done_alone(now))
        if taken is not None:
            self._done_sent_ms = now
            owed, body = taken
            live = Counter(t for t in owed if t in self.ledger)
            self._side_record(DONE, list(live), body, now, out)
            self.ledger.pay(live)

    def _done_alone(self, now: int) -> bool:
        """Whether done keys would wait for company in vain: the last ones went out a while
        ago, and nothing held is due within the wait (a trickle: each message's key goes out
        with its release, one wake-up instead of three)."""
        due = self.held_due()
        return now - self._done_sent_ms >= index_records.DONE_FLUSH_MS and (
            due is None or due > now + index_records.DONE_FLUSH_MS)

    def _side_record(self, key: str, tags: List[int], body: bytes, now: int, out: Effects) -> None:
        live = tuple(t for t in dict.fromkeys(tags) if t in self.ledger)
        record = Forward(self._names.waiting, key.encode(), RECORD, body, Way.INDEX, mandatory=True)
        self._apply(self.ledger.publish(live, Payload(record, [(t, None) for t in live]), (), side=True), now, out)

    def _give_up(self, tag: int) -> None:
        """The delivery is gone (the broker dead-letters it): none of its messages may be sent."""
        self._delivered.pop(tag, None)
        self._unsent.pop(tag, None)
        self._batcher.discard(tag)

    def _flush(self, out: Effects) -> None:
        self._flush_at = None
        last, singles, gone = self.ledger.acks()
        if last is not None:
            out.ack.append((last, True))
        out.ack.extend((tag, False) for tag in singles)
        for tag in gone:
            self._delivered.pop(tag, None)
        if gone and self._syncing:
            self._acked_since_sync = min(gone if self._acked_since_sync is None else [self._acked_since_sync, *gone])
        if gone:
            self._open_fences(out)

    def _open_fences(self, out: Effects) -> None:
        """Ask for a sync once the first fence's turn has come (every delivery before it
        acknowledged): it is published when the broker answers (`synced`)."""
        if not self._syncing and self._fenced and self.ledger.settled_before(self._fenced[0][0]):
            self._syncing = out.sync = True

    def _maybe_finished(self, out: Effects) -> None:
        if self._draining and not self.ledger.unconfirmed and not self._fenced:
            self._flush(out)
            out.finished = True

    # -- the broker's answers to publishes --------------------------------------------------
    def _apply(self, answer: Outcome[Payload], now: int, out: Effects) -> None:
        """Do what the ledger answered (a confirms.Outcome): into `out`, the adapter's Effects."""
        if answer.send:
            for pub in answer.send:
                pub.sent_ms = now
            out.publish.extend(answer.send)
        if not answer.settled:  # (a publish's answer, the busiest, settles nothing)
            return
        for pub in answer.confirmed:
            if not pub.returned:
                self._observer.landed(pub.payload.forward)
                entry = pub.payload.forward.entry
                if self._stranded is not None and entry is not None and pub.payload.members \
                        and pub.payload.members[0][0] == STRANDED:
                    self._stranded.confirmed(entry, now - self._step)
        for pub in answer.dropped:
            self._refused_records += 1
            if self._refused_records == 1:  # said once: the same cause refuses them all
                self._observer.note("warning", "waiting_record_refused", stream=self._names.waiting_stream(
                    pub.payload.forward.routing_key.decode()), fix="run `delay-gateway declare` with this version")
        for pub in answer.refused:
            if pub.refused > REFUSED_RECONNECT:
                self._observer.note("error", "broker_keeps_refusing", refusals=pub.refused)
                out.reconnect = True
            else:
                self._observer.note("warning", "publish_nacked_by_broker", after_s=RETRY_REFUSED_MS / 1000)
                self._retries.append((now + RETRY_REFUSED_MS, pub))
        for pub in answer.returned:
            self._park_publication(pub, lambda e: handlers.unroutable(self._names, e), "", now, out)
        reason = f"the broker refused to take it: {self._refusal}"
        for pub in answer.guilty:
            self._park_publication(pub, lambda e: handlers.park_entry(self._names, e, reason), reason, now, out)
        for tag in answer.reject:
            self._observer.note("error", "rejected_to_dead_letter", delivery_tag=tag)
            self._give_up(tag)
            out.reject.append(tag)

    def _retry_due(self, now: int, out: Effects) -> None:
        due = [pub for at, pub in self._retries if at <= now]
        if due:
            self._retries = [(at, pub) for at, pub in self._retries if at > now]
            for pub in due:
                self._apply(self.ledger.retry(pub), now, out)

    def _park_publication(self, pub: Sent, parked: Callable[[Entry], Forward], reason: str, now: int,
                          out: Effects) -> None:
        """Publish a parked copy of each message of a publication that cannot go on."""
        for tag, entry in pub.payload.members:
            if tag == STRANDED and self._stranded is not None and entry is not None:
                self._stranded.dropped(entry)  # (the broker's copy is parked as it comes back)
            if tag not in self.ledger:
                continue
            copies = [parked(entry)] if entry is not None else self._park(self._delivered[tag], reason)
            for copy in copies:
                self._observer.forwarded(copy)
                if self._recorder is not None:
                    self.ledger.owe(self._recorder.left([(tag, copy.entry)], now))
                self._apply(self.ledger.publish((tag,), Payload(copy, [(tag, copy.entry)]), (), parking=True),
                            now, out)
