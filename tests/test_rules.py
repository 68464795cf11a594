"""Group cancels as rules (gateway/core/rules.py, gateway/core/selection.py), pure: the public
header vocabulary read strictly (a typo never widens a rule), the record read back as it was
written, the index finding every rule that may select a message, withdrawals and the
window, and check-in recording a rule behind the messages before it (a fence)."""

import datetime
from typing import List, Optional

import pytest
from hypothesis import given, settings, strategies as st

from topology import ChainSettings
from topology.routing import topic_matches

from gateway.commands.parked import Parked, destination
from gateway.core import cancels, envelope, handlers, rules, selection
from gateway.core.actions import Forward
from gateway.core.carrier import Batcher, Entry
from gateway.core.flow import Flow
from gateway.core.inputs import Delivery
from gateway.core.routes import Way
from gateway.core.selection import Selection
from gateway.core.wire import Properties, Table, boolean, long, longstr, longstrs, table

from .support import examples

NOW = 1_800_000_000_000
CHAIN = ChainSettings(prefix="r", max_level=4, resolution_ms=1000)


def asked(*fields) -> rules.Request:
    found = rules.requested(Table(list(fields)))
    assert isinstance(found, rules.Request)
    return found


def refused(*fields) -> str:
    with pytest.raises(cancels.BadCancel) as caught:
        rules.requested(Table(list(fields)))
    return str(caught.value)


# -- the vocabulary ----------------------------------------------------------------------------
def test_the_vocabulary_reads_every_filter_in_the_types_clients_send():
    r = asked(longstr("x-cancel-key", "orders.42.#"), longstr("x-cancel-id", b"order-42*"),
              longstr("x-cancel-due-after", b"1800000000000"), long("x-cancel-due-before", NOW + 5),
              table("x-cancel-header", Table([long("customer", 42), boolean("vip", True)])),
              boolean("x-cancel-retries", True), longstr("x-cancel-rule", "gdpr-42"))
    assert r.select == Selection((b"order-42*",), "orders.42.#", NOW, NOW + 5, (("customer", "42"), ("vip", "true")),
                                 True)
    assert r.name == b"gdpr-42" and not r.everything
    assert asked(longstrs("x-cancel-id", [b"a", b"b"])).select.ids == (b"a", b"b")
    when = datetime.datetime(2027, 1, 1, tzinfo=datetime.timezone.utc)
    assert asked(rules.wire.TableField(b"x-cancel-due-after", b"T", int(when.timestamp()).to_bytes(8, "big"))
                 ).select.due_after_ms == int(when.timestamp()) * 1000
    assert asked(boolean("x-cancel-all", True)).everything


@pytest.mark.parametrize("fields,why", [
    ([longstr("x-cancel-kye", "orders.#")], "unknown rule header 'x-cancel-kye'"),
    ([longstr("x-cancel-rule", "only-a-name")], "a rule without a filter would cancel every message"),
    ([boolean("x-cancel-all", False)], "a rule without a filter"),
    ([boolean("x-cancel-all", True), longstr("x-cancel-key", "a")], "x-cancel-all with a filter"),
    ([longstr("x-cancel-id", "*")], "use x-cancel-all: true to mean it"),
    ([longstr("x-cancel-id", "@*")], "is not a handle"),
    ([longstrs("x-cancel-id", [b"a", b"@abc"])], "is not a handle"),
    ([longstr("x-cancel-key", "#")], "selects every routing key"),
    ([longstr("x-cancel-key", "#.#.#")], "selects every routing key"),
    ([longstr("x-cancel-key", "a." * 128)], "255 bytes"),
    ([longstr("x-cancel-due-before", "\u00b2")], "must be a time in epoch milliseconds"),
    ([longstr("x-cancel-due-before", "9" * 25)], "must be a time in epoch milliseconds"),
    ([long("x-cancel-due-before", 2**63 - 1), longstr("x-cancel-due-after", "1.5")], "must be a time"),
    ([rules.wire.TableField(b"x-cancel-due-after", b"d", b"\x3f\xf0" + bytes(6))], "must be a time"),
    ([table("x-cancel-header", Table([long(f"h{n}", n) for n in range(33)]))], "at most 32 headers"),
    ([table("x-cancel-header", Table([longstr("h", "v" * 1025)]))], "over 1024 bytes"),
    ([table("x-cancel-header", Table([table("h", Table([long("a", 1)]))]))], "must be text or a number"),
    ([longstr("x-cancel-key", "a"), longstr("x-cancel-key", "b")], "given twice"),
    ([longstr("x-cancel-due-after", "tomorrow")], "x-cancel-due-after must be a time in epoch milliseconds"),
    ([long("x-cancel-due-before", -5)], "x-cancel-due-before must be a time"),
    ([long("x-cancel-key", 42)], "x-cancel-key must be text"),
    ([longstr("x-cancel-key", b"\xff")], "not UTF-8"),
    ([longstr("x-cancel-retries", "maybe")], "x-cancel-retries must be true or false"),
    ([longstr("x-cancel-header", "customer=42")], "x-cancel-header must be a table"),
    ([longstrs("x-cancel-id", [b"x"] * 1001)], "1 to 1000 ids"),
    ([longstr("x-cancel-withdraw", "r1"), longstr("x-cancel-key", "a")], "x-cancel-withdraw takes no filter"),
    ([longstr("x-cancel-rule", "x" * 256), longstr("x-cancel-key", "a")], "1 to 255 bytes"),
])
def test_what_cannot_be_read_exactly_is_refused_never_widened(fields, why):
    assert why in refused(*fields)


