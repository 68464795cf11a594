"""A lone message's shorter path (pure): a message due within `hold_within_ms` goes from
check-in (or back from meditation, or a retry) straight to the distributor, which holds it
until due, instead of through the chain's queues; anything due later takes the chain as
before, and so does more as the rate rises (about `hold_messages` held at once). Against
brokers, at its worst moments: tests/test_shorter_path_e2e.py."""

import random

from topology import ChainSettings

from gateway.core import carrier, handlers, retries
from gateway.core.actions import Enqueue
from gateway.core.carrier import Batcher, Entry
from gateway.core.flow import Flow
from gateway.core.inputs import Delivery
from gateway.core.routes import Way
from gateway.core.shorter_path import ShorterPath
from gateway.core.wire import Properties, Table, long, longstr

NOW = 1_800_000_000_000
CHAIN = ChainSettings(prefix="short", max_level=6, resolution_ms=1000)
NAMES = CHAIN.names


def message(delay_ms: int) -> Delivery:
    return Delivery(NAMES.check_in, b"orders.1", Properties.build(
        message_id=b"m1", headers=Table([long("x-delay", delay_ms)])), b"body")


def test_a_message_due_within_the_hold_goes_straight_to_the_distributor():
    check_in = handlers.CheckIn(CHAIN, 50, wait_ms=200, hold_within_ms=10_000)
    for delay in (0, 1, 2_000, 9_999, 10_000):
        [sent] = check_in(message(delay), NOW)
        assert isinstance(sent, Enqueue) and (sent.exchange, sent.way) == (NAMES.distributor, Way.DISTRIBUTOR), delay
        assert sent.send_by_ms == NOW + delay - 50  # it waits for company at most until the distributor's lead
    for delay in (10_001, 40_000):
        [sent] = check_in(message(delay), NOW)
        assert isinstance(sent, Enqueue) and sent.way is Way.CHAIN, delay


def test_without_the_hold_only_what_is_due_within_about_a_unit_skips_the_chain():
    check_in = handlers.CheckIn(CHAIN, 50, wait_ms=200, hold_within_ms=0)
    ways = {delay: check_in(message(delay), NOW)[0].way for delay in (0, 500, 5_000, 9_000)}
    assert ways == {0: Way.DISTRIBUTOR, 500: Way.DISTRIBUTOR, 5_000: Way.CHAIN, 9_000: Way.CHAIN}


def test_a_retry_and_a_return_from_meditation_take_the_shorter_path_too():
    policy = retries.Policy(base_ms=2_000, factor=1, cap_ms=2_000, attempts=3, jitter=0)
    retry = handlers.Retry(CHAIN, 50, (policy,), random.Random(1), hold_within_ms=10_000)
    failed = Delivery(NAMES.retry, b"jobs", Properties.build(headers=Table([longstr(retries.QUEUE, b"jobs")])),
                      b"job")
    [sent] = retry(failed, NOW)
    assert isinstance(sent, Enqueue) and sent.way is Way.DISTRIBUTOR and sent.entry.exchange == ""
    returning = handlers.Returning(CHAIN, 50, hold_within_ms=10_000)
    back = [Entry(b"k", Properties.build(), b"x", NOW + due, NOW * 1000 + due) for due in (3_000, 30_000)]
    sent_on = returning(Delivery(NAMES.returning, b"", carrier.properties(back), carrier.pack(back)), NOW)
    assert [a.way for a in sent_on] == [Way.DISTRIBUTOR, Way.CHAIN]


def test_the_distributor_holds_what_came_straight_for_up_to_a_minute():
    """What the shorter path sends may be due up to 60 s later (the setting's bound): the
    distributor holds it rather than sending it back into the chain."""
    distributor = handlers.Distributor(CHAIN, 50)
    e = Entry(b"k", Properties.build(), b"x", NOW + 60_000, NOW * 1000)
    [release] = distributor(Delivery(NAMES.distributor, b"", handlers.next_hop(e), e.body), NOW)
    assert release.way is Way.DELIVERED and release.not_before_ms == NOW + 60_000


def test_as_the_rate_rises_only_what_is_due_sooner_takes_it():
    path = ShorterPath(10_000, 1000)
    at_ten = [path.takes(9_000, NOW + n * 100) for n in range(30)]  # 10 a second
    assert all(at_ten)
    # 1,000 a second for a second: from then on, only what is due within a second
    busy = NOW + 3_000
    [path.takes(500, busy + n) for n in range(1000)]
    assert not path.takes(2_000, busy + 1_000) and path.takes(900, busy + 1_001)
    assert path.takes(9_000, busy + 5_000)  # quiet again: the whole hold
    assert not ShorterPath(0, 1000).takes(0, NOW)  # off


