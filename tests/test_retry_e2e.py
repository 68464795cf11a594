"""Retrying failed messages end to end, on every suite broker: a plain consumer rejects a
message from a queue whose dead-letter exchange is `<prefix>.retry` (as a queue argument, or
by a RabbitMQ policy on a queue that exists), and the gateway sends it back to that queue
after the policy's delay, with `x-retry-attempt`; after the last attempt it is parked, and
`parked replay` starts it over. Gaps are measured from the consumer's reject to the next
delivery, on the consumer's clock: never shorter than the policy's delay."""

import decimal
import json
import subprocess
import sys
from typing import Dict, List, Optional, Tuple

import pika
import pytest

from gateway.commands.status.metrics import retries_from_metrics
from gateway.core import retries

from .support import ROOT, broker_url, chain_args, connect, now_ms, parked_report, report_figures, wait_until

POLICIES = [{"queue": "*.fast", "base_ms": 300, "factor": 2, "jitter": 0.2, "attempts": 4},
            {"queue": "*.slow", "base_ms": 1500, "factor": 1, "jitter": 0.2, "attempts": 1}]


def retrying(chain, queue_type: str = "quorum") -> dict:
    """A queue's arguments: its dead-letter exchange is the gateway's retry exchange."""
    return {"x-queue-type": queue_type, "x-dead-letter-exchange": chain.names.retry}


def gateway(run_gateway, chain, *extra):
    return run_gateway(chain, "--retry-policies", json.dumps(POLICIES), *extra)


class Consumer:
    """A plain consumer of one queue (pika, basic.get), rejecting or acknowledging."""

    def __init__(self, queue: str, arguments: Optional[dict] = None, declare: bool = True) -> None:
        self.queue = queue
        self.connection = connect()
        self.channel = self.connection.channel()
        if declare:
            self.channel.queue_declare(queue, durable=True, arguments=arguments or {})

    def publish(self, message_id: str, body: bytes = b"job") -> None:
        self.channel.basic_publish("", self.queue, body, pika.BasicProperties(
            message_id=message_id, delivery_mode=2, headers={"job": "x"}))

    def next(self, timeout: float) -> Optional[Tuple[int, pika.BasicProperties, bytes, int]]:
        """The next message (tag, properties, body, when it came), or None if none came
        within `timeout` s (0: only what is there now)."""
        def got():
            method, props, body = self.channel.basic_get(self.queue, auto_ack=False)
            return method is not None and (method.delivery_tag, props, body, now_ms())
        return wait_until(got, timeout, interval=0.005, fail=False, sleep=self.connection.sleep) or None

    def reject(self, tag: int) -> int:
        self.channel.basic_reject(tag, requeue=False)
        return now_ms()

    def close(self, delete: bool = True) -> None:
        if delete:
            self.channel.queue_delete(self.queue)
        self.connection.close()


def attempts_of(props) -> Optional[int]:
    return (props.headers or {}).get(retries.ATTEMPT)


def counted(running) -> Dict[str, Dict[str, int]]:
    """What the gateway did with the failures of each queue (scheduled, delivered, ...)."""
    return retries_from_metrics([running.get("/metrics")[1]])


def test_rejected_three_times_then_handled_each_gap_at_least_the_policys(make_chain, run_gateway):
    chain = make_chain(max_level=6, resolution_ms=100)
    running = gateway(run_gateway, chain)
    work = Consumer(f"{chain.prefix}.work.fast", retrying(chain))
    try:
        work.publish("job-1")
        seen: List[Optional[int]] = []
        gaps: List[Tuple[int, int]] = []
        rejected_at = None
        for n in range(4):
            got = work.next(timeout=10)
            assert got is not None, f"attempt {n} never came back"
            tag, props, body, at = got
            seen.append(attempts_of(props))
            assert body == b"job" and props.message_id == "job-1" and props.headers.get("job") == "x"
            assert "x-death" not in (props.headers or {})
            if rejected_at is not None:
                planned = 300 * 2 ** (n - 1)
                gaps.append((at - rejected_at, planned))
            if n < 3:
                rejected_at = work.reject(tag)
            else:
                work.channel.basic_ack(tag)
        assert seen == [None, 1, 2, 3]
        for actual, planned in gaps:
            assert actual >= planned, gaps  # never sooner than the policy says
        report_figures("retry figures", "gaps actual-planned ms: " + ", ".join(
            f"attempt {i + 1}: {a - p} (planned {p}, jitter up to {p // 5})" for i, (a, p) in enumerate(gaps)))
        # Handled: nothing more comes. A sentinel failure now, in a queue of the same policy,
        # comes back after its first delay (300 ms or more): after anything of job-1's still
        # due, by more than the lead and a unit, as the distributor releases in due order.
        sentinel = Consumer(f"{chain.prefix}.sentinel.fast", retrying(chain))
        try:
            sentinel.publish("sentinel")
            sentinel.reject(sentinel.next(timeout=10)[0])
            assert sentinel.next(timeout=10) is not None, "the sentinel never came back"
        finally:
            sentinel.close()
        assert work.next(timeout=0) is None  # handled: nothing more
        status = cli(chain, "status", "--metrics-url", f"http://127.0.0.1:{running.port}")
        assert f"  {work.queue}: 3 scheduled, 3 delivered back, 0 gave up (parked)" in status.stdout, status.stdout
        assert "\nretry " in status.stdout  # the retry queue's own row
    finally:
        work.close()