def test_a_filter_that_selects_everything_needs_x_cancel_all_and_then_means_it():
    assert asked(longstr("x-cancel-key", "#.#"), boolean("x-cancel-all", True)) == rules.Request(Selection(), True)
    assert asked(longstr("x-cancel-key", "a.#.#.b")).select.key == "a.#.b"  # (stored normalised)
    assert asked(longstr("x-cancel-due-before", " 1800000000000 ")).select.due_before_ms == NOW


@settings(max_examples=examples(500))
@given(st.lists(st.tuples(st.sampled_from(rules.VOCABULARY + ("x-cancel-other",)),
                          st.sampled_from([b"S", b"A", b"F", b"l", b"t", b"x", b"d", b"D", b"T", b"V", b"I"]),
                          st.binary(max_size=24)), max_size=5))
def test_any_table_is_read_as_a_rule_or_refused_with_a_reason_never_anything_else(fields):
    """Whatever a client sends (any type, any bytes, truncated values), reading it either gives
    a rule or raises BadCancel: nothing else can reach the consumer."""
    table_ = Table([rules.wire.TableField(name.encode(), kind, raw) for name, kind, raw in fields])
    try:
        found = rules.requested(table_)
    except cancels.BadCancel as exc:
        assert str(exc) and len(str(exc)) <= 400
        return
    assert isinstance(found, (rules.Request, rules.Withdrawing))


def test_a_withdrawal_names_its_rule_and_nothing_else_is_a_rule():
    assert rules.requested(Table([longstr("x-cancel-withdraw", "gdpr-42")])) == rules.Withdrawing(b"gdpr-42")
    assert rules.requested(Table([longstr("x-cancel-withdraw", "a"), longstr("x-cancel-rule", "a")])) == \
        rules.Withdrawing(b"a")
    assert not rules.is_rule(Table([longstr("x-cancelled", "no"), longstr("customer", "x")]))
    assert rules.is_rule(Table([longstr("x-cancel-anything", "yes")]))  # (then refused, not ignored)


# -- records -----------------------------------------------------------------------------------
@settings(max_examples=examples(200))
@given(st.lists(st.binary(min_size=1, max_size=40), max_size=3), st.one_of(st.none(), st.text(max_size=30)),
       st.one_of(st.none(), st.integers(0, 2**62)), st.one_of(st.none(), st.integers(0, 2**62)),
       st.lists(st.tuples(st.text(min_size=1, max_size=10), st.text(max_size=10)), max_size=3,
                unique_by=lambda t: t[0]),
       st.booleans(), st.integers(0, 2**62), st.one_of(st.none(), st.integers(0, 2**50)))
