"""The per-delivery state machine (pure): a table per transition, then a hypothesis state
machine that drives the real consumer (broker.consumer.Pipe, with its core) over a fake
connection, as a broker would, and checks the rules after every step."""

from typing import Dict, List, Set

import pytest
import structlog.testing
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from .fake_broker import FakeConnection, Published
from gateway.broker.run.consumer import Pipe
from gateway.core import carrier
from gateway.core.actions import Action, Enqueue, Forward
from gateway.core.inputs import Delivery
from gateway.core.routes import Way
from gateway.core.carrier import Batcher, Entry
from gateway.core.deliveries import Deliveries
from gateway.core.wire import Properties
from gateway.metrics import Metrics
from topology.names import Names

from .support import examples


def opened() -> Deliveries:
    d = Deliveries()
    d.channel_open()
    return d


# -- transitions, one by one -------------------------------------------------------------------
def test_a_delivery_is_acknowledged_only_after_the_confirm_of_what_it_became():
    d = opened()
    d.received(1)
    [pub] = d.publish((1,), "fwd").send
    assert pub.seq == 1 and d.acks() == (None, [], [])
    d.confirmed(1, multiple=False, ack=True)
    assert d.acks() == (1, [], [1]) and len(d) == 0


def test_one_multiple_ack_covers_the_done_run_and_singles_the_rest():
    d = opened()
    for tag in (1, 2, 3, 4):
        d.received(tag)
    d.hold(2, 5_000, "m")  # waits for its due time
    for tag in (1, 3, 4):
        d.publish((tag,), tag)
    d.confirmed(3, multiple=True, ack=True)
    assert d.acks() == (1, [3, 4], [1, 3, 4])
    assert 2 in d and d.held == 1


def test_a_delivery_that_becomes_several_publishes_waits_for_all():
    d = opened()
    d.received(7)
    d.publish((7,), "a", finishing=())
    d.publish((7,), "b", finishing=())
    d.confirmed(2, multiple=True, ack=True)
    assert d.acks()[2] == []  # not finished: more may come
    d.publish((7,), "c")
    d.confirmed(3, multiple=False, ack=True)
    assert d.acks()[2] == [7]
    d.received(8)
    d.publish((8,), "d", finishing=())
    d.publish((8,), "e")
    d.confirmed(4, multiple=False, ack=True)
    assert d.acks()[2] == []  # finished, but "e" is not confirmed yet


def test_one_publish_for_many_deliveries_acknowledges_them_together():
    d = opened()
    for tag in (1, 2, 3):
        d.received(tag)
    d.publish((1, 2, 3), "carrier")
    d.confirmed(1, multiple=False, ack=True)
    assert d.acks() == (3, [], [1, 2, 3])


def test_a_refused_publish_is_handed_back_and_sent_again():
    d = opened()
    d.received(1)
    d.publish((1,), "x")
    out = d.confirmed(1, multiple=False, ack=False)
    [pub] = out.refused
    assert pub.refused == 1 and d.acks()[2] == []
    [again] = d.retry(pub).send
    assert again.seq == 2
    d.confirmed(2, multiple=False, ack=True)
    assert d.acks()[2] == [1]


def test_a_returned_publish_is_reported_with_its_confirm_and_not_acknowledged():
    d = opened()
    d.received(1)
    d.publish((1,), "to pick-up")
    d.returned(1)
    out = d.confirmed(1, multiple=False, ack=True)
    assert [p.payload for p in out.returned] == ["to pick-up"] and d.acks()[2] == []
    d.publish((1,), "parked copy", parking=True)
    d.confirmed(2, multiple=False, ack=True)
    assert d.acks()[2] == [1]


def test_a_delivery_is_not_done_while_a_returned_publish_awaits_its_parked_copy():
    # one confirm covers three publishes of one delivery, the first of them returned:
    # the delivery waits for the parked copy the consumer makes next (found by the state machine)
    d = opened()
    d.received(5)
    d.publish((5,), "now", finishing=())
    d.publish((5,), "handed back 1", finishing=())
    d.publish((5,), "handed back 2")
    d.returned(1)
    out = d.confirmed(3, multiple=True, ack=True)
    assert [p.payload for p in out.returned] == ["now"] and d.acks()[2] == []
    d.publish((5,), "parked copy", (), parking=True)
    d.confirmed(4, multiple=False, ack=True)
    assert d.acks()[2] == [5]


def test_a_closed_publishing_channel_isolates_the_publishes_it_had_not_confirmed():
    d = opened()
    for tag in (1, 2, 3):
        d.received(tag)
        d.publish((tag,), f"m{tag}")
    d.confirmed(1, multiple=False, ack=True)
    assert d.channel_closed().guilty == []  # two were unconfirmed: not known which
    d.received(4)
    assert d.publish((4,), "m4").send == []  # nothing goes out while the channel is shut
    [first] = d.channel_open().send  # then the suspects, one at a time
    assert first.payload == "m2" and first.seq == 1
    [second] = d.confirmed(1, multiple=False, ack=True).send
    assert second.payload == "m3"
    out = d.channel_closed()  # closed again with m3 alone on it: m3 is the one
    assert [p.payload for p in out.guilty] == ["m3"]
    sent = d.channel_open().send
    assert [p.payload for p in sent] == ["m4"]  # the others flow again
    d.publish((3,), "m3 parked", parking=True)
    assert d.acks()[2] == [1, 2]


