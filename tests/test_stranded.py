"""What a distributor held when its channel was lost (core/stranded.py), in the pure core:
released from memory when the broker does not hand it back within the grace after consuming
again (RabbitMQ 4.3 keeps a lost node's consumer's deliveries for a minute), never early,
never when cancelled, never twice by one process, and nothing counted released before the
broker confirmed it."""

from topology import ChainSettings

from gateway.core import handlers
from gateway.core.actions import Forward
from gateway.core.carrier import Entry
from gateway.core.flow import Flow
from gateway.core.inputs import Delivery
from gateway.core.routes import Way
from gateway.core.stranded import GRACE_MS, REMEMBER_MS, Stranded, key_of
from gateway.core.wire import Properties

NOW = 1_800_000_000_000
CHAIN = ChainSettings(prefix="strand", max_level=6, resolution_ms=1000)
NAMES = CHAIN.names


class _Quiet:
    def __init__(self) -> None:
        self.notes: list = []

    def forwarded(self, action) -> None: ...

    def landed(self, forward) -> None: ...

    def batched(self, outcome, messages) -> None: ...

    def late(self, ms) -> None: ...

    def note(self, level, event, **fields) -> None:
        self.notes.append(event)


def entry(n: int, due: int) -> Entry:
    return Entry(f"k.{n}".encode(), Properties.build(message_id=f"m{n}".encode()), b"body-%d" % n, due, NOW * 1000)


def carrier_of(e: Entry, redelivered: bool = False) -> Delivery:
    return Delivery(NAMES.distributor, b"", handlers.next_hop(e), e.body, redelivered)


def flow_with(stranded: Stranded, cancelled=None) -> Flow:
    distributor = handlers.Distributor(CHAIN, 50, cancelled=cancelled)
    flow = Flow(NAMES.distributor, NAMES, distributor, _Quiet(), still_wanted=distributor.still_wanted,
                stranded=stranded)
    flow.publishing_opened(NOW)
    return flow


def released(out) -> list:
    return [p.payload.forward.entry.routing_key for p in out.publish if p.payload.forward.way is Way.DELIVERED]


def held_then_lost(stranded: Stranded, dues) -> Flow:
    """A channel that held these messages, lost at NOW + 100; the new channel consuming at NOW + 500."""
    old = flow_with(stranded)
    for n, due in enumerate(dues):
        assert not old.delivered(n + 1, carrier_of(entry(n, due)), NOW, steady=NOW).publish
    assert old.held == len(dues)
    old.consuming_lost(NOW + 100)
    assert len(stranded) == len(dues)
    new = flow_with(stranded)
    new.consuming_started(NOW + 500, steady=NOW + 500)
    return new


def test_what_a_lost_channel_held_is_released_from_memory_when_due_after_the_grace():
    stranded = Stranded()
    new = held_then_lost(stranded, [NOW + 1_000, NOW + 8_000])
    # due at 1 s, but the broker has GRACE_MS from consuming again to hand it back
    assert new.next_wake() == NOW + 500 + GRACE_MS
    assert not released(new.tick(NOW + 500 + GRACE_MS - 1, steady=NOW + 500 + GRACE_MS - 1))
    out = new.tick(NOW + 500 + GRACE_MS, steady=NOW + 500 + GRACE_MS)
    assert released(out) == [b"k.0"] and not out.ack  # (no delivery of this channel waits for it)
    assert new.next_wake() == NOW + 8_000
    assert not released(new.tick(NOW + 7_999, steady=NOW + 7_999))  # never early
    out2 = new.tick(NOW + 8_000, steady=NOW + 8_000)
    assert released(out2) == [b"k.1"]
    assert "released_from_memory" in new._observer.notes  # type: ignore[attr-defined]
    # confirmed: the broker's copy, handed back later (RabbitMQ 4.3, a minute on), is dropped
    for p in out.publish + out2.publish:
        new.confirmed(p.seq, False, True, NOW + 8_001)
    again = new.delivered(7, carrier_of(entry(0, NOW + 1_000), True), NOW + 60_000, steady=NOW + 60_000)
    assert not again.publish and new.held == 0
    assert again.ack or new.tick(NOW + 60_010, steady=NOW + 60_010).ack  # acknowledged, not published


def test_what_the_broker_hands_back_within_the_grace_is_released_once_from_its_delivery():
    stranded = Stranded()
    new = held_then_lost(stranded, [NOW + 1_000, NOW + 2_000])
    # the broker hands both back at once (every version but 4.3's lost node)
    for tag, n, due in ((1, 0, NOW + 1_000), (2, 1, NOW + 2_000)):
        new.delivered(tag, carrier_of(entry(n, due), True), NOW + 600, steady=NOW + 600)
    assert new.held == 2 and len(stranded) == 0
    out = new.tick(NOW + 5_000, steady=NOW + 5_000)
    assert sorted(released(out)) == [b"k.0", b"k.1"]  # each once, from its delivery
    assert all(p.tags for p in out.publish)