def test_a_rules_record_reads_back_as_it_was_written(ids, key, after, before, headers, retries, read_us, arrived):
    ids = [i for i in ids if i != b"*" and not i.startswith(b"@")]
    key = None if key is None or selection.selects_every_key(key) else selection.normalized(key)
    select = Selection(tuple(ids), key, after, before, tuple(sorted(headers)), retries)
    everything = select.empty
    rule = rules.Rule(b"r-1", select, cancels.Time(read_us, arrived), everything)
    props, body = rules.record(rule)
    assert rules.read_record(props.headers, body) == rule
    # RabbitMQ 3.10's streams drop array and table header values: the filter is in the body
    scalars = Table([e for e in props.headers.entries if e.kind not in (b"A", b"F")])
    assert rules.read_record(scalars, body) == rule
    assert cancels.read_record(props.headers) is None  # an earlier version's reader skips it


def test_a_rule_record_that_lost_its_filter_cancels_nothing_and_still_counts_as_recorded():
    rule = rules.Rule(b"narrow", Selection(ids=(b"u-1",), key="hx.#", headers=(("h", "1"),)), cancels.Time(T))
    props, body = rules.record(rule)
    for damaged in (b"", body[:-3], body[:4] + b"\x00\x00\x00\x05abcde", b"DGR9" + body[4:]):
        found = rules.read_record(props.headers, damaged)
        assert isinstance(found, rules.Refused) and found.name == b"narrow", damaged
    # the first format, as 3.10 kept it: the key without its header and id filters would be
    # wider; with no filter at all, it is refused (it was never applied wider than that)
    first = Table([longstr("x-gateway-rule", "old"), long("x-gateway-cancelled-us", T),
                   longstr("x-cancel-key", "hx.#")])
    assert rules.read_record(first) == rules.Rule(b"old", Selection(key="hx.#"), cancels.Time(T))
    lost = Table([longstr("x-gateway-rule", "old-ids"), long("x-gateway-cancelled-us", T)])
    refused_ = rules.read_record(lost)
    assert isinstance(refused_, rules.Refused) and "without a filter" in refused_.why
    held = rules.Rules(window_ms=10**9)
    assert held.add(refused_, NOW) and not len(held) and held.holds(b"old-ids", T)


def test_an_unnamed_rule_read_again_after_a_crash_is_one_rule():
    """Its name comes from its filter, not its read time: recorded twice, it is held once."""
    select = Selection(key="orders.42.#")
    name = rules.default_name(select, False)
    assert name == rules.default_name(Selection(key="orders.42.#"), False) != rules.default_name(
        Selection(key="orders.43.#"), False)
    assert name.startswith(b"rule-") and len(name) <= rules.MAX_NAME_BYTES
    held = rules.Rules(window_ms=10**9)
    held.add(rules.Rule(name, select, cancels.Time(T)), NOW)
    held.add(rules.Rule(name, select, cancels.Time(T + 9)), NOW)
    assert [r.at.read_us for r in held.live] == [T + 9]


def test_withdrawals_and_tallies_read_back_and_are_no_rule():
    w = rules.Withdrawal(b"gdpr-42", cancels.Time(5, 6))
    assert rules.read_record(rules.withdrawal_record(w).headers) == w
    tally = rules.tally_record(b"gdpr-42", b"g" * 16, 7).headers
    assert rules.read_tally(tally) == (b"gdpr-42", b"g" * 16, 7) and rules.read_record(tally) is None
    assert rules.read_record(cancels.record(b"id", cancels.Time(5)).headers) is None
    assert rules.tallies([(b"a", b"g1", 3), (b"a", b"g1", 5), (b"a", b"g2", 2), (b"b", b"g1", 1)]) == {b"a": 7, b"b": 1}


def test_a_rule_too_big_for_one_record_is_refused():
    big = Selection(tuple(b"%0250d" % n for n in range(400)))
    with pytest.raises(cancels.BadCancel, match="at most 64000"):
        rules.record(rules.Rule(b"big", big, cancels.Time(1)))


# -- the rules a gateway holds -----------------------------------------------------------------
T = NOW * 1000  # read times (us) near now: inside the window