def test_a_parked_copy_refused_too_is_rejected_to_the_dead_letter_exchange():
    d = opened()
    d.received(1)
    d.publish((1,), "parked copy", parking=True)
    out = d.channel_closed()
    assert out.reject == [1] and 1 not in d


def test_a_lost_consuming_channel_forgets_everything():
    d = opened()
    d.received(1)
    d.hold(1, 5_000, "m")
    d.received(2)
    d.publish((2,), "x")
    d.lost()
    assert len(d) == 0 and d.held == 0 and d.unconfirmed == 0
    assert d.next_due() is None and d.due(10_000) == []  # nothing is released later


def test_a_tag_cannot_be_received_twice():
    d = opened()
    d.received(1)
    with pytest.raises(ValueError):
        d.received(1)


# -- the rules, after every step of random runs -----------------------------------------------
NAMES = Names("t")
QUEUE = "t.under-test"


class Plans:
    """The handler under test: a delivery's body is b"<id>:<plan>", one letter per message it
    becomes: n (publish now, mandatory, as to pick-up), 1-3 (the same, held that many tenths
    of a second), e (on a route, batched into carriers); x: the handler fails on it."""

    def __call__(self, d: Delivery, now: int) -> List[Action]:
        ident, plan = d.body.split(b":")
        if b"x" in plan:
            raise RuntimeError("a bug")
        out: List[Action] = []
        for i, letter in enumerate(plan.decode()):
            due = now + (100 * int(letter) if letter.isdigit() else 0)
            e = Entry(b"k", Properties.build(message_id=f"{i}"), ident + b"." + str(i).encode(), due)
            if letter == "e":
                out.append(Enqueue("t.chain", b"0.1", Way.CHAIN, e))
            else:
                out.append(Forward(NAMES.pick_up, b"k", e.user, e.body, Way.DELIVERED,
                                   not_before_ms=due if letter.isdigit() else None, mandatory=True, entry=e))
        return out


def expected(body: bytes) -> Set[bytes]:
    """The message bodies that must be safely published before the delivery is acknowledged."""
    ident, plan = body.split(b":")
    return {body} if b"x" in plan else {ident + b"." + str(i).encode() for i in range(len(plan))}


def carried(pub: Published) -> List[bytes]:
    if pub.body.startswith(carrier.MAGIC):
        return [e.body for e in carrier.unpack(pub.body)]
    return [pub.body]


