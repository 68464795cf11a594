"""`delay-gateway status`: the pure table from queue counts, and the command against a real
broker with messages waiting in several levels, in meditation and held by the distributor."""

import json
import os
import subprocess
import sys
import time

import pika
import pytest

from gateway.commands.status.metrics import carried_from_metrics, held_from_metrics
from gateway.commands.status.render import text
from gateway.commands.status.report import HORIZONS, Row, due_within, report
from topology import plan
from topology.encoding import Enter, Meditate, ToDistributor
from topology.names import Names
from topology.registry import ChainKey, Record, chain_queues, fold
from topology.retirement import Count, Observed

from .support import CHAIN_PATH, ROOT, broker_url, chain_args, connect, free_port, now_ms, wait_until

P = "p"


def observed(keys, counts=None, consumers=None, fixed=True):
    """Every queue of these chains and the fixed ones exists, holding counts.get(name, 0)."""
    counts, consumers = counts or {}, consumers or {}
    queues = {}
    names = Names(P)
    if fixed:
        for q in (names.check_in, names.returning, names.distributor, names.parking, names.parked):
            queues[q] = Count(counts.get(q, 0), consumers.get(q, 0))
    for k in keys:
        for q in chain_queues(k, Names(P, k.generation)):
            queues[q] = Count(counts.get(q, 0), consumers.get(q, 0))
    return Observed(queues, {})


def rows_by_label(r):
    return {row.label: row for row in r.rows}


OWN = ChainKey(1000, "quorum", "queue", 4)
N = Names(P, OWN.generation)


@pytest.mark.parametrize("label,due_min,due_max", [
    ("check-in", 0, None),
    ("returning", 0, None),
    ("1000ms-quorum-queue meditation.04", 1000, None),  # at least one unit, no upper bound
    ("1000ms-quorum-queue level 03 delay", 0, 16_000 + 50),  # 2^(k+1) units + lead
    ("1000ms-quorum-queue level 03 pass", 0, 8000 + 50),  # 2^k units + lead
    ("1000ms-quorum-queue level 00 delay", 0, 2000 + 50),
    ("1000ms-quorum-queue level 00 pass", 0, 1000 + 50),
    ("distributor ready", 0, 1050),
    ("distributor held", 0, 1050),
    ("parking", None, None),
    ("parked", None, None),
])
def test_each_place_has_its_window(label, due_min, due_max):
    r = report(P, OWN, 50, fold([Record("declared", 1, OWN)]), [OWN], observed([OWN]), 0, "metrics", 0)
    row = rows_by_label(r)[label]
    assert (row.due_min_ms, row.due_max_ms) == (due_min, due_max)


def test_due_within_counts_what_is_certainly_and_what_is_possibly_due():
    def row(messages, lo, hi):
        return Row("q", "q", "delay", messages, True, lo, hi)

    rows = [row(3, 0, 900), row(5, 0, 50_000), row(7, 0, 4_000_000), row(11, 1000, None), row(13, 0, None),
            Row("parked", "parked", "parked", 17, True, None, None)]
    got = [(w.within, w.at_least, w.at_most) for w in due_within(rows)]
    assert got == [("1 second", 3, 3 + 5 + 7 + 13), ("1 minute", 3 + 5, 39), ("1 hour", 8, 39),
                   ("1 day", 15, 39), ("later", 0, 11 + 13)]
    assert [h for h, _ in HORIZONS] == ["1 second", "1 minute", "1 hour", "1 day"]


def test_counts_add_up_and_held_messages_count_when_the_metrics_say_so():
    counts = {N.delay_queue(2): 4, N.meditation(4): 2, Names(P).distributor: 1, Names(P).parked: 9}
    r = report(P, OWN, 50, fold([Record("declared", 1, OWN)]), [OWN], observed([OWN], counts), 6, "metrics", 0)
    assert r.total == 4 + 2 + 1 + 9 + 6
    first_second = r.due_within[0]
    assert (first_second.at_least, first_second.at_most) == (0, 4 + 1 + 6 + 2 * 0)  # meditation: >= 1 s
    hour = r.due_within[2]
    assert (hour.at_least, hour.at_most) == (4 + 1 + 6, 4 + 1 + 6 + 2)
    assert not r.problems
    assert "distributor held" in text(r) and "             6" in text(r)


def test_held_messages_are_unknown_without_metrics_and_zero_without_consumers():
    obs = observed([OWN], consumers={Names(P).distributor: 2})
    r = report(P, OWN, 50, fold([Record("declared", 1, OWN)]), [OWN], obs, None, "give --metrics-url", 0)
    held = rows_by_label(r)["distributor held"]
    assert held.messages is None and "not visible over AMQP" in held.note
    assert any("2 consumer(s)" in n for n in r.notes)
    r = report(P, OWN, 50, fold([Record("declared", 1, OWN)]), [OWN], observed([OWN]), None, "x", 0)
    assert rows_by_label(r)["distributor held"].messages == 0


