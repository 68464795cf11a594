"""An upgrade from the last release, under load, on every suite broker.

The last released version (tag v0.1.0, commit RELEASE_COMMIT), taken from the repository's
own history with `git archive` and run as `python -m gateway run` from a directory outside
the repository with that tree first on PYTHONPATH (the process's own import log shows it
runs the released code), schedules a few thousand messages, cancels some with its own
`delay-gateway cancel`, and retries jobs a consumer rejects. The messages carry typed
headers and every property, some no message id; their delays run from nothing to several
laps of meditation (4 levels of 250 ms: a lap is 3.75 s), and a few are due in hours and
days. Then the working tree's gateway takes over while messages are still being published,
in one of two ways:

- stop-first: SIGTERM the old process, then start the new one;
- rolling: declare with the new version, start the new process, wait until it is ready,
  then SIGTERM the old one (the chart's order: its hook Job declares, then the Deployments
  roll with maxSurge 1, maxUnavailable 0).

The new version runs the defaults: what is due within 10 s (at most 1,000 messages' worth at
the rate) goes from its check-in straight to the distributor, which holds it until due. The
old version's distributor holds such messages too (it holds anything due within a minute):
in a rolling upgrade it takes its share of them from the distributor queue until SIGTERM,
and hands back what it holds then.

The new version then cancels by id some of what the old one scheduled (a publish to
`<prefix>.cancel`), reschedules some (a cancel, then the same id published again), cancels
by handle messages without an id that the old one scheduled (the handles from its `pending
list`, to its `cancel`), and others by one group cancel (`pending cancel --key`). A
sentinel due after everything else says when all of it has been released.

Checked: nothing lost; nothing early (arrival at or after the due time on the publisher's
clock); no duplicate: the contract allows them after a crash, a lost connection or a
refused publish, and a clean SIGTERM is none of these; no cancelled message delivered;
routing key, body, every property and every header (with its wire type) as sent; every job
back with x-retry-attempt 1, 2, 3 in turn, none before its policy's delay; the far messages
still waiting, as the new version's `pending count` says, and every message listed once (a
lap that ended under the old version is not one more copy); no error logged by either
version.

The test's cancels come while one gateway consumes check-in (before the takeover the old
one, after it the new one), where a cancel confirmed a unit before its message is due wins
on every broker. One the old version's `cancel` recorded later than that (a machine so busy
that the command outlasted the 8 s margin) may win or not: it is held to neither, and
counted (`cancels_too_late`). With two check-in consumers and no arrival stamp (3.10), the limits of
docs/cancelling.md apply during an upgrade as at any other time.

25 to 30 s a case on a busy 2-core machine (figures: the `upgrade figures` section of the
summary).
"""

import datetime
import json
import os
import random
import re
import struct
import subprocess
import sys
import tarfile
import threading
import time
from dataclasses import dataclass
from io import BytesIO
from typing import Dict, Iterator, List, Optional, Tuple

import pytest

from gateway.broker.plumbing import lazy_properties
from gateway.broker.tools.window import Outgoing, WindowPublisher
from gateway.core import wire
from gateway.core.wire import Properties, Table, TableField
from topology import ChainSettings

from .support import (ROOT, GatewayProcess, broker_url, chain_args, connect, now_ms, remove, report_figures,
                      same_entries, unique_prefix, wait_until)

RELEASE_TAG = "v0.1.0"
RELEASE_COMMIT = "7f30bde818e5324e1aa2e63a598c0a7f26385d6b"  # what the tag names; used where a clone lacks the tag

CHAIN = dict(max_level=4, resolution_ms=250)  # a pass of the chain, and a lap of meditation: 3.75 s
UNIT_MS = CHAIN["resolution_ms"]
LOAD = 3000  # delays from 0 to 12 s
FAR_DELAYS_MS = [2 * 3_600_000, 9 * 3_600_000, 86_400_000, 3 * 86_400_000, 45 * 86_400_000, 400 * 86_400_000]
# Published first, due after the takeover and the new version's cancels on a busy machine:
# LATE with ids, some of them cancelled by the new version, BY_HANDLE without, cancelled by
# their handles, and BY_RULE (some with an id) by one group cancel of their routing keys.
TARGET_MS, LATE, BY_HANDLE, BY_RULE = 24_000, 40, 4, 4
JOBS = 60
# A rejected job comes back after 1 s, 2 s, then 4 s (which laps meditation), plus jitter.
RETRY_BASE_MS, RETRY_FACTOR, LAST_ATTEMPT = 1000, 2, 3
PUBLISH_S = 6.0  # the load is published over this long; and more, due within DURING_MS, until taken over
DURING_MS, DURING_RATE = 5000, 200
CANCELS = 25  # by id: before the takeover by the old version, and after it by the new one
RESCHEDULED = 5  # of the new version's cancels, published again at once with the same id
# A cancel is published at least this long before its message can be due (one unit is enough): by
# the old version's command (a Python start, on a busy machine), and by a publish.
OLD_MARGIN_MS, MARGIN_MS = 8000, 3000