def entry(key: bytes, mid: Optional[bytes] = None, read_us: Optional[int] = T, due: int = NOW, retry: bool = False,
          headers: Optional[Table] = None) -> Entry:
    values = {"headers": headers} if headers is not None else {}
    if mid is not None:
        values["message_id"] = mid
    return Entry(key, Properties.build(**values), b"b", due, read_us, "" if retry else None)


def first(held: rules.Rules, e: Entry) -> Optional[bytes]:
    found = held.first(e.user.get("message_id"), e.routing_key, e.due_ms, e.exchange == "",
                       lambda: e.user.headers,
                       lambda: cancels.handle(e.accepted_us, cancels.checksum(e.routing_key, e.user.raw,
                                                                              e.body)).encode(),
                       e.accepted_us, None if e.accepted_us is None else cancels.Time(e.accepted_us))
    return None if found is None else found.name


SELECTIONS = [Selection(key="orders.42.#"), Selection(key="orders.*.reminder"), Selection(key="#.reminder"),
              Selection(ids=(b"order-7",)), Selection(ids=(b"order-8*",)), Selection(key="orders.42.#", ids=(b"x",)),
              Selection(headers=(("customer", "9"),)), Selection(due_before_ms=NOW - 1), Selection(retries=True),
              Selection(key=""), Selection(key="*.42.#"), Selection(key="*.*"), Selection(key="*.#"),
              Selection(key="#.*.#.reminder"), Selection(ids=(b"order-7", b"x*")), Selection(ids=(b"o*",)),
              Selection(headers=(("vip", "TRUE"),)), Selection(key="*.*.*", retries=True),
              Selection(key="orders.42.reminder", due_after_ms=NOW), Selection(ids=(b"orders.42.reminder",))]
KEYS = [b"orders.42.reminder", b"orders.421.reminder", b"orders.42", b"orders", b"x.reminder", b"",
        b"orders.7.reminder", b"a.42", b"..", b"reminder.reminder.reminder"]


@settings(max_examples=examples(500))
@given(st.lists(st.sampled_from(range(len(SELECTIONS))), max_size=8),
       st.sampled_from(KEYS), st.sampled_from([None, b"order-7", b"order-81", b"x", b"xy"]), st.booleans(),
       st.sampled_from([None, 9, 10]), st.sampled_from([None, True, "true"]), st.sampled_from([0, 1, 3]))
def test_the_index_finds_exactly_the_rules_a_full_scan_finds(chosen, key, mid, retry, customer, vip, dropped):
    """Rules added, some withdrawn or forgotten again: `first` finds a rule exactly when a scan
    of every live rule finds one, and only one the scan finds."""
    held = rules.Rules(window_ms=60_000)
    for n, i in enumerate(chosen):
        at = T + 200 + n if n % 4 else (NOW - 30_000) * 1000 + n  # every fourth: forgotten below
        assert held.add(rules.Rule(f"r{n % 5}".encode(), SELECTIONS[i], cancels.Time(at)), NOW)
    if dropped:
        held.add(rules.Withdrawal(f"r{dropped}".encode(), cancels.Time(T + 199 + dropped)), NOW)
    held.prune(NOW + 31_000)
    values = ([long("customer", customer)] if customer is not None else []) + (
        [boolean("vip", vip) if isinstance(vip, bool) else longstr("vip", vip)] if vip is not None else [])
    e = entry(key, mid, retry=retry, headers=Table(values))
    found = first(held, e)
    scan = [r.name for r in held.live if r.came_after(cancels.Time(T)) and r.select.matches(
        mid, key, e.due_ms, retry, lambda: e.user.headers, lambda: b"@none")]
    assert (found is None) == (not scan) and (found is None or found in scan)


def test_ten_thousand_rules_are_added_without_rebuilding_and_a_message_meets_only_its_own():
    """Adding is the rule's own index (no rebuild of all: 10,000 were quadratic before), and a
    message is compared with the rules that may select it, not with every wildcard-first one."""
    held = rules.Rules(window_ms=10**9)
    for n in range(rules.MAX_LIVE):
        held.add(rules.Rule(f"order-{n}".encode(), Selection(key=f"*.order-{n}.#"), cancels.Time(T + 1 + n)), NOW)
    assert len(held) == rules.MAX_LIVE and "at most 10000" in (held.room_for(Selection(key="x.#")) or "")
    assert len(held.candidates(None, b"eu.order-17.created", T, False, Table)) == 1
    assert first(held, entry(b"eu.order-17.created")) == b"order-17"
    assert first(held, entry(b"eu.order-x.created")) is None
    held.add(rules.Withdrawal(b"order-17", cancels.Time(T + 10**6)), NOW)
    assert first(held, entry(b"eu.order-17.created")) is None and held.room_for(Selection(key="x.#")) is None