def test_rejected_every_time_it_is_parked_after_the_last_attempt_and_replay_starts_it_over(make_chain, run_gateway):
    chain = make_chain(max_level=6, resolution_ms=100)
    running = gateway(run_gateway, chain)
    work = Consumer(f"{chain.prefix}.work.slow", retrying(chain))
    try:
        work.publish("job-2")
        for expected in (None, 1):  # the policy for *.slow: one retry
            tag, props, _, _ = work.next(timeout=10)
            assert attempts_of(props) == expected
            work.reject(tag)
        parked = parked_report(chain)["messages"][0]
        assert parked["reason"] == f"gave up after 1 retry to queue '{work.queue}'", parked
        # It gave up, and scheduled no retry beside: nothing can come back.
        counts = wait_until(lambda: (c := counted(running)).get(work.queue, {}).get("gave_up") and c, 10,
                            what="the gateway counting that it gave up")
        assert counts[work.queue] == {"scheduled": 1, "delivered": 1, "gave_up": 1, "parked": 0}, counts
        assert work.next(timeout=0) is None
        replay = cli(chain, "parked", "replay")
        assert replay.returncode == 0, replay.stderr
        tag, props, body, _ = work.next(timeout=10)
        assert attempts_of(props) is None and body == b"job" and props.message_id == "job-2"  # afresh
        work.channel.basic_ack(tag)
    finally:
        work.close()


def test_a_policy_sets_the_dead_letter_exchange_on_existing_queues_each_with_its_own_retry_policy(
        make_chain, run_gateway, broker_ctl):
    """A quorum queue with the fast policy (300 ms) and a classic one with the slow (1.5 s),
    both declared without a dead-letter exchange: a RabbitMQ policy gives them the retry
    exchange; each retry waits its own queue's delay."""
    chain = make_chain(max_level=6, resolution_ms=100)
    gateway(run_gateway, chain)
    queues = [Consumer(f"{chain.prefix}.q0.fast", {"x-queue-type": "quorum"}),
              Consumer(f"{chain.prefix}.q1.slow", {"x-queue-type": "classic"})]
    name = f"{chain.prefix}-retry"
    broker_ctl("set_policy", "--apply-to", "queues", name, f"^{chain.prefix}\\.q\\d\\.",
               json.dumps({"dead-letter-exchange": chain.names.retry}))
    try:
        rejected = {}
        for q in queues:
            q.publish(q.queue)
            tag, props, _, _ = q.next(timeout=10)
            rejected[q.queue] = q.reject(tag)
        back = {}
        for q in queues:
            got = q.next(timeout=10)
            assert got is not None and attempts_of(got[1]) == 1, q.queue
            back[q.queue] = got[3] - rejected[q.queue]
            q.channel.basic_ack(got[0])
        fast, slow = (back[q.queue] for q in queues)
        assert fast >= 300 and slow >= 1500, back
    finally:
        broker_ctl("clear_policy", name)
        for q in queues:
            q.close()