# -- the released version ----------------------------------------------------------------------
def git(*args: str) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(["git", "-C", ROOT, *args], capture_output=True, timeout=60)
    except FileNotFoundError:
        pytest.fail("git is not installed: this test takes the last release from the repository's history",
                    pytrace=False)


def release_commit() -> str:
    """The last release's commit: its tag's, which must be RELEASE_COMMIT, or that commit in a
    clone without the tag; a one-line failure when neither is there."""
    def commit_of(name: str) -> Optional[str]:
        found = git("rev-parse", "--verify", "--quiet", name + "^{commit}")
        return found.stdout.decode().strip() if found.returncode == 0 else None
    tagged = commit_of(RELEASE_TAG)
    if tagged is not None and tagged != RELEASE_COMMIT:
        pytest.fail(f"tag {RELEASE_TAG} names {tagged}, not {RELEASE_COMMIT}: point RELEASE_TAG and RELEASE_COMMIT "
                    "in tests/test_upgrade_release.py at the last release", pytrace=False)
    if tagged is None and commit_of(RELEASE_COMMIT) is None:
        pytest.fail(f"neither tag {RELEASE_TAG} nor commit {RELEASE_COMMIT[:7]} is in the clone at {ROOT}: fetch them "
                    f"(git fetch --unshallow, or git fetch origin tag {RELEASE_TAG})", pytrace=False)
    return RELEASE_COMMIT


@pytest.fixture(scope="module")
def release(tmp_path_factory) -> str:
    """The released `gateway` and `topology` packages, extracted from the repository's history
    into a directory outside the repository (put first on PYTHONPATH, and run from there)."""
    commit = release_commit()
    tree = tmp_path_factory.mktemp(RELEASE_TAG)
    archive = git("archive", "--format=tar", commit, "gateway", "topology")
    assert archive.returncode == 0, archive.stderr.decode()
    with tarfile.open(fileobj=BytesIO(archive.stdout)) as tar:
        if hasattr(tarfile, "data_filter"):
            tar.extractall(tree, filter="data")
        else:  # (a Python without extraction filters; the archive is our own history)
            tar.extractall(tree)
    return str(tree)


def released_env(tree: str) -> Dict[str, str]:
    # PYTHONVERBOSE: the interpreter logs where it takes each module's code from.
    return {"PYTHONPATH": tree, "PYTHONVERBOSE": "1"}


def runs_released_code(gateway: GatewayProcess, tree: str) -> None:
    """The process took the code of its `gateway` and `topology` modules from the released
    tree alone (not from the working tree, nor the editable install), its worker included."""
    taken = re.findall(r"^# code object from '?([^'\n]+?)'?$", "".join(gateway.raw), re.M)
    ours = [path for path in taken if re.search(r"/(gateway|topology)/", path)]
    assert any("/gateway/broker/" in p and "worker" in p for p in ours), f"no worker imported: {ours[:5]}"
    elsewhere = [p for p in ours if not p.startswith(tree + os.sep)]
    assert not elsewhere, f"the released process imported code from outside {tree}: {elsewhere[:5]}"


def released_cli(tree: str, chain: ChainSettings, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gateway", *args, *chain_args(chain), "--url", broker_url()],
                          cwd=tree, env={**os.environ, "PYTHONPATH": tree}, capture_output=True, text=True,
                          timeout=120)