def test_a_rule_cancels_only_what_was_taken_in_before_it():
    held = rules.Rules(window_ms=10**9)
    held.add(rules.Rule(b"r", Selection(key="orders.42.#"), cancels.Time(T + 500)), NOW)
    assert first(held, entry(b"orders.42.a", read_us=T + 499)) == b"r"
    assert first(held, entry(b"orders.42.a", read_us=T + 500)) == b"r"  # (the same read time: a cancel wins)
    assert first(held, entry(b"orders.42.a", read_us=T + 501)) is None  # published after it: a reschedule
    assert first(held, entry(b"orders.421.a", read_us=T + 1)) is None  # a bystander with a near key
    before_read_times = entry(b"orders.42.a", read_us=None)  # in a queue since before read times: before any rule
    assert held.first(None, b"orders.42.a", NOW, False, lambda: Table(), lambda: b"", None, None) is not None
    assert before_read_times.accepted_us is None


def test_stamps_order_a_rule_and_a_message_where_both_have_one():
    held = rules.Rules(window_ms=10**9)
    assert held.add(rules.Rule(b"r", Selection(key="#"), cancels.Time(read_us=T + 900, arrived_ms=50)), NOW)
    found = held.first(None, b"k", NOW, False, Table, lambda: b"", T + 100, cancels.Time(T + 100, arrived_ms=51))
    assert found is None  # stamped after the rule, though read before it by another gateway
    assert held.first(None, b"k", NOW, False, Table, lambda: b"", T + 950,
                      cancels.Time(T + 950, arrived_ms=49)) is not None


def test_a_withdrawal_ends_the_rules_of_its_name_recorded_before_it_and_the_window_forgets():
    held = rules.Rules(window_ms=60_000)
    held.add(rules.Rule(b"a", Selection(key="#"), cancels.Time(NOW * 1000)), NOW)
    held.add(rules.Rule(b"b", Selection(key="x"), cancels.Time(NOW * 1000 + 1)), NOW)
    held.add(rules.Withdrawal(b"a", cancels.Time(NOW * 1000 + 2)), NOW)
    assert [r.name for r in held.live] == [b"b"] and held.withdrawn == 1
    assert held.holds(b"a", NOW * 1000 + 2) and not held.holds(b"a", NOW * 1000 + 3)
    held.add(rules.Rule(b"a", Selection(key="y"), cancels.Time(NOW * 1000 + 3)), NOW)  # a new rule of the name
    assert [r.name for r in held.live] == [b"b", b"a"]
    assert not held.add(rules.Rule(b"c", Selection(key="z"), cancels.Time((NOW - 61_000) * 1000)), NOW)
    assert held.prune(NOW + 61_000) == 2 and not len(held) and held.newest_read_us == NOW * 1000 + 3


def test_a_rule_recorded_again_after_a_crash_is_one_rule_the_later_record():
    """A gateway killed between a rule's record and its acknowledgement: the next reads and
    records it again. `pending rules` shows it once, and what it cancels is the later fence's."""
    held = rules.Rules(window_ms=60_000)
    first = rules.Rule(b"customer-42", Selection(key="orders.42.#"), cancels.Time(NOW * 1000))
    again = rules.Rule(b"customer-42", Selection(key="orders.42.#"), cancels.Time(NOW * 1000 + 500))
    other = rules.Rule(b"customer-42", Selection(key="orders.43.#"), cancels.Time(NOW * 1000 + 600))
    held.add(first, NOW)
    held.add(again, NOW)
    held.add(first, NOW)  # (a reader that meets the records again: the later one stays)
    assert held.live == (again,)
    held.add(other, NOW)  # the same name for another filter: a rule of its own
    assert held.live == (again, other)


