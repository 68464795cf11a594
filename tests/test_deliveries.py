"""The per-delivery state machine (pure): a table per transition, then a hypothesis state
machine that drives it as pika would and checks the rules after every step."""

from collections import Counter
from typing import Dict, List, Set

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from gateway.core.deliveries import Deliveries


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
    d.hold(2)  # waits for its due time
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
    d.hold(1)
    d.received(2)
    d.publish((2,), "x")
    assert d.lost() == {1} and len(d) == 0 and d.held == 0 and d.unconfirmed == 0
    assert not d.release(1)  # its timer fires later: nothing happens


def test_a_tag_cannot_be_received_twice():
    d = opened()
    d.received(1)
    with pytest.raises(ValueError):
        d.received(1)


# -- the rules, after every step of random runs -----------------------------------------------
class Driver(RuleBasedStateMachine):
    """Plays consumer (with the pipe's reactions) and broker; keeps its own account."""

    def __init__(self) -> None:
        super().__init__()
        self.d = Deliveries()
        self.next_tag = 1
        self.made: Dict[int, int] = {}  # tag -> publishes made for it
        self.confirmed: Dict[int, int] = {}  # tag -> of those, confirmed (not returned)
        self.finished: Set[int] = set()
        self.held: Counter = Counter()  # tag -> messages of it held
        self.ended: Dict[int, str] = {}  # tag -> acked / rejected
        self.outstanding: List[int] = []  # in delivery order
        self.inflight: Dict[int, object] = {}  # seq -> publication
        self.refused: List[object] = []
        self.open = False

    @initialize()
    def start(self) -> None:
        self.channel_opens()
        for _ in range(3):
            self.deliver()

    def apply(self, out) -> None:
        for pub in out.send:
            assert self.open, "published on a closed channel"
            assert pub.seq not in self.inflight
            self.inflight[pub.seq] = pub
        self.refused.extend(out.refused)
        for pub in out.returned + out.guilty:
            for tag in pub.tags:
                if tag in self.outstanding:
                    self.made[tag] += 1
                    # as the consumer parks it: a copy that does not finish its delivery
                    # (one not yet finished has more publishes to come)
                    self.apply(self.d.publish((tag,), "parked", (), parking=True))
        for tag in out.reject:
            self.end(tag, "rejected")

    def end(self, tag: int, how: str) -> None:
        assert tag not in self.ended, f"delivery {tag} ended twice"
        self.ended[tag] = how
        self.outstanding.remove(tag)
        self.held.pop(tag, None)

    def startable(self) -> List[int]:
        return [t for t in self.outstanding if t not in self.finished]

    @rule()
    def channel_opens(self) -> None:
        if not self.open:
            self.open = True
            self.inflight.clear()
            self.apply(self.d.channel_open())

    @rule()
    def broker_closes_publishing_channel(self) -> None:
        if self.open:
            self.open = False
            self.inflight.clear()
            self.apply(self.d.channel_closed())

    @rule()
    def deliver(self) -> None:
        tag = self.next_tag
        self.next_tag += 1
        self.d.received(tag)
        self.outstanding.append(tag)
        self.made[tag] = self.confirmed[tag] = 0

    @rule(data=st.data())
    def hold(self, data) -> None:
        tags = self.startable()
        if tags:
            tag = data.draw(st.sampled_from(tags))
            self.d.hold(tag)
            self.held[tag] += 1

    @rule(data=st.data())
    def release(self, data) -> None:
        held = sorted(t for t, n in self.held.items() if n)
        if held:
            tag = data.draw(st.sampled_from(held))
            assert self.d.release(tag)
            self.held[tag] -= 1

    @rule(data=st.data(), finishes=st.booleans(), many=st.booleans())
    def publish(self, data, finishes, many) -> None:
        tags = self.startable()
        if not tags:
            return
        chosen = data.draw(st.lists(st.sampled_from(tags), min_size=1, max_size=3, unique=True)) if many \
            else [data.draw(st.sampled_from(tags))]
        for tag in chosen:
            self.made[tag] += 1
            if finishes:
                self.finished.add(tag)
        self.apply(self.d.publish(tuple(chosen), "m", finishing=None if finishes else ()))

    @rule(data=st.data())
    def publish_in_parts(self, data) -> None:
        """A delivery that becomes two publishes (the distributor unpacking a carrier)."""
        tags = self.startable()
        if tags:
            tag = data.draw(st.sampled_from(tags))
            self.made[tag] += 2
            self.finished.add(tag)
            self.apply(self.d.publish((tag,), "part 1", finishing=()))
            self.apply(self.d.publish((tag,), "part 2"))

    @rule(data=st.data(), ack=st.booleans(), multiple=st.booleans())
    def broker_confirms(self, data, ack, multiple) -> None:
        if not self.inflight:
            return
        seq = data.draw(st.sampled_from(sorted(self.inflight)))
        done = [s for s in self.inflight if s <= seq] if multiple else [seq]
        for s in done:
            pub = self.inflight.pop(s)
            if ack and not (pub.returned and not pub.parking):
                for tag in pub.tags:
                    self.confirmed[tag] += 1
        self.apply(self.d.confirmed(seq, multiple, ack))

    @rule(data=st.data())
    def broker_returns(self, data) -> None:
        mandatory = [s for s, p in self.inflight.items() if not p.parking]
        if mandatory:
            self.d.returned(data.draw(st.sampled_from(mandatory)))

    @rule()
    def retry_refused(self) -> None:
        if self.refused:
            self.apply(self.d.retry(self.refused.pop(0)))

    @rule()
    def flush_acks(self) -> None:
        before = list(self.outstanding)
        last, singles, gone = self.d.acks()
        if last is not None:
            covered = [t for t in before if t <= last]
            for tag in covered:  # a multiple ack never covers one that is not done
                self.check_done(tag)
                self.end(tag, "acked")
        for tag in singles:
            self.check_done(tag)
            self.end(tag, "acked")
        assert sorted(gone) == sorted(t for t in before if t not in self.outstanding)

    def check_done(self, tag: int) -> None:
        assert tag in self.finished, f"{tag} acknowledged before its last publish"
        assert not self.held.get(tag), f"{tag} acknowledged while held"
        assert self.made[tag] > 0 and self.confirmed[tag] >= 1, f"{tag} acknowledged unconfirmed"
        pending = [p for p in self.inflight.values() if tag in p.tags]
        assert not pending, f"{tag} acknowledged with publishes unconfirmed"
        assert not [p for p in self.refused if tag in p.tags], f"{tag} acknowledged with a refused publish"

    @rule(data=st.data())
    def consumer_hands_back(self, data) -> None:
        tags = [t for t in self.outstanding if self.held.get(t)]
        if tags:
            tag = data.draw(st.sampled_from(tags))
            self.d.reject(tag)
            self.end(tag, "rejected")

    @precondition(lambda self: self.outstanding)
    @rule()
    def consuming_channel_lost(self) -> None:
        held = self.d.lost()
        assert held == {t for t, n in self.held.items() if n}
        for tag in list(self.outstanding):
            self.end(tag, "lost")
        self.inflight.clear()
        self.refused.clear()
        self.open = False

    @invariant()
    def held_gauge_equals_holds(self) -> None:
        assert self.d.held == sum(self.held.values())

    @invariant()
    def outstanding_agree(self) -> None:
        assert len(self.d) == len(self.outstanding)
        assert self.d.unconfirmed == len(self.inflight)


Driver.TestCase.settings = settings(max_examples=500, stateful_step_count=30, deadline=None)
TestDeliveries = Driver.TestCase
