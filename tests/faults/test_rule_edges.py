"""Group cancels at their edges, end to end on every suite broker (3.10 without the
arrival stamp, 4.3 with it): each test failed on the code before b938cba/7fb1d2d (and
f1b4631 for the pattern) and passes now.

- a narrow rule stays narrow where RabbitMQ 3.10's stream dropped its filter's array and
  table values (`--header`, `--id`, `--retries --id`);
- a key pattern that made the old regex backtrack slows no delivery;
- `x-cancel-id: "@*"` and `x-cancel-key: "#"` (without `x-cancel-all`) are refused, parked,
  and cancel nothing;
- rules whose values cannot be read are parked, and `parked replay` never turns them into
  messages;
- a cancel by id and a rule reach rejections that wait unread in `<prefix>.retry`;
- a rule queued while no gateway runs does not hold up the restart;
- `pending cancel --name` refuses a live rule's name unless `--replace`.

A short chain (4 levels x 250 ms: it holds 3.75 s, longer waits lap meditation) and delays
of a few seconds; every wait is for a condition or a sentinel."""

import json
import subprocess
import sys
from typing import Dict, List, Optional, Tuple

import pika

from ..support import (ROOT, GatewayProcess, Receiver, broker_url, chain_args, connect, now_ms, parked_report,
                       publish_sentinel, report_figures, wait_until)

CHAIN = dict(max_level=4, resolution_ms=250)