# -- check-in records a rule like a cancel by id ----------------------------------------------
class Quiet:
    def forwarded(self, action) -> None: ...

    def landed(self, forward) -> None: ...

    def batched(self, outcome, messages) -> None: ...

    def late(self, ms) -> None: ...

    def note(self, level, event, **fields) -> None: ...


def test_check_in_records_a_rule_behind_the_messages_before_it_and_parks_a_bad_one():
    check_in = handlers.CheckIn(CHAIN, 50, wait_ms=200)
    check_in.recorded = {}
    flow = Flow(CHAIN.names.check_in, CHAIN.names, check_in, Quiet(), Batcher(10, 10**6, 200))
    flow.publishing_opened(NOW)
    message = Delivery(CHAIN.names.check_in, b"orders.42.a", Properties.build(
        message_id=b"m", headers=Table([long("x-delay", 5000)])), b"x")
    rule = Delivery(CHAIN.names.rules, b"", Properties.build(message_id=b"auto-set-by-a-client", headers=Table([
        longstr("x-cancel-key", "orders.42.#"), longstr("x-cancel-rule", "gdpr")])), b"")
    out = flow.delivered(1, message, NOW)
    out2 = flow.delivered(2, rule, NOW + 1)
    published: List[Forward] = [p.payload.forward for p in out.publish + out2.publish]
    # the message goes on at once (the rule closes its carrier); the rule's record waits for its ack
    assert [f.way for f in published] == [Way.CHAIN]
    assert check_in.recorded == {("rule", b"gdpr"): check_in.recorded[("rule", b"gdpr")]}
    out = flow.confirmed(max(p.seq for p in out.publish + out2.publish), True, True, NOW + 2)
    assert out.ack == [(1, True)] and out.sync  # every delivery before it acknowledged: a round trip, then
    out = flow.synced(NOW + 11)
    [record] = [p.payload.forward for p in out.publish]
    found = rules.read_record(record.props.headers, record.body)
    assert record.way is Way.CANCEL and isinstance(found, rules.Rule) and found.name == b"gdpr"
    assert found.select == Selection(key="orders.42.#")  # the message_id a client set is not a filter
    bad = Delivery(CHAIN.names.rules, b"", Properties.build(headers=Table([longstr("x-cancel-kye", "a")])), b"")
    [parked] = check_in(bad, NOW)
    assert isinstance(parked, Forward) and parked.way is Way.PARKED and "x-cancel-kye" in (parked.reason or "")
    assert envelope.Inside(parked.props).exchange == CHAIN.names.rules  # replayed: back to the rules, never check-in
    assert destination(Parked(1, parked.props, parked.body, parked.routing_key), CHAIN.names)[0] == CHAIN.names.rules


def test_a_rule_sent_to_the_exchange_of_cancels_by_id_is_refused():
    """Cancelling one id is a right apart from cancelling groups: a rule on `<prefix>.cancel`
    is parked (marked as a cancel: a replay sends it back there), and records nothing."""
    check_in = handlers.CheckIn(CHAIN, 50)
    for headers in (Table([longstr("x-cancel-id", "@*")]), Table([boolean("x-cancel-all", True)]),
                    Table([longstr("x-cancel-withdraw", "gdpr")])):
        [parked] = check_in(Delivery(CHAIN.names.cancel, b"", Properties.build(message_id=b"m", headers=headers),
                                     b""), NOW)
        assert isinstance(parked, Forward) and parked.way is Way.PARKED
        assert f"goes to {CHAIN.names.rules!r}" in (parked.reason or "")
        assert envelope.Inside(parked.props).exchange == CHAIN.names.cancel
        assert destination(Parked(1, parked.props, parked.body, parked.routing_key), CHAIN.names)[0] == \
            CHAIN.names.cancel