def test_a_release_from_memory_is_remembered_only_once_the_broker_confirmed_it():
    stranded = Stranded()
    new = held_then_lost(stranded, [NOW + 1_000])
    out = new.tick(NOW + 500 + GRACE_MS, steady=NOW + 500 + GRACE_MS)
    assert released(out) == [b"k.0"]
    # the broker hands it back before the confirm: this copy goes on too (a duplicate, not a loss)
    back = new.delivered(9, carrier_of(entry(0, NOW + 1_000), True), NOW + 3_600, steady=NOW + 3_600)
    assert released(back) == [b"k.0"]
    # lost again before the confirm: it waits to be released from memory again
    stranded2 = Stranded()
    lost = held_then_lost(stranded2, [NOW + 1_000])
    assert released(lost.tick(NOW + 500 + GRACE_MS, steady=NOW + 500 + GRACE_MS)) == [b"k.0"]
    lost.consuming_lost(NOW + 3_600)
    assert len(stranded2) == 1
    third = flow_with(stranded2)
    third.consuming_started(NOW + 4_000, steady=NOW + 4_000)
    assert released(third.tick(NOW + 4_000 + GRACE_MS, steady=NOW + 4_000 + GRACE_MS)) == [b"k.0"]


def test_a_message_cancelled_meanwhile_is_not_released_from_memory():
    stranded = Stranded()
    cancelled = {b"k.1"}
    old = flow_with(stranded)
    for n in range(2):
        old.delivered(n + 1, carrier_of(entry(n, NOW + 1_000)), NOW, steady=NOW)
    old.consuming_lost(NOW + 100)
    new = flow_with(stranded, cancelled=lambda e, where: e.routing_key in cancelled)
    new.consuming_started(NOW + 500, steady=NOW + 500)
    assert released(new.tick(NOW + 500 + GRACE_MS, steady=NOW + 500 + GRACE_MS)) == [b"k.0"]
    assert len(stranded) == 1  # k.0 awaits its confirm; k.1 is the broker's copy's to drop


def test_a_stepped_wall_clock_releases_nothing_from_memory_early():
    stranded = Stranded()
    new = held_then_lost(stranded, [NOW + 8_000])
    # 4 s of real time, the wall clock stepped 5 s forward: not due
    assert not released(new.tick(NOW + 9_000, steady=NOW + 4_000))
    assert released(new.tick(NOW + 13_000, steady=NOW + 8_000)) == [b"k.0"]


def test_stopping_forgets_what_the_broker_still_holds():
    stranded = Stranded()
    new = held_then_lost(stranded, [NOW + 1_000])
    new.drain(NOW + 600)
    assert len(stranded) == 0 and not released(new.tick(NOW + 10_000, steady=NOW + 10_000))


def test_released_messages_are_forgotten_after_a_while_and_beyond_a_bound():
    s = Stranded()
    f = Forward("x", b"k", Properties.build(), b"b", Way.DELIVERED, not_before_ms=NOW, entry=entry(0, NOW))
    s.lost([(0, f)], 0)
    s.resumed(0)
    [out] = s.due(GRACE_MS, NOW)
    s.confirmed(out.entry, GRACE_MS)
    assert s.claim(entry(0, NOW))
    s.confirmed(entry(1, NOW), GRACE_MS + REMEMBER_MS + 1)  # (a later confirm forgets what is older)
    assert not s.claim(entry(0, NOW)) and s.claim(entry(1, NOW))
    assert key_of(entry(0, NOW)) != key_of(entry(0, NOW + 1)) != key_of(entry(1, NOW))


def test_a_release_not_confirmed_when_the_channel_was_lost_is_released_from_memory_too():
    """It may never have reached the broker, which keeps its carrier back as it keeps the held
    ones: released again after the grace (a duplicate if the first one had landed)."""
    stranded = Stranded()
    old = flow_with(stranded)
    sent = old.delivered(1, carrier_of(entry(0, NOW)), NOW, steady=NOW)
    assert released(sent) == [b"k.0"] and old.held == 0  # due: published at once, not confirmed
    old.consuming_lost(NOW + 100)
    assert len(stranded) == 1
    new = flow_with(stranded)
    new.consuming_started(NOW + 500, steady=NOW + 500)
    assert released(new.tick(NOW + 500 + GRACE_MS, steady=NOW + 500 + GRACE_MS)) == [b"k.0"]
    # one confirmed before the loss is not
    stranded2 = Stranded()
    done = flow_with(stranded2)
    [pub] = done.delivered(1, carrier_of(entry(0, NOW)), NOW, steady=NOW).publish
    done.confirmed(pub.seq, False, True, NOW + 10)
    done.consuming_lost(NOW + 100)
    assert len(stranded2) == 0
