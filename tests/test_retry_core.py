"""Retrying failed messages, the pure parts: policies, reading a rejected message, what the
retry consumer and the distributor do with it, and where `parked replay` sends it."""

import datetime
import random

import pytest
from hypothesis import given, strategies as st
from pika import BasicProperties

from topology import ChainSettings

from gateway.broker.plumbing import lazy_properties
from gateway.commands.parked import Parked, destination
from gateway.broker.run.cancelling import Judge
from gateway.core import cancels, carrier, envelope, handlers, retries, rules
from gateway.core.actions import Drop, Enqueue
from gateway.core.inputs import Delivery
from gateway.core.routes import Way
from gateway.core.carrier import Entry
from gateway.core.retries import BadPolicy, Policy, failure, policies, policy_for
from gateway.core.wire import Properties, Table, long, longstr
from gateway.metrics import Metrics
from gateway.settings import Settings, UsageError

CHAIN = ChainSettings(prefix="r", max_level=6, resolution_ms=100)
NAMES = CHAIN.names
NOW = 1_800_000_000_000


def rejected(queue: str = "orders", attempt=None, reason=None, death_reason="rejected", body=b"job",
             at_s=None, stamp=None) -> Delivery:
    """A message as RabbitMQ dead-letters it from `queue` after a consumer rejected it (at `at_s`,
    epoch seconds, when given; `stamp`: the arrival stamp of its first publish)."""
    death = {"queue": queue, "reason": death_reason, "exchange": "", "count": 1}
    if at_s is not None:
        death["time"] = datetime.datetime.fromtimestamp(at_s, datetime.timezone.utc)
    headers = {"x-death": [death], "x-first-death-queue": queue}
    if stamp is not None:
        headers["timestamp_in_ms"] = stamp
    if attempt is not None:
        headers[retries.ATTEMPT] = attempt
    if reason is not None:
        headers[retries.REASON] = reason
    props = lazy_properties.to_wire(BasicProperties(message_id="m1", content_type="application/json", headers=headers))
    return Delivery(NAMES.retry, queue.encode(), props, body)


def retry_handler(*found: Policy, seed: int = 1) -> handlers.Retry:
    return handlers.Retry(CHAIN, 50, found or (Policy(),), random.Random(seed))


# -- policies ------------------------------------------------------------------------------------
def test_the_default_policy_doubles_from_a_second_up_to_an_hour():
    p = Policy()
    assert [p.planned_ms(n) for n in (1, 2, 3, 10, 13, 40)] == [1000, 2000, 4000, 512_000, 3_600_000, 3_600_000]
    assert p.attempts == 10


@given(st.integers(1, 50), st.integers(0, 2**32))
def test_jitter_only_adds_and_stays_within_its_share(attempt, seed):
    p = Policy(base_ms=700, factor=1.7, cap_ms=10**7, jitter=0.25)
    planned = p.planned_ms(attempt)
    assert planned <= p.delay_ms(attempt, random.Random(seed)) <= planned * 1.25


def test_per_queue_policies_override_the_default_first_match_wins():
    found = policies(Policy(), '[{"queue": "orders.*", "base_ms": 500, "attempts": 3}, {"queue": "orders.eu"}]')
    assert policy_for("orders.eu", found) == Policy(base_ms=500, attempts=3, queue="orders.*")
    assert policy_for("billing", found) == Policy()


@pytest.mark.parametrize("text, why", [
    ("{", "not JSON"), ('{"queue": "a"}', "JSON list of objects"), ('[{"base_ms": 5}]', "give the queue"),
    ('[{"queue": "a", "tries": 5}]', "unknown tries"), ('[{"queue": "a", "base_ms": 0}]', "base_ms 0"),
    ('[{"queue": "a", "base_ms": 5000, "cap_ms": 10}]', "cap_ms 10"), ('[{"queue": "a", "jitter": 2}]', "jitter"),
    ('[{"queue": "a", "factor": 0.5}]', "factor"), ('[{"queue": "a", "attempts": -1}]', "attempts"),
])
def test_a_policy_that_cannot_be_is_refused_with_the_reason(text, why):
    with pytest.raises(BadPolicy, match=why):
        policies(Policy(), text)


def test_settings_refuse_a_bad_policy_at_start_in_one_line():
    with pytest.raises(UsageError, match="the default retry policy .*cap_ms 10 "):
        Settings(retry_base_ms=1000, retry_cap_ms=10)
    with pytest.raises(UsageError, match="not JSON"):
        Settings(retry_policies="[")
    assert Settings(retry_policies='[{"queue": "q", "attempts": 2}]').retry_rules()[0].attempts == 2