def current_cli(chain: ChainSettings, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gateway", *args, *chain_args(chain), "--url", broker_url()],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)


def pending(chain: ChainSettings, *args: str) -> subprocess.CompletedProcess:
    """The new version's `pending ...`."""
    out = current_cli(chain, "pending", *args)
    assert out.returncode == 0, out.stderr
    return out


def counted(chain: ChainSettings, key: str) -> dict:
    """The new version's `pending count --json` of the messages whose key matches."""
    return json.loads(pending(chain, "count", "--json", "--key", key).stdout)


# -- what is published ---------------------------------------------------------------------------
def typed(name: str, kind: bytes, raw: bytes) -> TableField:
    return TableField(name.encode(), kind, raw)


def array(*items: bytes) -> bytes:
    return struct.pack(">I", len(b"".join(items))) + b"".join(items)


# Headers of most AMQP field types, each to arrive with its type and bytes.
TYPED_HEADERS = [
    wire.longstr("tenant", "acme"),
    typed("short", b"s", struct.pack(">h", -7)),
    typed("flag", b"t", b"\x01"),
    typed("byte", b"b", struct.pack(">b", -3)),
    typed("int", b"I", struct.pack(">i", 123_456)),
    typed("float", b"f", struct.pack(">f", 1.5)),
    typed("double", b"d", struct.pack(">d", 2.25)),
    typed("decimal", b"D", struct.pack(">Bi", 2, 12_345)),
    typed("stamp", b"T", struct.pack(">Q", 1_700_000_000)),
    wire.binary("raw", b"\x00\xff\x10"),
    typed("none", b"V", b""),
    typed("table", b"F", Table([wire.long("deep", 2**40), wire.longstr("text", "\u00fc")]).encode()),
    typed("array", b"A", array(b"l" + struct.pack(">q", -1), b"S" + struct.pack(">I", 3) + b"two", b"t\x00")),
]


def properties(kind: int, message_id: Optional[str], when: TableField) -> Properties:
    """Every property with typed headers (kind 0), a few (1), or the delay header alone (2)."""
    mid = message_id.encode() if message_id is not None else None
    if kind == 0:
        return Properties.build(
            content_type=b"application/json", content_encoding=b"utf-8", headers=Table([when, *TYPED_HEADERS]),
            delivery_mode=2, priority=5, correlation_id=b"corr-1", reply_to=b"replies", expiration=b"86400000",
            message_id=mid, timestamp=1_700_000_000, type=b"reminder", app_id=b"shop", cluster_id=b"c1")
    if kind == 1:
        return Properties.build(headers=Table([wire.longstr("customer", "42"), when, TYPED_HEADERS[1]]),
                                delivery_mode=1, message_id=mid, timestamp=1_700_000_001)
    return Properties.build(headers=Table([when]), message_id=mid)


@dataclass
class Message:
    key: str
    body: bytes
    message_id: Optional[str]
    delay_ms: int
    kind: int  # of properties()
    absolute: bool  # sent as x-deliver-at (the publish's time plus the delay), else x-delay
    props: Optional[Properties] = None  # as published
    not_before_ms: int = 0  # the earliest it may arrive: the publisher's clock before the publish, plus the delay

    def published(self) -> Properties:
        """Its properties, the due time fixed now; noted as sent."""
        before = now_ms()
        when = wire.long("x-deliver-at", before + self.delay_ms) if self.absolute else wire.long("x-delay",
                                                                                                  self.delay_ms)
        self.props, self.not_before_ms = properties(self.kind, self.message_id, when), before + self.delay_ms
        return self.props


def plan(rng: random.Random) -> Tuple[List[Message], List[Message], List[Message], List[Message], List[Message]]:
    """(far, late, by handle, by rule, the load): the load's delays from nothing to 12 s,
    every 7th without a message id; the late ones and those cancelled by handle or by rule
    due TARGET_MS after they are published (first), after the takeover on a busy machine."""
    far = [Message(f"far.{i}", f"far-{i}".encode(), f"far-{i}", delay, i % 3, i % 2 == 1)
           for i, delay in enumerate(FAR_DELAYS_MS)]
    late = [Message(f"late.{i % 3}", f"late-{i}".encode(), f"late-{i}", TARGET_MS - 1000 + 20 * i, i % 3, i % 2 == 1)
            for i in range(LATE)]
    by_handle = [Message(f"handle.{i}", f"handle-{i}".encode(), None, TARGET_MS, i % 3, i % 2 == 1)
                 for i in range(BY_HANDLE)]
    by_rule = [Message(f"rule.{i}", f"rule-{i}".encode(), f"rule-{i}" if i % 2 else None, TARGET_MS, i % 3,
                       i % 2 == 1) for i in range(BY_RULE)]
    load = [Message(f"load.{n % 5}", b"m-%d|" % n + bytes(range(n % 256)), None if n % 7 == 6 else f"m-{n}",
                    rng.randint(0, 900) if n % 10 == 0 else rng.randint(1000, 12_000), n % 3, n % 4 == 3)
            for n in range(LOAD)]
    return far, late, by_handle, by_rule, load


def job_properties(j: int) -> Properties:
    return Properties.build(content_type=b"text/plain", message_id=f"job-{j}".encode(), delivery_mode=2,
                            timestamp=1_700_000_002, headers=Table([wire.longstr("job", str(j)), *TYPED_HEADERS[:3]]))


class Publisher(threading.Thread):
    """Publishes the messages with confirms (at most WINDOW unconfirmed), paced over
    PUBLISH_S, with the jobs spread among them (to their queue); then more, with delays up to
    DURING_MS (`during`), DURING_RATE a second, until `stop` is set: the takeover happens
    under load."""

    WINDOW = 200

    def __init__(self, chain: ChainSettings, messages: List[Message], jobs_queue: str, rng: random.Random) -> None:
        super().__init__(daemon=True)
        self.chain, self.messages, self.jobs_queue, self.rng = chain, messages, jobs_queue, rng
        self.during: List[Message] = []
        self.read = 0  # messages handed to the publisher so far
        self.stop = threading.Event()
        self.error: Optional[BaseException] = None
        self.window = WindowPublisher([broker_url()], self.items(), "delay-gateway upgrade test", window=self.WINDOW,
                                      max_rate=(len(messages) + JOBS) / PUBLISH_S, nack_attempts=10)

    def items(self) -> Iterator[Outgoing]:
        every = len(self.messages) // JOBS
        for i, m in enumerate(self.messages):
            self.read = i + 1
            yield self.chain.names.check_in, m.key, m.published(), m.body
            if i % every == 0 and i // every < JOBS:
                yield "", self.jobs_queue, job_properties(i // every), b"job-%d" % (i // every)
        while not self.stop.is_set():
            time.sleep(1 / DURING_RATE)  # (the publisher's own pace is the load's)
            n = len(self.during)
            m = Message(f"during.{n % 3}", b"d-%d|" % n, None if n % 7 == 6 else f"d-{n}",
                        self.rng.randint(0, DURING_MS), n % 3, n % 4 == 3)
            self.during.append(m)
            yield self.chain.names.check_in, m.key, m.published(), m.body

    def run(self) -> None:
        try:
            self.window.run()
        except BaseException as exc:  # (reported by the test)
            self.error = exc

    def confirmed(self) -> List[Message]:
        """Messages the broker has confirmed (all but the last one read has been sent)."""
        sent = self.read - 1
        unconfirmed = {m[3] for m, _ in list(self.window.pending.values())} | \
            {m[3] for _, m, _ in list(self.window.retry)}
        return [m for m in self.messages[:max(0, sent)] if m.body not in unconfirmed]


# -- what arrives --------------------------------------------------------------------------------
@dataclass
class Arrival:
    body: bytes
    routing_key: str
    props: Properties
    at_ms: int


class Consumer(threading.Thread):
    """Consumes a queue in a thread of its own, noting each delivery with its exact
    properties and the time it arrived; `pick_up`: a queue of its own bound to pick-up."""

    def __init__(self, queue: str, pick_up: Optional[str] = None) -> None:
        super().__init__(daemon=True)
        self.queue, self.pick_up = queue, pick_up
        self.got: List[Arrival] = []
        self.ready, self.stop = threading.Event(), threading.Event()
        self.error: Optional[BaseException] = None
        self.start()
        assert self.ready.wait(30) and self.error is None, self.error

    def run(self) -> None:
        try:
            with connect() as c:
                ch = c.channel()
                if self.pick_up is not None:
                    self.queue = ch.queue_declare("", exclusive=True).method.queue
                    ch.queue_bind(self.queue, self.pick_up, "#")
                ch.basic_qos(prefetch_count=500)
                ch.basic_consume(self.queue, lambda ch_, method, props, body: self.on_message(ch_, method, Arrival(
                    body, method.routing_key, props.wire, now_ms())))
                self.ready.set()
                while not self.stop.is_set():
                    c.process_data_events(time_limit=0.05)
        except BaseException as exc:  # (reported by the test)
            self.error = exc
            self.ready.set()

    def on_message(self, channel, method, arrival: Arrival) -> None:
        self.got.append(arrival)
        channel.basic_ack(method.delivery_tag)

    def close(self) -> None:
        self.stop.set()
        self.join(10)


ATTEMPT = "x-retry-attempt"


class Rejecter(Consumer):
    """A consumer that cannot handle a job until its third retry: it rejects it (requeue
    false, so the queue dead-letters it to the retry exchange) before, and acknowledges it
    then. `rejected[body]`: when it rejected each attempt (read before the reject)."""

    def __init__(self, queue: str) -> None:
        self.rejected: Dict[bytes, List[int]] = {}
        super().__init__(queue)

    def on_message(self, channel, method, arrival: Arrival) -> None:
        self.got.append(arrival)
        if attempt_of(arrival) < LAST_ATTEMPT:
            self.rejected.setdefault(arrival.body, []).append(now_ms())
            channel.basic_reject(method.delivery_tag, requeue=False)
        else:
            channel.basic_ack(method.delivery_tag)


def attempt_of(arrival: Arrival) -> int:
    attempt = arrival.props.headers.get(ATTEMPT)
    return attempt if isinstance(attempt, int) else 0


def as_sent(arrival: Arrival, sent: Properties, routing_key: str, drop: Tuple[str, ...] = ()) -> bool:
    """Routing key, every property and every header (type and bytes) as sent, but for the
    headers named in `drop`; RabbitMQ 4 with the arrival stamp adds `timestamp_in_ms`, and
    the `timestamp` property where there was none."""
    def plain(props: Properties) -> dict:
        return {k: v for k, v in props.values.items()
                if k != "headers" and not (k == "timestamp" and sent.get("timestamp") is None)}
    got = arrival.props
    headers = got.headers.without(lambda name: name in drop)
    return arrival.routing_key == routing_key and plain(got) == plain(sent) and same_entries(headers, sent.headers)


# -- the test ----------------------------------------------------------------------------------
def recorded_at(cancel_output: str) -> Dict[str, int]:
    """When `cancel` says it recorded each id (epoch ms): `ID: cancelled at 2026-...Z: ...`,
    from any version (the released one prints the same)."""
    found = re.findall(r"^(.+?): cancelled at (\d{4}-\d\d-\d\dT[\d:.]+(?:Z|[+-]\d\d:\d\d))", cancel_output, re.M)
    return {mid: int(datetime.datetime.fromisoformat(at.replace("Z", "+00:00")).timestamp() * 1000)
            for mid, at in found}


def eligible(messages: List[Message], prefix: str, due_after_ms: int) -> List[str]:
    """The ids starting with `prefix` of these messages, none due before `due_after_ms`."""
    return sorted(m.message_id for m in messages if m.message_id is not None and m.message_id.startswith(prefix)
                  and m.not_before_ms >= due_after_ms)


def pick(messages: List[Message], prefix: str, count: int, due_after_ms: int, rng: random.Random,
         phases: Dict[str, float]) -> List[str]:
    """`count` of them, at random."""
    ids = eligible(messages, prefix, due_after_ms)
    assert len(ids) >= count, f"only {len(ids)} messages left to cancel: a machine too busy for this test ({phases})"
    return rng.sample(ids, count)


@pytest.mark.parametrize("mode", ["stop-first", "rolling"])
def test_the_last_release_hands_over_to_this_version_under_load(broker, release, mode, request):
    started = time.monotonic()
    phases: Dict[str, float] = {}
    listings: List[Tuple[int, int]] = []  # the handles' listings: (rows, messages)

    def phase(name: str) -> None:
        phases[name] = time.monotonic() - started

    rng = random.Random(42)
    chain = ChainSettings(unique_prefix(), **CHAIN)
    jobs_queue = f"{chain.prefix}.jobs"
    args = ("--retry-policies", json.dumps([{"queue": jobs_queue, "base_ms": RETRY_BASE_MS, "factor": RETRY_FACTOR,
                                             "attempts": LAST_ATTEMPT + 2, "jitter": 0.2}]))
    far, late, by_handle, by_rule, load = plan(rng)
    messages = far + late + by_handle + by_rule + load
    old: Optional[GatewayProcess] = None
    new: Optional[GatewayProcess] = None
    consumers: List[Consumer] = []
    declaring: Optional[subprocess.Popen] = None
    try:
        # The old version declares its own topology, as it did before the upgrade.
        old = GatewayProcess(chain, *args, env=released_env(release), cwd=release).wait_ready(60)
        runs_released_code(old, release)
        phase("old ready")
        if mode == "rolling":  # the new version declares first (the chart's pre-upgrade hook), meanwhile
            declaring = subprocess.Popen([sys.executable, "-m", "gateway", "declare", *chain_args(chain), "--url",
                                          broker_url()], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                         text=True)
        with connect() as c:
            c.channel().queue_declare(jobs_queue, durable=True, arguments={
                "x-queue-type": "quorum", "x-dead-letter-exchange": chain.names.retry,
                "x-dead-letter-strategy": "at-least-once", "x-overflow": "reject-publish"})
        receiver = Consumer("", pick_up=chain.names.pick_up)
        rejecter = Rejecter(jobs_queue)
        consumers += [receiver, rejecter]
        publisher = Publisher(chain, messages, jobs_queue, random.Random(7))
        publisher.start()
        phase("publishing")

        # The old version cancels some of what it scheduled, with its own command.
        wait_until(lambda: publisher.error or len(eligible(publisher.confirmed(), "m-", now_ms() + OLD_MARGIN_MS))
                   >= 2 * CANCELS, 60, what="the load under way")
        by_old = pick(publisher.confirmed(), "m-", CANCELS, now_ms() + OLD_MARGIN_MS, rng, phases)
        out = released_cli(release, chain, "cancel", "--wait", "60", *by_old)
        assert out.returncode == 0 and out.stdout.count(": cancelled at ") == CANCELS, out.stdout + out.stderr
        # The contract's promise is for a cancel recorded a unit before its message is due: on a
        # machine busy enough that the command took longer than the margin, a cancel recorded
        # later may or may not win, and is held to neither.
        due = {m.message_id: m.not_before_ms for m in publisher.confirmed()}
        recorded_old = recorded_at(out.stdout)
        assert set(recorded_old) == set(by_old), out.stdout
        too_late = {mid for mid in by_old if recorded_old[mid] >= due[mid] - UNIT_MS}
        phase("old cancelled")

        # The new version takes over, while messages are still being published.
        takeover_ms = now_ms()
        if mode == "stop-first":
            old_held = old.metric("delay_gateway_held_messages")
            assert old.terminate(30) == 0, "".join(old.raw[-20:])
            new = GatewayProcess(chain, *args).wait_ready(60)
        else:
            assert declaring is not None and declaring.wait(120) == 0, declaring and declaring.communicate()
            new = GatewayProcess(chain, *args).wait_ready(60)
            # (what the new check-in sends by the shorter path reaches the old distributor too)
            wait_until(lambda: new.metric("delay_gateway_messages_total", queue=chain.names.check_in,
                                          outcome="distributor") > 0, 10, 0.01, "the new version's shorter path")
            old_held = old.metric("delay_gateway_held_messages")
            assert old.terminate(30) == 0, "".join(old.raw[-20:])
        took_over_ms = now_ms()
        phase("taken over")
        publisher.stop.set()
        publisher.join(60)
        during = publisher.during
        assert publisher.error is None and publisher.window.acked == len(messages) + len(during) + JOBS, \
            publisher.error
        phase("published")

        # The new version cancels by id some of what the old one scheduled, and reschedules some.
        by_new = pick(late, "late-", CANCELS, now_ms() + MARGIN_MS, rng, phases)
        again = [Message(f"again.{i}", f"again-{mid}".encode(), mid, 2500, 0, False)
                 for i, mid in enumerate(by_new[:RESCHEDULED])]
        with connect() as c:
            ch = c.channel()
            ch.confirm_delivery()
            for mid in by_new:
                ch.basic_publish(chain.names.cancel, "", b"", lazy_properties.WireProperties(
                    Properties.build(message_id=mid.encode())), mandatory=True)
            for m in again:  # each after its cancel's confirm: only the older one is cancelled
                ch.basic_publish(chain.names.check_in, m.key, m.body, lazy_properties.WireProperties(m.published()),
                                 mandatory=True)
        phase("new cancelled")

        # ... by one group cancel (a rule, new in 1.0), meanwhile (it waits until the gateways
        # report removing what it listed, a lap, or --wait) ...
        ruled: List[subprocess.CompletedProcess] = []
        rule = threading.Thread(target=lambda: ruled.append(pending(chain, "cancel", "--key", "rule.#", "--yes",
                                                                     "--wait", "15")))
        rule.start()
        # ... and by handle, those without an id the old one scheduled: their handles from its
        # `pending list`, to its `cancel` (until it lists them all: a version may list what an
        # older one scheduled only from its next pass through a gateway, here the next lap).
        def handles() -> Optional[List[str]]:
            out = pending(chain, "list", "--json", "--limit", "0", "--key", "handle.#")
            rows = [json.loads(line) for line in out.stdout.splitlines()]
            found = sorted({row["handle"] for row in rows})
            listings.append((len(rows), len(found)))  # (each message once: checked at the end)
            return found if len(found) == BY_HANDLE else None
        listed = wait_until(handles, 30, 0.2, "the new version's `pending list` of those without an id")
        out = current_cli(chain, "cancel", "--wait", "60", *listed)
        assert out.returncode == 0 and out.stdout.count(": cancelled at ") == BY_HANDLE, out.stdout + out.stderr
        assert now_ms() < min(m.not_before_ms for m in by_handle) - UNIT_MS, \
            "cancelled by handle too late to be kept: a machine too busy for this test"
        phase("new cancelled by handle")
        rule.join(120)
        recorded = re.search(r"^recorded at (\d{4}-\d\d-\d\dT[\d:.]+(?:Z|[+-]\d\d:\d\d))",
                             ruled[0].stdout if ruled else "", re.M)
        assert recorded, f"the new version's rule was not recorded: {ruled and ruled[0].stdout}"
        assert datetime.datetime.fromisoformat(recorded.group(1)).timestamp() * 1000 < \
            min(m.not_before_ms for m in by_rule) - UNIT_MS, "the rule was recorded too late to be kept: a machine " \
                                                             "too busy for this test"
        phase("new cancelled by rule")

        # A sentinel due after everything else: once it arrives, the rest has been released.
        last_ms = max(m.not_before_ms for m in late + by_handle + by_rule + load + during + again)
        sentinel = Message("sentinel", b"sentinel", "sentinel", last_ms + 1000 - now_ms(), 2, True)
        with connect() as c:
            ch = c.channel()
            ch.confirm_delivery()
            ch.basic_publish(chain.names.check_in, sentinel.key, sentinel.body,
                             lazy_properties.WireProperties(sentinel.published()), mandatory=True)
        wait_until(lambda: any(a.body == b"sentinel" for a in list(receiver.got)),
                   max(0, sentinel.not_before_ms - now_ms()) / 1000 + 30, 0.1, f"the sentinel ({phases})")
        phase("sentinel")

        cancelled = (set(by_old) - too_late) | set(by_new)
        expected = {m.body for m in late + load if m.message_id not in cancelled | too_late} \
            | {m.body for m in during + again} | {b"sentinel"}
        # (anything late still comes: lost is what never does)
        wait_until(lambda: expected <= {a.body for a in list(receiver.got)}, 10, 0.1, fail=False)
        wait_until(lambda: sum(1 for a in list(rejecter.got) if attempt_of(a) == LAST_ATTEMPT) >= JOBS, 30, 0.1,
                   fail=False)
        far_counts: List[dict] = []
        wait_until(lambda: far_counts.append(counted(chain, "far.#")) or far_counts[-1]["total"] == len(far), 30, 0.5,
                   fail=False)
        phase("far counted")
        shorter = new.metric("delay_gateway_messages_total", outcome="distributor")  # (from check-in and returning)
    finally:
        for consumer in consumers:
            consumer.close()
        for gateway in (old, new):
            if gateway is not None and gateway.proc.poll() is None:
                gateway.terminate()
        if declaring is not None and declaring.poll() is None:
            declaring.kill()
        try:
            with connect() as c:
                c.channel().queue_delete(jobs_queue)
        except Exception:  # (the broker is shared: best effort)
            pass
        remove(chain)
    seconds = time.monotonic() - started

    # -- what came -----------------------------------------------------------------------------
    assert receiver.error is None and rejecter.error is None, (receiver.error, rejecter.error)
    sent = {m.body: m for m in messages + during + again + [sentinel]}
    arrivals: Dict[bytes, List[Arrival]] = {}
    for a in receiver.got:
        arrivals.setdefault(a.body, []).append(a)
    cancelled_bodies = {m.body for m in late + load if m.message_id in cancelled} \
        | {m.body for m in by_handle + by_rule}
    lost = sorted(expected - set(arrivals))
    unknown = sorted(set(arrivals) - set(sent))
    early = sorted(b for b, got in arrivals.items() if b in sent and min(a.at_ms for a in got) < sent[b].not_before_ms)
    duplicates = sum(len(got) - 1 for got in arrivals.values())
    through = sorted(cancelled_bodies & set(arrivals))
    far_delivered = sorted({m.body for m in far} & set(arrivals))
    changed = sorted(b for b, got in arrivals.items() if b in sent
                     and not all(as_sent(a, sent[b].props, sent[b].key) for a in got))
    after = sum(1 for a in receiver.got if a.at_ms >= took_over_ms)
    lateness = sorted(min(a.at_ms for a in got) - sent[b].not_before_ms for b, got in arrivals.items() if b in sent)

    # -- the jobs ------------------------------------------------------------------------------
    jobs: Dict[bytes, List[Arrival]] = {}
    for a in rejecter.got:
        jobs.setdefault(a.body, []).append(a)
    attempts = {body: [attempt_of(a) for a in got] for body, got in jobs.items()}
    wrong_attempts = sorted(b for b in (b"job-%d" % j for j in range(JOBS))
                            if attempts.get(b) != list(range(LAST_ATTEMPT + 1)))
    retry_early = sorted(body for body, got in jobs.items() for k, a in enumerate(got[1:], 1)
                         if k <= len(rejecter.rejected.get(body, [])) and
                         a.at_ms < rejecter.rejected[body][k - 1] + RETRY_BASE_MS * RETRY_FACTOR ** (k - 1))
    job_changed = sorted(body for body, got in jobs.items()
                         if not all(as_sent(a, job_properties(int(body[4:])), jobs_queue, (ATTEMPT,)) for a in got))

    errors = [e for g in (old, new) if g is not None for e in g.errors()]
    label = request.node.callspec.params["broker"][3:]
    report_figures("upgrade figures", (
        f"upgrade from {RELEASE_TAG} {mode} broker={label}: sent={len(sent)} (load={LOAD} during={len(during)} "
        f"late={LATE} far={len(far)} by_handle={BY_HANDLE} by_rule={BY_RULE} rescheduled={len(again)} sentinel=1) "
        f"delivered={len(receiver.got)} "
        f"after_takeover={after} lost={len(lost)} early={len(early)} duplicates={duplicates} "
        f"cancelled={len(cancelled) + BY_HANDLE + BY_RULE} cancelled_delivered={len(through)} "
        f"cancels_too_late={len(too_late)} changed={len(changed)} "
        f"far_waiting={far_counts[-1]['total']} (exact: {far_counts[-1]['exact']}) "
        f"jobs={JOBS} retries={len(rejecter.got) - len(jobs)} wrong_attempts={len(wrong_attempts)} "
        f"retry_early={len(retry_early)} takeover_ms={took_over_ms - takeover_ms} "
        f"stop_grace_expired={any(e.get('event') == 'stop_grace_expired' for e in old.lines) if old else None} "
        f"old_held_at_sigterm={old_held:g} new_by_the_shorter_path={shorter:g} "
        f"late_p50_ms={lateness[len(lateness) // 2]} late_max_ms={lateness[-1]} "
        f"handle_listings={listings} far_counted={[c['total'] for c in far_counts]} "
        f"rule=({', '.join(re.findall(r'^removed so far: (.*)$', ruled[0].stdout, re.M))}) "
        f"seconds={seconds:.1f} ("
        + ", ".join(f"{name} {at:.1f}" for name, at in phases.items()) + ")"))
    assert shorter > 0, "the new version sent nothing by the shorter path: the test ran the route of before"
    assert not lost, f"{len(lost)} lost: {lost[:5]}"
    assert not unknown, f"{len(unknown)} delivered that were never sent: {unknown[:5]}"
    assert not early, [(b, sent[b].not_before_ms - min(a.at_ms for a in arrivals[b])) for b in early[:5]]
    assert not through, f"{len(through)} cancelled but delivered: {through[:5]}"
    assert not far_delivered, far_delivered
    # No duplicate from the upgrade itself, unless the old version's confirms did not come within
    # its grace at SIGTERM: it says so (stop_grace_expired), and what it had not settled is
    # redelivered, as docs/upgrading.md allows. (Seen twice in runs of four or five workers,
    # 36-37 duplicates, before the test looked for that line; not reproduced alone.)
    graceless = old is not None and any(e.get("event") == "stop_grace_expired" for e in old.lines)
    assert duplicates == 0 or graceless, ([(b, len(got)) for b, got in arrivals.items() if len(got) > 1][:5], [
        (name, e) for name, g in (("old", old), ("new", new)) if g is not None
        for e in g.lines if e.get("level") == "warning"][-10:])
    assert not changed, [(b, sent[b].props, [a.props for a in arrivals[b]]) for b in changed[:3]]
    assert far_counts[-1]["total"] == len(far), f"`pending count --key far.#` never said {len(far)}: {far_counts[-1]}"
    assert not wrong_attempts, {b: attempts.get(b) for b in wrong_attempts[:5]}
    assert not retry_early, retry_early[:5]
    assert not job_changed, [(b, [a.props for a in jobs[b]]) for b in job_changed[:3]]
    assert not errors, errors[:5]
    # What waits is listed once: a lap that ended under the old version (the new reader takes a
    # lap's next entry in its place) is not one more copy of its message.
    rule_expected = [int(n) for n in re.findall(r"^removed so far: \d+ of the (\d+) expected", ruled[0].stdout, re.M)]
    assert all(rows == found for rows, found in listings), f"`pending list` as (rows, messages): {listings}"
    assert all(c["total"] <= len(far) for c in far_counts), f"`pending count` of {len(far)}: {far_counts}"
    assert all(n == BY_RULE for n in rule_expected), f"`pending cancel` of {BY_RULE} expected {rule_expected}"