def test_what_every_message_is_compared_with_is_bounded():
    """At most MAX_BROAD rules that every message meets (an id prefix, retries, due times or key
    wildcards alone), and MAX_SHARED in the bucket of one id, word or header value: beyond,
    check-in refuses the rule with the reason (a word pattern only once every word is full)."""
    held = rules.Rules(window_ms=10**9)
    broad = [Selection(due_before_ms=NOW + n) for n in range(rules.MAX_BROAD)]
    for n, s in enumerate(broad):
        assert held.room_for(s) is None
        held.add(rules.Rule(f"due-{n}".encode(), s, cancels.Time(T + n)), NOW)
    for s in (Selection(due_after_ms=1), Selection(ids=(b"order-*",)), Selection(key="*.#"), Selection(retries=True)):
        assert f"at most {rules.MAX_BROAD}" in (held.room_for(s) or ""), s
    assert held.room_for(Selection(key="orders.#")) is None  # (a word: another index)
    for n in range(2 * rules.MAX_SHARED):
        s = Selection(key="orders.*.reminder", due_after_ms=n)
        assert held.room_for(s) is None
        held.add(rules.Rule(f"w-{n}".encode(), s, cancels.Time(T + 1000 + n)), NOW)
    assert "'orders', 'reminder'" in (held.room_for(Selection(key="orders.#.reminder")) or "")
    assert held.room_for(Selection(key="orders.42.reminder")) is None  # ('42' has room)
    for n in range(rules.MAX_SHARED):
        held.add(rules.Rule(f"id-{n}".encode(), Selection(ids=(b"job-7",), due_after_ms=n), cancels.Time(T + n)), NOW)
    assert "'job-7'" in (held.room_for(Selection(ids=(b"job-7", b"job-8"))) or "")
    held.add(rules.Withdrawal(b"due-0", cancels.Time(T + 10**6)), NOW)
    assert held.room_for(Selection(due_after_ms=1)) is None


def test_check_in_refuses_a_rule_beyond_the_live_limit_but_not_a_withdrawal():
    held = rules.Rules(window_ms=10**9)
    for n in range(rules.MAX_LIVE):
        held.add(rules.Rule(f"r{n}".encode(), Selection(ids=(f"id-{n}".encode(),)), cancels.Time(T + n)), NOW)
    check_in = handlers.CheckIn(CHAIN, 50, held_rules=held)
    [parked] = check_in(Delivery(CHAIN.names.rules, b"", Properties.build(headers=Table([
        longstr("x-cancel-key", "a.#")])), b""), NOW)
    assert parked.way is Way.PARKED and f"at most {rules.MAX_LIVE}" in (parked.reason or "")
    [recorded] = check_in(Delivery(CHAIN.names.rules, b"", Properties.build(headers=Table([
        longstr("x-cancel-withdraw", "r1")])), b""), NOW)
    assert recorded.way is Way.CANCEL


def test_a_cancel_that_fails_unexpectedly_is_parked_as_a_cancel_never_as_a_message():
    """The net under every check: a handler that raises parks the delivery marked with the
    exchange it came through, so `parked replay` can never send a cancel or rule to check-in."""
    flow = Flow(CHAIN.names.check_in, CHAIN.names, lambda d, now: 1 / 0, Quiet(), Batcher(10, 10**6, 200))
    flow.publishing_opened(NOW)
    out = flow.delivered(1, Delivery(CHAIN.names.rules, b"", Properties.build(headers=Table([
        longstr("x-cancel-key", "a")])), b""), NOW)
    [parked] = [p.payload.forward for p in out.publish]
    assert parked.way is Way.PARKED and envelope.Inside(parked.props).exchange == CHAIN.names.rules


# -- selection ---------------------------------------------------------------------------------
@settings(max_examples=examples(300))
@given(st.lists(st.sampled_from(["a", "b", "*", "#", ""]), min_size=0, max_size=4),
       st.lists(st.sampled_from(["a", "b", "c", ""]), min_size=0, max_size=5))
def test_key_patterns_match_as_rabbitmq_matches(pattern_words, key_words):
    pattern, key = ".".join(pattern_words), ".".join(key_words)
    # RabbitMQ splits "" into no words at all, a pattern as a key
    if not key:
        expected = all(w == "#" for w in pattern.split(".")) if pattern else True
    else:
        expected = topic_matches(pattern, key) if pattern else False
    assert selection.topic_pattern(pattern)(key.encode()) == expected, (pattern, key)
    # what a rule is indexed by: every key the pattern matches starts with its literal words
    words = selection.literal_words(pattern)
    if expected and words:
        assert key.encode().split(b".")[:len(words)] == words