# -- reading a failed message --------------------------------------------------------------------
def test_a_rejection_says_its_queue_and_the_attempt_counts_up():
    assert failure(rejected("orders").props.headers) == retries.Failure("orders", 1, None)
    assert failure(rejected("orders", attempt=3, reason="db down").props.headers) == \
        retries.Failure("orders", 4, "db down")
    expired = failure(rejected("orders", death_reason="expired").props.headers)
    assert expired.not_retried and "expired" in expired.not_retried


def test_a_consumer_that_publishes_itself_names_the_queue():
    props = Properties.build(headers=Table([longstr(retries.QUEUE, "jobs"), longstr(retries.REASON, "timeout")]))
    assert failure(props.headers) == retries.Failure("jobs", 1, "timeout")
    assert failure(Table()).queue is None


# -- the retry consumer --------------------------------------------------------------------------
def test_a_rejected_message_goes_back_to_its_queue_after_the_policys_delay_with_the_attempt():
    [sent] = retry_handler(Policy(base_ms=1000, jitter=0.0))(rejected("orders", attempt=1), NOW)
    assert isinstance(sent, Enqueue)
    e = sent.entry
    assert (e.exchange, e.routing_key, e.due_ms) == ("", b"orders", NOW + 2000)  # attempt 2: 2 s
    assert e.user.headers.get(retries.ATTEMPT) == 2
    assert not {"x-death", "x-first-death-queue"} & set(e.user.headers.to_dict())  # no dead-letter history
    assert e.user.text("content_type") == "application/json" and e.body == b"job" and e.accepted_us is not None


def test_after_the_last_attempt_it_is_parked_with_the_reason_and_replay_sends_it_back_afresh():
    [parked] = retry_handler(Policy(attempts=3))(rejected("orders", attempt=3, reason="db down"), NOW)
    assert parked.exchange == NAMES.parked and parked.way == "parked"
    assert parked.reason == "gave up after 3 retries to queue 'orders': db down"
    message = Parked(1, parked.props, parked.body, parked.routing_key)
    exchange, key, props = destination(message, NAMES)
    assert (exchange, key) == ("", b"orders")  # the default exchange: straight to its queue
    assert props.headers.get(retries.ATTEMPT) is None and props.text("message_id") == "m1"


@pytest.mark.parametrize("delivery, why", [
    (Delivery(NAMES.retry, b"k", Properties.build(), b"x"), "no way to tell its queue"),
    (rejected("orders", death_reason="maxlen"), "only a rejection is retried"),
    (Delivery(NAMES.retry, b"k", Properties.build(headers=Table([
        longstr(envelope.DUE_AT, "soon"), long(envelope.ROUTING_KEY, 5)])), b"x"), "no way to tell its queue"),
])
def test_hostile_or_unexplained_input_on_the_retry_exchange_is_parked_with_a_reason(delivery, why):
    [parked] = retry_handler()(delivery, NOW)
    assert parked.way == "parked" and why in parked.reason


def test_a_retry_travels_in_carriers_of_its_own_and_the_distributor_sends_it_to_its_queue():
    e1 = Entry(b"orders", Properties.build(message_id="a"), b"1", NOW + 50, 7, "")
    e2 = Entry(b"orders", Properties.build(message_id="b"), b"2", NOW + 60, 8, "")
    both = handlers.carry("ex", b"", Way.CHAIN, [e1, e2])
    back = handlers.entries(Delivery("ex", b"", both.props, both.body))
    assert back == [e1, e2]
    alone = handlers.carry("ex", b"", Way.CHAIN, [e1])
    assert handlers.entries(Delivery("ex", b"", alone.props, alone.body)) == [e1]
    [out] = handlers.Distributor(CHAIN, 50)(Delivery("ex", b"", both.props, both.body), NOW)[:1]
    assert (out.exchange, out.routing_key, out.way, out.mandatory) == ("", b"orders", "retried", True)
    gone = handlers.unroutable(NAMES, e1)
    assert "queue 'orders' does not exist" in gone.reason
    assert carrier.properties([Entry(b"k", Properties.build(), b"", NOW)]).headers.get(envelope.EXCHANGE) is None