def test_a_missing_topology_is_said_plainly():
    r = report(P, OWN, 50, None, [OWN], Observed({}, {}), None, "x", 0)
    assert r.missing
    assert len(text(r).splitlines()) == 2 and "missing" not in text(r)  # --watch: the heading and the problem
    assert r.problems == [f"the topology is not declared under prefix {P!r} (no queue 'p.check-in'): run "
                          "`delay-gateway declare` with your settings, or check --prefix and --url"]


def test_other_settings_than_the_gateways_use_are_named():
    theirs = ChainKey(100, "quorum", "queue", 5)
    obs = observed([theirs], consumers={Names(P, theirs.generation).gateways(5): 2})
    r = report(P, OWN, 50, fold([Record("declared", 1, theirs)]), [OWN, theirs], obs, 0, "metrics", 0)
    assert r.problems == ["your settings (1000ms-quorum-queue, 4 levels) are not declared here; chains declared: "
                          "100ms-quorum-queue, 5 levels (2 gateways). Give status the gateways' --max-level, "
                          "--resolution-ms, --queue-type and --zero-bits"]
    assert "100ms-quorum-queue level 04 delay" in rows_by_label(r)


def test_several_chains_are_listed_and_a_retiring_one_says_when_it_is_empty():
    old = ChainKey(1000, "quorum", "queue", 5)
    seal = Record("sealed", 2, queues={N.meditation(5): 1_700_000_000_000})
    obs = observed([OWN, old], consumers={N.gateways(4): 3})
    r = report(P, OWN, 50, fold([Record("declared", 1, old), Record("declared", 1, OWN), seal]), [OWN, old],
               obs, 0, "metrics", 0)
    chains = {c.key: c for c in r.chains}
    assert chains[OWN].gateways == 3 and chains[OWN].yours and chains[OWN].empty_by_ms is None
    assert chains[old].gateways == 0 and chains[old].empty_by_ms == 1_700_000_000_000
    assert "retiring, empty by 2023-11-14 22:13:20 UTC" in text(r)
    assert any("2 chains exist" in n for n in r.notes)


def test_held_messages_are_read_from_prometheus_text():
    page = ('# TYPE delay_gateway_held_messages gauge\n'
            'delay_gateway_held_messages{queue="p.distributor"} 7.0\n'
            'delay_gateway_held_messages{queue="p.parking"} 3.0\n')
    assert held_from_metrics([page, page], "p.distributor") == 14


# -- against the broker ------------------------------------------------------------------
def cli(*args, timeout=60):
    return subprocess.run([sys.executable, "-m", "gateway", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "DELAY_GATEWAY_URL": broker_url()})


def where(delay_ms, chain, lead_ms=50):
    route = plan(delay_ms, chain, lead_ms)
    if isinstance(route, Meditate):
        return chain.meditation
    if isinstance(route, ToDistributor):
        return chain.names.distributor
    assert isinstance(route, Enter)
    return chain.names.delay_queue(route.level)  # it enters at its highest 1 bit


def test_status_shows_messages_waiting_in_several_levels(make_chain, run_gateway, capsys):
    """Resolution 20 s, so that messages stay where they entered while status looks, even
    on a loaded machine (the distributor holds what is due within a unit); a receiver is
    bound so that nothing is parked meanwhile."""
    chain = make_chain(max_level=3, resolution_ms=20_000)
    port = free_port()
    # each message alone: the broker's counts are then the messages themselves (with
    # carriers they are estimated: the next test)
    # (on the chain path: the per-level counts are the point; 15 s would be held otherwise)
    run_gateway(chain, *CHAIN_PATH, "--metrics-port", str(port), "--carrier-messages", "1")
    with connect() as c:
        ch = c.channel()
        q = ch.queue_declare("", exclusive=True).method.queue
        ch.queue_bind(q, chain.names.pick_up, "#")
        ch.confirm_delivery()
        delays = {15_000: 3, 30_000: 2, 50_000: 4, 90_000: 1, 200_000: 2, 400_000: 1}  # ms: how many
        for delay, n in delays.items():
            for _ in range(n):
                ch.basic_publish(chain.names.check_in, "s", b"x", pika.BasicProperties(headers={"x-delay": delay}),
                                 mandatory=True)
        expected = {}
        for delay, n in delays.items():
            expected[where(delay, chain)] = expected.get(where(delay, chain), 0) + n

        def placed() -> dict:
            """status --json once every message is where it entered: the confirms above only
            say they reached check-in. Until the gateway has forwarded one (and the
            distributor taken what it holds), it is in flight, counted nowhere."""
            r = cli("status", *chain_args(chain), "--json", "--metrics-url", f"http://127.0.0.1:{port}")
            assert r.returncode == 0, r.stderr
            doc = json.loads(r.stdout)
            rows = {row["role"] if row["role"] in ("check-in", "held") else row["name"]: row for row in doc["queues"]}
            settled = (doc["total"] == sum(delays.values()) and rows["check-in"]["messages"] == 0
                       and rows["held"]["messages"] == expected.get(chain.names.distributor, 0))
            return doc if settled else {}
        doc = wait_until(placed, 15, interval=0.1, what="check-in forwarding every message")
        started = time.monotonic()
        shown = cli("status", *chain_args(chain), "--metrics-url", f"http://127.0.0.1:{port}")
        took = time.monotonic() - started
        assert shown.returncode == 0, shown.stderr
        with capsys.disabled():
            print(f"\n--- status with messages in several levels (took {took:.2f} s) ---\n{shown.stdout}")
        queues = {row["name"]: row for row in doc["queues"]}
        held = next(row for row in doc["queues"] if row["role"] == "held")
        for name, n in expected.items():
            if name == chain.names.distributor:
                assert held["messages"] == n, held  # held by the distributor, seen through /metrics
            else:
                assert queues[name]["messages"] == n, (name, queues[name])
        assert doc["total"] == sum(delays.values())
        # within a minute: certainly what is held (<= 20 s) and in level 0 (<= 40 s); possibly
        # levels 1 and 2 (<= 80 s, 160 s) and meditation (>= 20 s)
        minute = doc["due_within"][1]
        assert (minute["within"], minute["at_least"], minute["at_most"]) == ("1 minute", 3 + 2, 13)
        ch.queue_delete(q)