class _Quiet:
    def forwarded(self, action) -> None: ...

    def landed(self, forward) -> None: ...

    def batched(self, outcome, messages) -> None: ...

    def late(self, ms) -> None: ...

    def note(self, level, event, **fields) -> None: ...


def test_no_step_of_the_wall_clock_after_a_message_is_held_releases_it_earlier():
    """The distributor holds on a steady clock: its wall clock stepped 5 s forward while it
    holds a message due in 8 s releases nothing early (as the real time passes, not as the
    clock says); stepped back, it releases nothing before its wall due time either."""
    flow = Flow(NAMES.distributor, NAMES, handlers.Distributor(CHAIN, 50), _Quiet())
    flow.publishing_opened(NOW)
    e = Entry(b"k", Properties.build(), b"x", NOW + 8_000, NOW * 1000)
    out = flow.delivered(1, Delivery(NAMES.distributor, b"", handlers.next_hop(e), e.body), NOW, steady=NOW)
    assert not out.publish and flow.held == 1 and flow.next_wake() == NOW + 8_000
    # 3 s of real time pass, then the wall clock steps 5 s forward: it says the message is due
    out = flow.tick(NOW + 3_000 + 5_000, steady=NOW + 3_000)
    assert not out.publish and flow.held == 1 and flow.next_wake() == NOW + 8_000 + 5_000
    out = flow.tick(NOW + 8_000 + 5_000, steady=NOW + 8_000)  # 8 s of real time: released
    assert [p.payload.forward.way for p in out.publish] == [Way.DELIVERED] and flow.held == 0
    # stepped back 2 s while held: released when the wall clock too says it is due
    back = Flow(NAMES.distributor, NAMES, handlers.Distributor(CHAIN, 50), _Quiet())
    back.publishing_opened(NOW)
    back.delivered(1, Delivery(NAMES.distributor, b"", handlers.next_hop(e), e.body), NOW, steady=NOW)
    assert not back.tick(NOW + 6_000, steady=NOW + 8_000).publish and back.held == 1
    assert [p.payload.forward.way for p in back.tick(NOW + 8_000, steady=NOW + 10_000).publish] == [Way.DELIVERED]


def test_what_the_distributor_holds_never_takes_the_room_of_what_falls_due():
    """Held deliveries keep their places of the prefetch: once they take all but a tenth of
    it, a message due later than two units goes back into the chain instead of being held
    (it comes back about a unit before it is due), so that what falls due always finds room."""
    assert handlers.crowded_at(10) == 9 and handlers.crowded_at(10_000) == 9_000 and handlers.crowded_at(0) is None
    distributor = handlers.Distributor(CHAIN, 50)
    flow = Flow(NAMES.distributor, NAMES, distributor, _Quiet(), prefetch=10)
    distributor.crowded = lambda: flow.ledger.holding >= handlers.crowded_at(10)
    flow.publishing_opened(NOW)

    def arrive(tag: int, due: int):
        e = Entry(f"k{tag}".encode(), Properties.build(), b"x", due, NOW * 1000)
        return flow.delivered(tag, Delivery(NAMES.distributor, b"", handlers.next_hop(e), e.body), NOW)
    for tag in range(1, 10):
        assert not arrive(tag, NOW + 8_000).publish
    assert flow.ledger.holding == 9 and flow.held == 9
    [back] = [p.payload.forward for p in arrive(10, NOW + 8_000).publish]
    assert back.way is Way.RECHECK and flow.ledger.holding == 9
    assert not arrive(11, NOW + 2_000).publish and flow.ledger.holding == 10  # (due within two units: held)
    [due] = [p.payload.forward for p in arrive(12, NOW).publish]
    assert due.way is Way.DELIVERED


def test_what_goes_to_be_held_travels_in_carriers_of_one_due_second():
    """A carrier is acknowledged once its last message is released, and after a crash of the
    distributor the broker hands it back whole: so what goes to the distributor to be held
    travels with what is due within the same second only, and one crash repeats about a
    second of releases, not everything the carrier held."""
    check_in = handlers.CheckIn(CHAIN, 50, wait_ms=200, hold_within_ms=10_000)
    flow = Flow(NAMES.check_in, NAMES, check_in, _Quiet(), Batcher(100, 10**6, 200))
    flow.publishing_opened(NOW)
    for tag, delay in enumerate((2_100, 5_100, 2_200, 2_900, 5_999), start=1):
        assert not flow.delivered(tag, message(delay), NOW).publish  # (waiting for company)
    sent = [p.payload.forward for p in flow.tick(NOW + 200).publish]
    dues = sorted(sorted(e.due_ms - NOW for e in handlers.entries(Delivery(f.exchange, f.routing_key, f.props, f.body)))
                  for f in sent)
    assert all(f.way is Way.DISTRIBUTOR for f in sent) and dues == [[2_100, 2_200, 2_900], [5_100, 5_999]]