class Driver(RuleBasedStateMachine):
    """Plays the broker (and the worker around the consumer) with a fake connection; keeps
    its own account of what is safe, and checks every ack the real consumer sends."""

    def __init__(self) -> None:
        super().__init__()
        self.next_id = 1
        self.safe: Set[bytes] = set()  # message bodies confirmed, not returned
        self.ended: Dict[str, str] = {}  # delivery body -> acked / rejected / lost
        self.stopped = False
        self.stopped_done = False
        self.quiet = structlog.testing.capture_logs()  # (thousands of runs: their logs cost more than they)
        self.quiet.__enter__()
        self.connect()

    def connect(self) -> None:
        """A fresh connection and consumer, as the worker makes after losing one."""
        self.conn = FakeConnection() if not hasattr(self, "conn") else FakeConnection(self.conn.clock)
        self.metrics = Metrics()
        self.pipe = Pipe(self.conn, QUEUE, Plans(), 100, self.metrics, NAMES, clock=self.conn.clock,
                         batcher=Batcher(3, 100_000, 20))
        self.pipe.open()
        self.conn.settle()
        self.outstanding: Dict[int, bytes] = {}  # delivery tag -> body, in delivery order
        self.unconfirmed: Dict[int, Published] = {}  # seq -> sent on the publishing channel
        self.returned: Set[int] = set()
        self.seen = 0  # publishes looked at
        self.frames_seen = 0  # of the connection's frames: acks and nacks in the order sent
        self.consuming = self.conn.consuming()

    def step(self) -> None:
        """Take in what the consumer sent, check its acks, and play the worker: a stopped
        consumer's connection closes; a closed one is opened again."""
        for pub in self.conn.published[self.seen:]:
            assert pub.channel.is_open, "published on a closed channel"
            self.unconfirmed[pub.seq] = pub
        self.seen = len(self.conn.published)
        for kind, tag, flag in [f for f in self.conn.frames[self.frames_seen:] if f[0] in ("ack", "nack")]:
            if kind == "nack":
                assert not flag  # (never requeued)
                self.end(tag, "rejected")
                continue
            covered = [t for t in self.outstanding if t <= tag] if flag else [tag]
            assert covered and all(t in self.outstanding for t in covered), f"ack of {tag}: not outstanding"
            for t in covered:  # a multiple ack never covers one that is not done
                body = self.outstanding[t]
                missing = expected(body) - self.safe
                assert not missing, f"{body!r} acknowledged with {sorted(missing)} not safely published"
                self.end(t, "acked")
        self.frames_seen = len(self.conn.frames)
        if self.stopped_done and self.conn.is_open:
            # nothing done is left unacknowledged (what is left, its publishes refused and
            # not yet retried, the broker redelivers), and nothing is held
            assert not self.pipe.flow.held
            assert all(expected(body) - self.safe for body in self.outstanding.values())
            self.conn.close()
        if not self.conn.is_open:
            for tag in list(self.outstanding):
                self.end(tag, "lost")  # back to the queue, by the broker
            if not self.stopped:
                self.connect()

    def end(self, tag: int, how: str) -> None:
        body = self.outstanding.pop(tag)
        assert body not in self.ended, f"delivery {body!r} ended twice"
        self.ended[body] = how

    @initialize()
    def start(self) -> None:
        for _ in range(3):
            self.deliver("n")

    @precondition(lambda self: not self.stopped)
    @rule(plan=st.lists(st.sampled_from("nn12ee3x"), max_size=3).map("".join))
    def deliver(self, plan: str) -> None:
        if "x" in plan:
            plan = "x"
        body = f"{self.next_id}:{plan}".encode()
        self.next_id += 1
        tag = self.consuming.deliver(body)
        self.outstanding[tag] = body
        self.step()

    @rule(ms=st.sampled_from([0, 1, 5, 20, 100, 350, 1000]))
    def time_passes(self, ms: int) -> None:
        self.conn.advance(ms)
        self.step()

    @rule(data=st.data(), ack=st.booleans(), multiple=st.booleans())
    def broker_confirms(self, data, ack: bool, multiple: bool) -> None:
        channel = self.conn.publishing()
        if channel is None or not self.unconfirmed:
            return
        seq = data.draw(st.sampled_from(sorted(self.unconfirmed)))
        for s in [s for s in self.unconfirmed if s <= seq] if multiple else [seq]:
            pub = self.unconfirmed.pop(s)
            if ack and s not in self.returned:
                self.safe.update(carried(pub))
            self.returned.discard(s)
        channel.confirm(seq, ack=ack, multiple=multiple)
        self.step()

    @rule(data=st.data())
    def broker_returns(self, data) -> None:
        mandatory = [s for s, p in self.unconfirmed.items() if p.mandatory and s not in self.returned]
        channel = self.conn.publishing()
        if mandatory and channel is not None:
            seq = data.draw(st.sampled_from(mandatory))
            self.returned.add(seq)
            channel.give_back(self.unconfirmed[seq])
            self.step()

    @rule()
    def broker_closes_publishing_channel(self) -> None:
        channel = self.conn.publishing()
        if channel is not None:
            self.unconfirmed.clear()
            self.returned.clear()
            channel.close_by_broker(406, "PRECONDITION_FAILED - refused")
            self.conn.settle()  # the consumer opens a new one
            self.step()

    @precondition(lambda self: not self.stopped)
    @rule()
    def consuming_channel_lost(self) -> None:
        self.consuming.close_by_broker(404, "NOT_FOUND - no queue")
        assert not self.conn.is_open  # the consumer starts over on a new connection
        self.step()

    @precondition(lambda self: not self.stopped)
    @rule()
    def stop(self) -> None:
        self.stopped = True
        self.pipe.stop(self.on_stopped)
        self.conn.settle()
        self.step()

    def on_stopped(self) -> None:
        self.stopped_done = True

    @invariant()
    def held_gauge_equals_holds(self) -> None:
        gauge = self.metrics.registry.get_sample_value("delay_gateway_held_messages", {"vhost": "/", "queue": QUEUE})
        assert gauge == self.pipe.flow.held == self.pipe.flow.ledger.held

    @invariant()
    def outstanding_agree(self) -> None:
        assert len(self.pipe.flow.ledger) == len(self.outstanding)
        if self.conn.publishing() is not None:
            assert self.pipe.flow.ledger.unconfirmed == len(self.unconfirmed)

    def teardown(self) -> None:
        self.quiet.__exit__(None, None, None)


Driver.TestCase.settings = settings(max_examples=examples(1000), stateful_step_count=40)
TestDeliveries = Driver.TestCase


def test_held_messages_are_released_in_due_order_and_a_rejected_deliverys_never():
    d = opened()
    for tag in (1, 2, 3):
        d.received(tag)
    d.hold(1, 300, "a")
    d.hold(2, 100, "b")
    d.hold(2, 200, "c")
    d.hold(3, 100, "d")
    assert d.held == 4 and d.next_due() == 100
    d.reject(3)
    assert d.held == 3 and d.due(250) == [(2, "b"), (2, "c")]
    d.finish(2)
    assert d.acks()[2] == [2]  # its messages released and nothing left to publish: done
    assert d.drain_holds() == [(1, "a")] and d.held == 0