def test_status_counts_the_messages_carriers_carry(make_chain, run_gateway):
    chain = make_chain(max_level=3, resolution_ms=20_000)
    port = free_port()
    run_gateway(chain, "--metrics-port", str(port), "--carrier-wait-ms", "1000")
    with connect() as c:
        ch = c.channel()
        ch.confirm_delivery()
        for _ in range(5):  # all five in one carrier, into level 1's delay queue
            ch.basic_publish(chain.names.check_in, "s", b"x", pika.BasicProperties(headers={"x-delay": 50_000}),
                             mandatory=True)
    level = Names(chain.prefix, chain.generation).delay_queue(1)

    def in_level() -> tuple:
        doc = json.loads(cli("status", *chain_args(chain), "--json", "--metrics-url",
                             f"http://127.0.0.1:{port}").stdout)
        row = next(r for r in doc["queues"] if r["name"] == level)
        return doc, row
    doc, row = wait_until(lambda: (found := in_level())[1]["messages"] and found, 10, 0.3,
                          what="the carrier in level 1")
    assert (row["messages"], row["carriers"]) == (5, 1) and doc["total"] == 5
    without = json.loads(cli("status", *chain_args(chain), "--json").stdout)
    assert next(r for r in without["queues"] if r["name"] == level)["messages"] == 1  # the broker's count
    assert any("carrier" in note for note in without["notes"])


def test_status_watch_refreshes_until_interrupted(make_chain):
    import signal
    chain = make_chain(max_level=2, resolution_ms=100)
    proc = subprocess.Popen([sys.executable, "-m", "gateway", "status", *chain_args(chain), "--watch", "--json",
                             "--interval", "0.2"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env={**os.environ, "DELAY_GATEWAY_URL": broker_url()})
    try:
        docs = [json.loads(proc.stdout.readline()) for _ in range(3)]  # one JSON document per line
    finally:
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)  # reading on: a full pipe would block its last report
    assert proc.returncode == 0, err
    assert [d["prefix"] for d in docs] == [chain.prefix] * 3
    assert docs[0]["at_ms"] < docs[1]["at_ms"] < docs[2]["at_ms"]


def test_status_says_when_the_topology_is_missing_and_exits_3(broker):
    r = cli("status", "--prefix", "nothing-here-" + str(now_ms()))
    assert r.returncode == 3 and r.stdout == ""
    # the one useful line, not a table of 50 rows that say "missing"
    [line] = r.stderr.splitlines()
    assert line.startswith("delay-gateway status: the topology is not declared under prefix") and "declare" in line