def cli(chain, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gateway", *args, *chain_args(chain), "--url", broker_url()],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)


def cli_started(chain, *args: str) -> subprocess.Popen:
    """The same command, started: several run side by side (each is a Python start)."""
    return subprocess.Popen([sys.executable, "-m", "gateway", *args, *chain_args(chain), "--url", broker_url()],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def live_rules(chain) -> List[dict]:
    out = cli(chain, "pending", "rules", "--json")
    assert out.returncode == 0, out.stderr
    return [json.loads(line) for line in out.stdout.splitlines()]


def publish(chain, messages: List[Tuple[str, str, int, dict]]) -> None:
    """(routing key, message id, due epoch ms, more headers) each, confirmed, in order, to check-in."""
    with connect() as c:
        ch = c.channel()
        ch.confirm_delivery()
        for key, mid, due, headers in messages:
            ch.basic_publish(chain.names.check_in, key, b"body-" + mid.encode(), pika.BasicProperties(
                message_id=mid, delivery_mode=2, headers={"x-deliver-at": due, **headers}), mandatory=True)


def publish_rules(exchange: str, *headers: dict) -> None:
    """Rules as any AMQP client publishes them: empty messages with x-cancel-* headers, confirmed."""
    with connect() as c:
        ch = c.channel()
        ch.confirm_delivery()
        for h in headers:
            ch.basic_publish(exchange, "", b"", pika.BasicProperties(headers=h, delivery_mode=2), mandatory=True)


def cancel_by_id(chain, message_id: str) -> None:
    with connect() as c:
        ch = c.channel()
        ch.confirm_delivery()
        ch.basic_publish(chain.names.cancel, "", b"", pika.BasicProperties(message_id=message_id), mandatory=True)


def retry_policy(*queues: Tuple[str, int]) -> Tuple[str, str]:
    """The gateway's flag: (queue, delay ms) each, one attempt, no jitter."""
    return "--retry-policies", json.dumps([{"queue": q, "base_ms": ms, "jitter": 0, "attempts": 1}
                                           for q, ms in queues])


class Jobs:
    """A work queue whose dead-letter exchange is the gateway's retry exchange, and a plain
    consumer of it (basic.get) that rejects what it is told to."""

    def __init__(self, chain, name: str) -> None:
        self.queue = f"{chain.prefix}.{name}"
        self.connection = connect()
        self.channel = self.connection.channel()
        self.channel.queue_declare(self.queue, durable=True, arguments={
            "x-queue-type": "quorum", "x-dead-letter-exchange": chain.names.retry})
        self.channel.confirm_delivery()
        self.back: Dict[str, List[Optional[int]]] = {}  # message id -> x-retry-attempt of each that came back

    def reject(self, *ids: str) -> None:
        """Publish these jobs and reject each as it comes (into the retry exchange)."""
        for mid in ids:
            self.channel.basic_publish("", self.queue, b"job", pika.BasicProperties(
                message_id=mid, delivery_mode=2), mandatory=True)
        for mid in ids:
            method, props, _ = wait_until(lambda: (got := self.channel.basic_get(self.queue))[0] and got, 10,
                                          0.01, f"{mid} in {self.queue}", sleep=self.connection.sleep)
            assert props.message_id == mid and not (props.headers or {}).get("x-retry-attempt"), props
            self.channel.basic_reject(method.delivery_tag, requeue=False)

    def take(self) -> Dict[str, List[Optional[int]]]:
        """What came back by now (acknowledged), added to `back`."""
        while True:
            method, props, _ = self.channel.basic_get(self.queue, auto_ack=True)
            if method is None:
                return self.back
            self.back.setdefault(props.message_id, []).append((props.headers or {}).get("x-retry-attempt"))

    def until(self, ids: List[str], timeout: float) -> Dict[str, List[Optional[int]]]:
        wait_until(lambda: set(ids) <= set(self.take()), timeout, 0.02, f"{', '.join(ids)} back in {self.queue}",
                   sleep=self.connection.sleep)
        return self.back

    def close(self) -> None:
        if self.connection.is_open:
            self.channel.queue_delete(self.queue)
            self.connection.close()


def test_a_narrow_rule_stays_narrow(make_chain, run_gateway):
    """Three rules from `pending cancel`, each narrower than a key: `--key 'hx.#' --header
    h=1`, `--id u-1` alone, `--retries --id W3`. Each cancels exactly its message: hx.b
    (h=2), hx.c (no h), u-2 and the retries W1 and W2 arrive, none early.

    Before b938cba a rule's record kept its ids and header filter as array and table header
    values, which RabbitMQ 3.10's streams drop: on 3.10 the first rule cancelled every hx.*
    message, the third every retry, and `--id u-1` was never recorded (u-1 was delivered)."""
    chain = make_chain(**CHAIN)
    jobs_queue = f"{chain.prefix}.jobs"
    retry_ms = 10_000
    gateway = run_gateway(chain, *retry_policy((jobs_queue, retry_ms)))
    receiver = Receiver(chain)
    jobs = Jobs(chain, "jobs")
    try:
        t0 = now_ms()
        due = t0 + 10_000  # (after three commands, run side by side, have had their rules recorded)
        publish(chain, [("hx.a", "hx-a", due, {"h": 1}), ("hx.b", "hx-b", due, {"h": 2}), ("hx.c", "hx-c", due, {}),
                        ("ux.1", "u-1", due, {}), ("ux.2", "u-2", due, {})])
        jobs.reject("W1", "W2", "W3")  # each retry is due retry_ms after the gateway read it
        commands = [cli_started(chain, "pending", "cancel", *filters, "--yes", "--wait", "1") for filters in (
            ("--key", "hx.#", "--header", "h=1"), ("--id", "u-1"), ("--retries", "--id", "W3"))]
        wait_until(lambda: gateway.metric("delay_gateway_retries_total", queue=jobs_queue, outcome="scheduled") >= 3,
                   15, 0.05, "the three retries read")
        retries_due_by = now_ms() + retry_ms
        for command in commands:
            out, err = command.communicate(timeout=120)
            assert command.returncode == 0, out + err
        # (the commands may have stopped waiting before: the gateway's log says when check-in read each)
        recorded = wait_until(lambda: len(found := gateway.events("rule_recorded")) == 3 and found, 15, 0.05,
                              "the three rules recorded")
        assert max(r["cancelled_us"] for r in recorded) // 1000 < due, \
            ("too slow: the rules were recorded only once their messages were due (each retry is due after those)",
             recorded, due)
        publish_sentinel(chain, max(due, retries_due_by), absolute=True)
        receiver.until_sentinel(max(0, max(due, retries_due_by) - now_ms()) / 1000 + 30)
        arrived = sorted(m.properties.message_id for m in receiver.messages)
        assert arrived == ["hx-b", "hx-c", "u-2"], arrived
        early = [(m.properties.message_id, due - m.at_ms) for m in receiver.messages if m.at_ms < due]
        assert not early, f"early (id, ms): {early}"
        # The distributor released the sentinel after every retry due before it.
        back = jobs.until(["W1", "W2"], 10)
        assert back == {"W1": [1], "W2": [1]}, back
        # As the gateways read them back from the stream, each with its whole filter.
        assert sorted(r["filter"] for r in live_rules(chain)) == ["--id W3 --retries", "--id u-1",
                                                                  "--key hx.# --header h=1"]
    finally:
        jobs.close()
        receiver.close()


def test_a_pattern_that_would_backtrack_slows_no_delivery(make_chain, run_gateway, request):
    """100 messages with keys of 8 words due in 3 s, then a rule whose key is 24 '#' words and
    'z' (it selects none of them): all 100 arrive, none is cancelled.

    Before f1b4631 a key pattern was a backtracking regex: matching one 8-word key took about
    2 s, so the gateway judging each message against the rule delivered 2 of the 100 within
    60 s. (No timing is asserted: the lateness is reported.)"""
    chain = make_chain(**CHAIN)
    gateway = run_gateway(chain)
    receiver = Receiver(chain)
    try:
        due = now_ms() + 3000
        publish(chain, [(f"w{n}.b.c.d.e.f.g.h", f"m-{n}", due, {}) for n in range(100)])
        publish_rules(chain.names.rules, {"x-cancel-key": ".".join(["#"] * 24 + ["z"]), "x-cancel-rule": "ends-in-z"})
        [recorded] = wait_until(lambda: gateway.events("rule_recorded"), 15, 0.05, "the rule recorded")
        assert recorded["rule"] == "ends-in-z" and recorded["cancelled_us"] // 1000 < due, \
            ("the rule was recorded only once the messages were due: the test proves nothing", recorded, due)
        got = receiver.collect(100, 60)
        assert sorted(m.properties.message_id for m in got) == sorted(f"m-{n}" for n in range(100)), \
            f"{len(got)} of 100 arrived within 60 s"
        assert gateway.metric("delay_gateway_cancelled_total") == 0
        late = [m.at_ms - due for m in got]
        assert min(late) >= 0, f"early by {-min(late)} ms"
        report_figures("rule edge figures", f"backtracking pattern broker={request.node.callspec.params['broker']}: "
                                            f"100 of 100 delivered, lateness {min(late)} to {max(late)} ms")
    finally:
        receiver.close()


def test_a_rule_for_every_handle_or_every_key_is_refused(make_chain, run_gateway):
    """`x-cancel-id: "@*"` (a handle pattern: every message has a handle) and `x-cancel-key:
    "#"` without `x-cancel-all`, to <prefix>.rules: both are parked with the reason, and the 20
    messages waiting arrive, none cancelled.

    Before b938cba both were recorded as rules, and each cancelled every message."""
    chain = make_chain(**CHAIN)
    gateway = run_gateway(chain)
    receiver = Receiver(chain)
    try:
        due = now_ms() + 3000
        publish(chain, [(f"orders.{n}", f"o-{n}", due, {}) for n in range(20)])
        publish_rules(chain.names.rules, {"x-cancel-id": "@*"}, {"x-cancel-key": "#"})
        reasons = [m["reason"] for m in parked_report(chain, 2)["messages"]]
        assert len(reasons) == 2, reasons
        assert any("x-cancel-id '@*' is not a handle" in r for r in reasons), reasons
        assert any("x-cancel-key '#' selects every routing key" in r for r in reasons), reasons
        publish_sentinel(chain, due, absolute=True)
        receiver.until_sentinel(30)
        arrived = sorted(m.properties.message_id for m in receiver.messages)
        assert arrived == sorted(f"o-{n}" for n in range(20)), arrived
        assert gateway.metric("delay_gateway_cancelled_total") == 0 and gateway.metric("delay_gateway_rules_held") == 0
    finally:
        receiver.close()


def test_an_unreadable_rule_is_parked_and_a_replay_never_delivers_it(make_chain, run_gateway):
    """Rules with `x-cancel-due-before: "²"` (a digit to str.isdigit, not to int) and with 25
    nines (beyond 64 bits): parked, each with a reason naming the header; `parked replay`
    sends them back to <prefix>.rules, where they are parked again, and a queue bound to
    every key at pick-up gets nothing but the sentinel.

    Before b938cba '²' raised past the parker, and a replayed parked rule went to check-in,
    where it became a message: an empty one with x-cancel-* headers reached consumers."""
    chain = make_chain(**CHAIN)
    gateway = run_gateway(chain)
    everything = Receiver(chain, "#")
    try:
        publish_rules(chain.names.rules, {"x-cancel-due-before": "²"}, {"x-cancel-due-before": "9" * 25})
        first = parked_report(chain, 2)
        assert first["count"] == 2 and all(m["reason"].startswith("x-cancel-due-before must be a time in epoch ")
                                           for m in first["messages"]), first
        replay = cli(chain, "parked", "replay", "--reason", "x-cancel-due-before")
        assert replay.returncode == 0 and '"replayed": 2' in replay.stdout, replay.stdout + replay.stderr
        # Behind the replayed rules in check-in: once it arrived, check-in has dealt with them,
        # and anything they became was released before it.
        publish_sentinel(chain, 0)
        everything.until_sentinel(30)
        assert everything.messages == [], [(m.routing_key, m.properties.headers) for m in everything.messages]
        again = parked_report(chain, 2)
        assert again["count"] == 2 and sorted(m["reason"] for m in again["messages"]) == \
            sorted(m["reason"] for m in first["messages"]), again
        assert gateway.proc.poll() is None and gateway.metric("delay_gateway_rules_held") == 0
    finally:
        everything.close()


def test_cancels_reach_rejections_waiting_unread_in_the_retry_queue(make_chain, run_gateway):
    """No gateway runs: job-0..job-3 are rejected into <prefix>.retry, then a cancel by id for
    job-0 (to <prefix>.cancel) and a rule `x-cancel-id: job-1` (to <prefix>.rules) are
    confirmed. A gateway starts: job-2 and job-3 come back (attempt 1), job-0 and job-1 never
    do; job-4, rejected into a slower queue once the gateway is ready, is the sentinel.

    Before 7fb1d2d a rejection's time was when the gateway read it: after the cancels, which
    check-in records first, so job-0 and job-1 came back on every broker."""
    chain = make_chain(**CHAIN)
    jobs, later = Jobs(chain, "jobs"), Jobs(chain, "later")
    try:
        jobs.reject(*(f"job-{n}" for n in range(4)))
        rejected_ms = now_ms()
        cancel_by_id(chain, "job-0")
        publish_rules(chain.names.rules, {"x-cancel-id": "job-1", "x-cancel-rule": "job-1"})
        # Without the arrival stamp (3.10) a rejection read late counts from the end of the
        # second its x-death names: the gateway reads the cancels in a later second.
        wait_until(lambda: now_ms() // 1000 > rejected_ms // 1000, 2, 0.01, "the rejections' second over")
        gateway = run_gateway(chain, *retry_policy((jobs.queue, 1000), (later.queue, 3000)))
        # A retry is due its queue's delay after the gateway read it: job-4, read behind the
        # others, 3 s after, is due 2 s after any of them, more than the lead and a unit.
        later.reject("job-4")
        later.until(["job-4"], 30)
        back = jobs.until(["job-2", "job-3"], 10)
        assert back == {"job-2": [1], "job-3": [1]}, back
        # (each drop is counted once acknowledged, which may come a moment after)
        wait_until(lambda: gateway.metric("delay_gateway_cancelled_total") == 2, 10, 0.05, "job-0 and job-1 dropped")
    finally:
        jobs.close()
        later.close()


def test_a_rule_queued_during_an_outage_does_not_hold_up_the_restart(make_chain, request):
    """No gateway runs: a message due at once, then a cancel by id and a rule by id (from
    `pending cancel --id`, queued) for other ids. A gateway starts: it records both and starts
    its other consumers, and the message arrives (within 30 s: a timeout, not a figure).

    Before b938cba RabbitMQ 3.10's stream dropped the rule's ids (an array header): its record
    was never seen as the rule check-in wrote, and the gateway waited its whole 60 s catch-up
    before it consumed anything but check-in."""
    chain = make_chain(**CHAIN)
    receiver = Receiver(chain)
    gateway = None
    try:
        publish(chain, [("outage.now", "due-now", now_ms(), {})])
        cancel_by_id(chain, "someone-else")
        queued = cli(chain, "pending", "cancel", "--id", "u-1", "--yes", "--wait", "0.5", "--name", "during-outage")
        assert queued.returncode == 0 and "queued: no gateway recorded rule during-outage" in queued.stdout, \
            queued.stdout + queued.stderr
        started = now_ms()
        gateway = GatewayProcess(chain)
        [got] = wait_until(lambda: receiver.take(1), 30, 0.02, "the message due at once, after the restart",
                           sleep=receiver.connection.sleep)
        assert got.properties.message_id == "due-now"
        # (recorded before the distributor started: the log lines may reach the test a moment later)
        wait_until(lambda: [e["rule"] for e in gateway.events("rule_recorded")] == ["during-outage"]
                   and [e["message_id"] for e in gateway.events("cancel_recorded")] == ["someone-else"], 10, 0.05,
                   "the rule and the cancel recorded")
        report_figures("rule edge figures", f"restart after an outage with a rule queued "
                                            f"broker={request.node.callspec.params['broker']}: "
                                            f"delivered {got.at_ms - started} ms after the gateway's start")
    finally:
        if gateway is not None:
            gateway.terminate()
        receiver.close()


def test_pending_cancel_refuses_a_live_rules_name_unless_replace(make_chain, run_gateway):
    """A live rule r1; `pending cancel --key other.# --name r1 --yes` exits 2 and says why,
    nothing published; with `--replace` it exits 0 and r1, with the new filter, is the only
    live rule.

    Before b938cba the second rule of that name was recorded beside the first: two live rules
    named r1, which `pending withdraw r1` then withdrew together."""
    chain = make_chain(**CHAIN)
    run_gateway(chain)
    first = cli(chain, "pending", "cancel", "--key", "hx.#", "--name", "r1", "--yes")
    assert first.returncode == 0 and "recorded at " in first.stdout, first.stdout + first.stderr
    refused = cli(chain, "pending", "cancel", "--key", "other.#", "--name", "r1", "--yes")
    assert refused.returncode == 2 and refused.stderr.count("\n") == 1, refused
    assert "a live rule is named r1" in refused.stderr and "--replace" in refused.stderr, refused.stderr
    assert [(r["rule"], r["filter"]) for r in live_rules(chain)] == [("r1", "--key hx.#")]
    replaced = cli(chain, "pending", "cancel", "--key", "other.#", "--name", "r1", "--replace", "--yes")
    assert replaced.returncode == 0 and "recorded at " in replaced.stdout, replaced.stdout + replaced.stderr
    assert [(r["rule"], r["filter"]) for r in live_rules(chain)] == [("r1", "--key other.#")]