def test_a_waiting_retry_can_be_cancelled():
    dropped = []

    def judge(entry, where):
        dropped.append(where)
        return entry.user.text("message_id") == "m1"
    handler = handlers.Retry(CHAIN, 50, (Policy(),), random.Random(1), cancelled=judge)
    [gone] = handler(rejected("orders"), NOW)
    assert isinstance(gone, Drop) and dropped == ["retry"]


def test_a_retry_is_taken_in_when_it_was_rejected_so_a_cancel_published_while_it_waited_unread_wins():
    """Rejected while no gateway ran, read after a cancel for its id was recorded: its time is
    the end of the second the broker's x-death says, before the cancel's; read at once, its
    read time, as any message's. With the broker's stamps, its first publish's stamp decides."""
    store = cancels.Store(86_400_000)
    judge = Judge(store, rules.Rules(86_400_000), Metrics(), {})
    handler = handlers.Retry(CHAIN, 50, (Policy(),), random.Random(1), cancelled=judge)
    rejected_s = NOW // 1000 - 600  # ten minutes before the gateway read it
    store.add(b"m1", cancels.Time((NOW - 5_000) * 1000), NOW)  # recorded after the rejection, before the read
    [gone] = handler(rejected("orders", at_s=rejected_s), NOW)
    assert isinstance(gone, Drop) and gone.entry.accepted_us == (rejected_s + 1) * 1_000_000 - 1
    # a rejection after the cancel (a rescheduled message that failed): not cancelled
    [kept] = handler(rejected("orders", at_s=NOW // 1000 - 1), NOW)
    assert isinstance(kept, Enqueue) and kept.entry.accepted_us == NOW * 1000 - 1
    # read at once: its read time (before the end of its second)
    fresh = handlers.Retry(CHAIN, 50, (Policy(),), random.Random(1))
    [sent] = fresh(rejected("orders", at_s=NOW // 1000), NOW + 300)
    assert sent.entry.accepted_us == (NOW + 300) * 1000
    # stamps: the cancel stamped after the message's first publish cancels it, whatever the read times
    stamped = cancels.Store(86_400_000)
    stamped.add(b"m1", cancels.Time((NOW - 9_000) * 1000, NOW - 100), NOW)
    handler = handlers.Retry(CHAIN, 50, (Policy(),), random.Random(1),
                             cancelled=Judge(stamped, rules.Rules(86_400_000), Metrics(), {}))
    [gone] = handler(rejected("orders", at_s=NOW // 1000 - 1, stamp=NOW - 200), NOW)
    assert isinstance(gone, Drop)
    [kept] = handler(rejected("orders", at_s=NOW // 1000 - 1, stamp=NOW - 50), NOW)  # published after it
    assert isinstance(kept, Enqueue)


def test_a_first_rejection_goes_into_the_chain_back_to_its_queue_after_the_default_delay():
    """The default policy (1 s, up to a fifth more of jitter): into one of the chain's levels,
    to come back to its queue through the default exchange with attempt 1, the message as
    the consumer had it."""
    [sent] = retry_handler()(rejected("orders"), NOW)
    assert isinstance(sent, Enqueue)
    assert sent.exchange in {NAMES.level(k) for k in range(CHAIN.max_level)}, sent.exchange
    e = sent.entry
    assert (e.exchange, e.routing_key, e.body) == ("", b"orders", b"job")
    assert NOW + 1000 <= e.due_ms <= NOW + 1200, e.due_ms - NOW
    assert e.user.headers.get(retries.ATTEMPT) == 1 and e.user.text("message_id") == "m1"
    assert not {"x-death", "x-first-death-queue"} & set(e.user.headers.to_dict())


def test_retries_go_back_only_to_the_queues_allowed():
    handler = handlers.Retry(CHAIN, 50, (Policy(),), random.Random(1), queues="orders.*, jobs")
    for allowed in ("orders.eu", "jobs"):
        [sent] = handler(rejected(allowed), NOW)
        assert isinstance(sent, Enqueue) and sent.entry.routing_key == allowed.encode(), sent
    [parked] = handler(rejected("billing"), NOW)
    assert parked.way == "parked" and "may not go back to queue 'billing'" in parked.reason


def test_run_refuses_a_policy_that_cannot_be_in_one_line_with_exit_2():
    import subprocess
    import sys

    from .support import ROOT
    r = subprocess.run([sys.executable, "-m", "gateway", "run", "--retry-policies", '[{"queue": "a", "cap_ms": 1}]'],
                       cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert "the retry policy for 'a': cap_ms 1 must be at least base_ms" in r.stderr