def test_a_waiting_retry_is_cancelled_by_id_and_a_deleted_queue_parks_it(make_chain, run_gateway):
    """...and counts it as parked, not delivered back; `parked list` shows its reason whole."""
    chain = make_chain(max_level=6, resolution_ms=100)
    running = gateway(run_gateway, chain)
    args = retrying(chain)
    kept, gone = Consumer(f"{chain.prefix}.a.slow", args), Consumer(f"{chain.prefix}.b.slow", args)
    try:
        for q, ids in ((kept, ("cancel-me", "keep-me")), (gone, ("orphan",))):
            for mid in ids:
                q.publish(mid)
            for _ in ids:
                tag, _, _, _ = q.next(timeout=10)
                q.reject(tag)
        with connect() as c:
            ch = c.channel()
            ch.confirm_delivery()
            ch.basic_publish(chain.names.cancel, "", b"", pika.BasicProperties(message_id="cancel-me"), mandatory=True)
        gone.channel.queue_delete(gone.queue)
        got = kept.next(timeout=10)
        assert got is not None and got[1].message_id == "keep-me"
        kept.channel.basic_ack(got[0])
        # The cancelled one never comes back: the gateway dropped it (and acknowledged it).
        wait_until(lambda: running.metric("delay_gateway_cancelled_total") >= 1, 10,
                   what="the cancelled retry dropped")
        assert kept.next(timeout=0) is None
        parked = parked_report(chain)["messages"][0]
        assert parked["message_id"] == "orphan" and "does not exist" in parked["reason"], parked
        # (the confirm that counts a retry delivered back may reach the gateway after the consumer has it)
        counts = wait_until(lambda: (c := counted(running)).get(kept.queue, {}).get("delivered") == 1 and c, 10,
                            what="kept's retry counted as delivered back")
        assert counts[gone.queue] == {"scheduled": 1, "delivered": 0, "gave_up": 0, "parked": 1}, counts
        status = cli(chain, "status", "--metrics-url", f"http://127.0.0.1:{running.port}").stdout
        assert f"  {gone.queue}: 1 scheduled, 0 delivered back, 0 gave up (parked), 1 parked" in status, status
        listed = cli(chain, "parked", "list").stdout
        assert f"unroutable: the retry's queue '{gone.queue}' does not exist" in listed, listed
    finally:
        kept.close()
        gone.close(delete=False)


@pytest.mark.parametrize("queue_type,refuse", [("quorum", "reject"), ("quorum", "nack"), ("classic", "nack")])
def test_a_retried_message_comes_back_as_the_consumer_received_it(make_chain, run_gateway, queue_type, refuse):
    """Headers of every kind, rejected or nacked: the retry carries exactly the headers the
    consumer received, plus x-retry-attempt; whatever the broker adds on the way (x-death,
    x-delivery-count, RabbitMQ 4.3's x-acquired-count) stays behind."""
    chain = make_chain(max_level=6, resolution_ms=100)
    gateway(run_gateway, chain)
    work = Consumer(f"{chain.prefix}.h.fast", retrying(chain, queue_type))
    try:
        work.channel.basic_publish("", work.queue, b"job", pika.BasicProperties(
            message_id="typed", delivery_mode=2, content_type="text/plain", priority=3, correlation_id="c-1",
            headers={"s": "text", "i": 7, "big": 2**40, "d": decimal.Decimal("1.5"), "b": True, "l": [1, "two"],
                     "t": {"k": "v"}, "x-custom": "mine"}))
        tag, first, _, _ = work.next(timeout=10)
        if refuse == "reject":
            work.reject(tag)
        else:
            work.channel.basic_nack(tag, requeue=False)
        got = work.next(timeout=10)
        assert got is not None, "never came back"
        work.channel.basic_ack(got[0])
        again = got[1]

        def entries(props, leave=()):
            return sorted((e.name, e.kind, e.raw) for e in props.wire.headers.entries if e.name not in leave)
        assert entries(again, (retries.ATTEMPT.encode(),)) == entries(first), \
            (sorted(again.headers), sorted(first.headers))
        assert attempts_of(again) == 1
        for name in ("message_id", "content_type", "priority", "correlation_id", "delivery_mode"):
            assert getattr(again, name) == getattr(first, name), name
    finally:
        work.close()


def test_hostile_input_on_the_retry_exchange_is_parked_and_touches_nothing_else(make_chain, run_gateway):
    chain = make_chain(max_level=6, resolution_ms=100)
    gateway(run_gateway, chain, "--retry-queues", f"{chain.prefix}.*")
    work = Consumer(f"{chain.prefix}.w.fast", retrying(chain))
    try:
        work.publish("real")
        tag, _, _, _ = work.next(timeout=10)
        work.reject(tag)
        with connect() as c:
            ch = c.channel()
            ch.confirm_delivery()
            for headers in ({"x-gateway-due-at": 1, "x-gateway-routing-key": "x", "x-gateway-exchange": ""},
                            {retries.QUEUE: "someone-elses-queue", "x-death": [{"queue": "forged", "reason": "x"}]},
                            {retries.QUEUE: "someone-elses-queue"}):
                ch.basic_publish(chain.names.retry, "k", b"evil", pika.BasicProperties(
                    message_id="evil", headers=headers), mandatory=True)
        got = work.next(timeout=10)
        assert got is not None and got[1].message_id == "real" and attempts_of(got[1]) == 1
        work.channel.basic_ack(got[0])
        reasons = sorted(p["reason"] for p in parked_report(chain, 3)["messages"])
        assert len(reasons) == 3, reasons
        assert any("no way to tell its queue" in r for r in reasons)
        assert any("not rejected by a consumer" in r for r in reasons)
        assert any("may not go back to queue 'someone-elses-queue'" in r for r in reasons)
    finally:
        work.close()


def cli(chain, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gateway", *args, *chain_args(chain), "--url", broker_url()],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
