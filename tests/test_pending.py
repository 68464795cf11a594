"""`delay-gateway pending` end to end, on every suite broker: the messages that wait are
listed exactly (through meditation laps, a retry, cancels by id and by handle), after a
gateway is killed and its connections cut mid-batch with two replicas, and `pending
cancel` cancels what its filters select and nothing else. Hostile ids and keys are listed
safely in every format."""

import base64
import collections
import csv
import io
import json
import subprocess
import sys
import threading
from typing import List, Optional

import pika
import pytest

from gateway.broker.plumbing import lazy_properties
from gateway.core import envelope
from gateway.core.wire import Properties, Table, long
from topology import ChainSettings, Topology, build
from topology.broker.declare import declare

from .faults.proxy import Proxy
from .support import ROOT, Receiver, broker_url, chain_args, connect, drain, now_ms, publish_sentinel, remove, \
    report_figures, unique_prefix, wait_until

RETRY_POLICY = [{"queue": "*.jobs", "base_ms": 40_000, "jitter": 0}]


def cli(chain, *args: str, url: Optional[str] = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gateway", *args, *chain_args(chain), "--url", url or broker_url()],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)


def listed(chain, *filters: str, url: Optional[str] = None) -> List[dict]:
    r = cli(chain, "pending", "list", "--json", "--limit", "0", *filters, url=url)
    assert r.returncode == 0, r.stderr
    return [json.loads(line) for line in r.stdout.splitlines()]


def counted(chain, *filters: str) -> dict:
    r = cli(chain, "pending", "count", "--json", *filters)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def publish(chain, messages, url: Optional[str] = None) -> None:
    """(routing key, message id or None, due epoch ms), confirmed, in order."""
    with connect(url) as c:
        ch = c.channel()
        ch.confirm_delivery()
        for key, mid, due in messages:
            ch.basic_publish(chain.names.check_in, key, b"body-" + key.encode(), pika.BasicProperties(
                message_id=mid, delivery_mode=2, headers={"x-deliver-at": due}), mandatory=True)


def ids_of(rows: List[dict]) -> List[str]:
    return sorted(r["message_id"] or r["handle"] for r in rows)


def test_what_waits_is_listed_exactly_through_laps_a_retry_and_cancels(make_chain, run_gateway):
    """A chain of 4 levels x 250 ms (laps of 3.75 s): delays of 0.5 s to 400 days, one
    without an id, one cancelled by its id, then one by its handle, and a retry. Each list
    shows exactly what waits, with its due time: everything published and not yet
    delivered or cancelled, but what arrived while the list was being taken (a slow
    machine) and so may or may not be in it."""
    chain = make_chain(max_level=4, resolution_ms=250)
    run_gateway(chain, "--retry-policies", json.dumps(RETRY_POLICY))
    receiver = Receiver(chain)
    t0 = now_ms()
    # (noid is cancelled by its handle after four listings, each a command's start and reads: a
    # busy machine takes seconds each, and a cancel wins only a unit or more before it is due)
    noid_due = t0 + 28_000
    due = {"now": t0 + 500, "b": t0 + 8000, "c": t0 + 16_000, "d": t0 + 32_000, "year": t0 + 400 * 86_400_000,
           "cancel-me": t0 + 12_000}
    publish(chain, [(f"orders.{mid}", mid, at) for mid, at in due.items()] + [("orders.noid", None, noid_due)])
    assert cli(chain, "cancel", "cancel-me").stdout.startswith("cancel-me: cancelled at ")
    with connect() as c:  # a consumer rejects a job: it comes back in 40 s
        ch = c.channel()
        jobs = f"{chain.prefix}.jobs"
        ch.queue_declare(jobs, durable=True, arguments={"x-queue-type": "quorum",
                                                        "x-dead-letter-exchange": chain.names.retry})
        ch.confirm_delivery()
        ch.basic_publish("", jobs, b"job", pika.BasicProperties(message_id="job-1", delivery_mode=2))
        method, _, _ = ch.basic_get(jobs)
        ch.basic_reject(method.delivery_tag, requeue=False)
    wait_until(lambda: counted(chain, "--retries")["total"] == 1, 15, 0.2, "the retry in the index")
    arrived: List[str] = []
    waiting = set(due) - {"cancel-me"} | {"job-1", "noid"}

    def exactly(count: bool = False) -> List[dict]:
        """The list: what waits, but for what arrived while it was read; with `count`,
        `pending count` just before it says as many, but for those."""
        arrived.extend(m.properties.message_id for m in drain_received(receiver))
        before = set(arrived)
        total = counted(chain)["total"] if count else None
        rows = listed(chain)
        arrived.extend(m.properties.message_id for m in drain_received(receiver))
        meanwhile = set(arrived) - before
        shown = {r["message_id"] or "noid" for r in rows}
        assert len(shown) == len(rows), rows  # each once: a lap's next entry takes its place
        assert shown <= waiting - before and waiting - before - shown <= meanwhile, (shown, arrived)
        if total is not None:
            assert len(rows) <= total <= len(rows) + len(meanwhile), (total, rows, meanwhile)
        return rows

    assert [m.properties.message_id for m in receiver.collect(1, 10)] == ["now"]
    arrived.append("now")
    first = exactly()
    for row in first:
        if row["message_id"] in due:
            assert row["due_ms"] == due[row["message_id"]] and row["routing_key"] == f"orders.{row['message_id']}"
            assert row["size"] == len(b"body-orders.") + len(row["message_id"]) and row["retry_attempt"] is None
    [job] = listed(chain, "--retries")
    assert (job["message_id"], job["routing_key"], job["retry_queue"], job["retry_attempt"]) == \
        ("job-1", jobs, jobs, 1)
    exactly(count=True)

    # b arrives at 8 s; c and d lap meditation meanwhile (laps of 3.75 s): still listed, once
    wait_until(lambda: arrived.extend(m.properties.message_id for m in drain_received(receiver)) or "b" in arrived,
               20, 0.1, "b delivered")
    noid = first_handle(first)
    exactly()
    out = cli(chain, "cancel", noid)  # the one without an id, by its handle
    assert out.returncode == 0 and out.stdout.startswith(f"{noid}: cancelled at "), out.stdout + out.stderr
    assert now_ms() < noid_due - 250, "too slow: the handle's cancel came within a unit of its due time"
    waiting.discard("noid")
    exactly()

    # c and d arrive after their laps; nothing else does (cancel-me at 12 s, noid at 28 s)
    wait_until(lambda: arrived.extend(m.properties.message_id for m in drain_received(receiver)) or "d" in arrived,
               40, 0.1, "d delivered")
    assert arrived == ["now", "b", "c", "d"], arrived
    assert ids_of(exactly()) == sorted(["year", "job-1"])
    report_figures("pending figures", f"listed through laps: {len(first)}, then 2; cancelled by id and by handle")
    receiver.close()


def drain_received(receiver: Receiver) -> list:
    """What arrived since the last look."""
    seen = len(receiver.messages)
    return receiver.take()[seen:]


def first_handle(rows: List[dict]) -> str:
    [handle] = [r["handle"] for r in rows if r["message_id"] is None]
    return handle


def test_pending_cancel_cancels_what_its_filters_select_and_nothing_else(make_chain, run_gateway):
    """`--key 'orders.42.#'`: one rule; the three of customer 42 (one without an id) are
    cancelled, the gateway reports removing them as they pass it; orders.421.x, a bystander
    due just after them, arrives on time, as does orders.43.y."""
    chain = make_chain(max_level=4, resolution_ms=250)
    run_gateway(chain)
    receiver = Receiver(chain)
    t0 = now_ms()
    # (due in 30 s: five commands run before then, each a Python start on a busy machine)
    publish(chain, [("orders.42.a", "42-a", t0 + 30_000), ("orders.42.b", "42-b", t0 + 30_000),
                    ("orders.42.c", None, t0 + 30_000), ("orders.421.x", "421-x", t0 + 30_500),
                    ("orders.43.y", "43-y", t0 + 30_500)])
    wait_until(lambda: counted(chain)["total"] == 5, 15, 0.2, "the five in the index")
    dry = cli(chain, "pending", "cancel", "--key", "orders.42.#")
    assert dry.returncode == 0 and dry.stdout.startswith("3 waiting message(s) match, for example:"), dry.stdout
    assert "nothing cancelled: add --yes to cancel these 3" in dry.stdout
    assert counted(chain)["total"] == 5
    done = cli(chain, "pending", "cancel", "--key", "orders.42.#", "--yes")
    assert done.returncode == 0 and "recorded at " in done.stdout, done.stdout + done.stderr
    assert ids_of(listed(chain)) == ["421-x", "43-y"]
    assert now_ms() < t0 + 30_000, "too slow to cancel before they were due"
    got = receiver.collect(2, 40)
    late = [m.at_ms - t0 - 30_500 for m in got]
    assert sorted(m.properties.message_id for m in got) == ["421-x", "43-y"] and all(ms >= 0 for ms in late), late
    # (customer 42's were due half a second earlier: released before these, had they not been cancelled)
    assert drain(receiver.channel, receiver.queue) == []
    receiver.close()


def test_nothing_waiting_is_missing_after_a_kill_and_cut_connections_with_two_replicas(make_chain, run_gateway,
                                                                                       broker_ctl):
    """Two gateways share the queues. Replica A is SIGKILLed halfway through a batch; then
    replica B's connections are cut mid-batch; A starts again. The list taken then, before
    anything is due, holds every message, and no message more often than it is then
    delivered."""
    chain = make_chain(max_level=5, resolution_ms=500)  # laps of 15.5 s: the later half laps once
    proxy = Proxy(broker_url())
    replicas = [run_gateway(chain, "--carrier-wait-ms", "50", url=proxy.url) for _ in range(2)]
    receiver = Receiver(chain)
    t0 = now_ms()
    batch = 400
    due = [t0 + 35_000 + (n % 2) * 6000 for n in range(2 * batch)]  # (the later half laps meditation once)
    sent = threading.Event()

    def publisher() -> None:
        with connect() as c:
            ch = c.channel()
            ch.confirm_delivery()
            for n, at in enumerate(due):
                ch.basic_publish(chain.names.check_in, f"load.{n % 7}", b"x", pika.BasicProperties(
                    message_id=f"m-{n}", delivery_mode=2, headers={"x-deliver-at": at}), mandatory=True)
                if n == batch // 2:
                    replicas[0].kill()
                if n == batch:
                    proxy.cut()  # B's connections, mid-batch
        sent.set()

    thread = threading.Thread(target=publisher, daemon=True)
    thread.start()
    wait_until(sent.is_set, 60, 0.1, "the batches published")
    replicas.append(run_gateway(chain, "--carrier-wait-ms", "50", url=proxy.url))

    def settled() -> bool:
        """Check-in holds nothing, not even unacknowledged (a delivery is acknowledged only
        once its messages and their entries are confirmed)."""
        for line in broker_ctl("list_queues", "-q", "--no-table-headers", "name", "messages").splitlines():
            name, _, messages = line.rpartition("\t")
            if name == chain.names.check_in:
                return int(messages) == 0
        return False
    wait_until(settled, 60, 0.5, "check-in read and acknowledged")
    rows = listed(chain)
    assert now_ms() < t0 + 35_000, "the list came too late to be taken before anything was due"
    # Any copy more than listed would show before a sentinel due after them all.
    publish_sentinel(chain, max(due), absolute=True)
    got = receiver.until_sentinel(max(0, max(due) - now_ms()) / 1000 + 60)
    listed_ids = collections.Counter(r["message_id"] for r in rows)
    delivered = collections.Counter(m.properties.message_id for m in got)
    assert set(delivered) == {f"m-{n}" for n in range(len(due))}, "lost"
    # Nothing missing: every message listed; a duplicate the faults made is listed once or
    # twice (its first copy's entry may have been cut off with the connection), never more
    # often than it is delivered.
    assert set(listed_ids) == set(delivered) and not listed_ids - delivered, listed_ids - delivered
    report_figures("pending figures", f"kill + cut with two replicas: sent {len(due)}, listed {len(rows)}, "
                                      f"delivered {sum(delivered.values())}")
    proxy.close()
    receiver.close()


HOSTILE_IDS = ["x" * 255, "tab\there", "line\nbreak\rcarriage", "\x1b[2Jclear", "comma,\"quote\"", "é-ünïcödé"]


def test_hostile_ids_and_keys_are_listed_safely_in_every_format(make_chain, run_gateway):
    chain = make_chain(max_level=3, resolution_ms=1000)
    run_gateway(chain)
    t0 = now_ms()
    publish(chain, [(f"k.{n}\t\x07", mid, t0 + 600_000) for n, mid in enumerate(HOSTILE_IDS)])
    # (exact: no beat still says its check-in holds some it read, which the table would note)
    wait_until(lambda: (c := counted(chain))["total"] == len(HOSTILE_IDS) and c["exact"], 15, 0.2,
               "all in the index, exactly")
    table = cli(chain, "pending", "list")
    assert table.returncode == 0, table.stderr
    assert not any(c in table.stdout for c in "\x1b\x07\r\t"), repr(table.stdout)
    assert len(table.stdout.splitlines()) == 1 + len(HOSTILE_IDS) + 2  # a line each, however hostile
    rows = listed(chain)
    assert sorted(r["message_id"] for r in rows) == sorted(HOSTILE_IDS)
    assert sorted(r["routing_key"] for r in rows) == sorted(f"k.{n}\t\x07" for n in range(len(HOSTILE_IDS)))
    out = subprocess.run([sys.executable, "-m", "gateway", "pending", "list", "--csv", *chain_args(chain),
                          "--url", broker_url()], cwd=ROOT, capture_output=True, timeout=120)  # (bytes: \r kept)
    parsed = list(csv.DictReader(io.StringIO(out.stdout.decode("utf-8"), newline="")))
    assert sorted(r["message_id"] for r in parsed) == sorted(HOSTILE_IDS)


@pytest.mark.brokers("rmq3.10", "rmq4.0", reason="RabbitMQ 4.3 refuses a routing key or message id that is not "
                                                 "UTF-8 (501 FRAME_ERROR)")
def test_bytes_that_are_not_utf8_come_back_exactly_in_json(make_chain, run_gateway):
    chain = make_chain(max_level=3, resolution_ms=1000)
    run_gateway(chain)
    key, mid = b"k.\xff\xfe.bin", b"id-\xc3\x28"
    with connect() as c:
        ch = c.channel()
        ch.confirm_delivery()
        ch.basic_publish(chain.names.check_in, key, b"x", lazy_properties.WireProperties(Properties.build(
            message_id=mid, headers=Table([long("x-deliver-at", now_ms() + 600_000)]))), mandatory=True)
    [row] = wait_until(lambda: listed(chain), 15, 0.2, "listed")
    assert base64.b64decode(row["routing_key_base64"]) == key and base64.b64decode(row["message_id_base64"]) == mid
    table = cli(chain, "pending", "list")
    assert "k.\\xff\\xfe.bin" in table.stdout, table.stdout


def test_after_an_upgrade_from_a_version_without_the_index_the_count_says_what_it_cannot_list(broker):
    """A broker where messages wait in a chain declared by a version without the index: the
    declare that creates the index says so in the registry, and `pending count` says until
    when it cannot be exact instead of an exact 0."""
    prefix = unique_prefix()
    chain = ChainSettings(prefix=prefix, max_level=4, resolution_ms=250)
    full = build(chain)
    older = Topology(chain, full.exchanges, tuple(q for q in full.queues if q.role != "waiting"),
                     tuple(b for b in full.bindings if not b.destination.startswith(chain.names.waiting)))
    try:
        with connect() as c:
            declare(c.channel(), older)
            ch = c.channel()
            ch.confirm_delivery()
            user = Properties.build(message_id=b"before-the-index", delivery_mode=2)
            props = envelope.inside(user, b"orders.1", now_ms() + 200 * 86_400_000)
            ch.basic_publish(chain.meditation, "", b"waits", lazy_properties.WireProperties(props), mandatory=True)
        out = cli(chain, "declare")
        assert out.returncode == 0, out.stderr
        count = counted(chain)
        assert count["total"] == 0 and not count["exact"]
        [note] = [n for n in count["notes"] if "before the index of what waits existed" in n]
        assert "are listed from their next lap, or not at all until due (until " in note
    finally:
        remove(chain)