def test_carriers_are_counted_as_the_messages_they_carry_when_the_metrics_say_how_many():
    counts = {N.delay_queue(2): 4, N.meditation(4): 2, Names(P).distributor: 1}
    registry = fold([Record("declared", 1, OWN)])
    plain = report(P, OWN, 50, registry, [OWN], observed([OWN], counts), 0, "metrics", 0)
    assert rows_by_label(plain)["1000ms-quorum-queue level 02 delay"].messages == 4
    assert any("carrier" in note for note in plain.notes)  # said: these are broker messages
    page = "\n".join([
        'delay_gateway_batch_publishes_total{queue="p.check-in",outcome="chain"} 10.0',
        'delay_gateway_batched_messages_total{queue="p.check-in",outcome="chain"} 250.0',
        'delay_gateway_batch_publishes_total{queue="p.returning",outcome="chain"} 10.0',
        'delay_gateway_batched_messages_total{queue="p.returning",outcome="chain"} 50.0',
        'delay_gateway_batch_publishes_total{queue="p.check-in",outcome="meditation"} 4.0',
        'delay_gateway_batched_messages_total{queue="p.check-in",outcome="meditation"} 4.0', ""])
    carried = carried_from_metrics([page])
    assert carried == {"chain": 15.0, "meditation": 1.0}
    r = report(P, OWN, 50, registry, [OWN], observed([OWN], counts), 0, "metrics", 0, carried)
    level = rows_by_label(r)["1000ms-quorum-queue level 02 delay"]
    assert (level.messages, level.carriers) == (60, 4)
    assert rows_by_label(r)["1000ms-quorum-queue meditation.04"].carriers is None  # one each: exact
    assert "≈60" in text(r)


def test_what_a_cancel_can_promise_is_said_with_the_fix_where_it_is_limited():
    from gateway.commands.status.reads import cancel_guarantee
    found, problem = cancel_guarantee(True, (4, 3), 3)
    assert found["guarantee"] == "exact" and problem is None
    found, problem = cancel_guarantee(False, (3, 10), 1)
    assert found["guarantee"] == "one check-in consumer" and problem is None
    _, problem = cancel_guarantee(False, (3, 10), 2)
    assert problem.startswith("2 gateways consume check-in") and "--role distributor" in problem
    _, problem = cancel_guarantee(False, (4, 3), 2)
    assert "set_header_timestamp" in problem


def test_retries_per_source_queue_are_summed_from_the_gateways_metrics():
    from gateway.commands.status.metrics import retries_from_metrics
    page = ('# TYPE delay_gateway_retries_total counter\n'
            'delay_gateway_retries_total{queue="orders",outcome="scheduled"} 5.0\n'
            'delay_gateway_retries_total{queue="orders",outcome="delivered"} 3.0\n'
            'delay_gateway_retries_total{queue="jobs",outcome="gave_up"} 1.0\n')
    assert retries_from_metrics([page, page]) == {
        "orders": {"scheduled": 10, "delivered": 6, "gave_up": 0, "parked": 0},
        "jobs": {"scheduled": 0, "delivered": 0, "gave_up": 2, "parked": 0}}


def test_the_report_ends_in_the_order_the_cancelling_guide_says():
    """cancellations:, cancels:, the retries per queue (with --metrics-url), then notes and
    problems: docs/cancelling.md describes the end of the report in this order."""
    registry = fold([Record("declared", 1, OWN)])
    r = report(P, OWN, 50, registry, [OWN], observed([OWN]), None, "give --metrics-url", 0)
    r.cancellations = {"held": 2, "window_ms": 86_400_000, "guarantee": "exact", "arrival_stamp": True,
                       "check_in_consumers": 1}
    r.retries = {"orders": {"scheduled": 1, "delivered": 0, "gave_up": 0, "parked": 1}}
    r.problems.append("something wrong")
    lines = text(r).splitlines()
    firsts = [next(i for i, line in enumerate(lines) if line.startswith(start))
              for start in ("cancellations:", "cancels:", "retries by queue", "note:", "problem:")]
    assert firsts == sorted(firsts), lines
    assert "1 parked (the queue was gone, or the broker refused it)" in text(r)
    with open(os.path.join(ROOT, "docs", "cancelling.md"), encoding="utf-8") as f:
        guide = " ".join(f.read().split())
    assert ("prints `cancellations: N message id(s) cancelled within the retention window of 13.1 d` and the "
            "`cancels:` line above") in guide
    assert "then, with `--metrics-url`, the retries per queue, and last any `note:` and `problem:` lines" in guide


def test_the_retry_queue_has_its_row_and_counts_in_the_total(make_chain):
    """A failed message waiting in `<prefix>.retry` (no gateway reads it here): status finds
    the queue and counts it."""
    chain = make_chain(max_level=3, resolution_ms=100)
    with connect() as c:
        ch = c.channel()
        ch.confirm_delivery()
        ch.basic_publish(chain.names.retry, "", b"failed", pika.BasicProperties(
            headers={"x-retry-queue": f"{chain.prefix}.work"}), mandatory=True)
    r = cli("status", *chain_args(chain), "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    [row] = [q for q in doc["queues"] if q["role"] == "retry"]
    assert row["exists"] is True and row["messages"] == 1, row
    assert doc["total"] == 1
    shown = cli("status", *chain_args(chain)).stdout
    assert "missing" not in shown and any(line.split()[:2] == ["retry", "1"] for line in shown.splitlines()), shown
