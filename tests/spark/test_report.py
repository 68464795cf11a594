"""`record` and `report` on a real recorded run, checked against a direct computation.

Cost: about 15 s on an idle machine (a gateway, a small schedule run, one report)."""

import json
import math
import threading
from collections import Counter, defaultdict

import pytest

from gateway.cli import main
from gateway.spark.record import DeliveryRecorder

pytestmark = pytest.mark.spark

EDGES = [(0, "overdue"), (1_000, "0-1s"), (10_000, "1-10s"), (60_000, "10s-1m"), (600_000, "1-10m"),
         (3_600_000, "10m-1h"), (86_400_000, "1h-1d")]


def bucket(delay):
    if delay is None:
        return "unknown"
    return next((label for edge, label in EDGES if delay < edge), "1d+")


def percentile(values, p):
    """Linear interpolation between the closest ranks (numpy's default)."""
    v = sorted(values)
    pos = p * (len(v) - 1)
    lo, hi = math.floor(pos), math.ceil(pos)
    return v[lo] + (v[hi] - v[lo]) * (pos - lo)


def direct(lines):
    """What the report must say, computed without Spark."""
    recs, unreadable = [], 0
    for line in lines:
        if not line.strip():
            continue
        try:
            r = json.loads(line)
        except ValueError:
            unreadable += 1
            continue
        if r.get("arrived_at") is not None:
            recs.append(r)
    ids = Counter(r["message_id"] for r in recs if r["message_id"] is not None)
    firsts, seen = [], set()
    for r in sorted(recs, key=lambda r: r["arrived_at"]):
        if r["message_id"] is None or r["message_id"] not in seen:
            firsts.append(r)
            seen.add(r["message_id"])
    timed = [r for r in firsts if r["due_at"] is not None]

    def stats(rs):
        lat = [r["arrived_at"] - r["due_at"] for r in rs]
        return {"messages": len(lat), "min": min(lat), "max": max(lat), "mean": sum(lat) / len(lat),
                **{name: percentile(lat, p) for name, p in (("p50", .5), ("p90", .9), ("p99", .99),
                                                             ("p999", .999))}}

    groups = defaultdict(list)
    keys = defaultdict(list)
    for r in timed:
        groups[bucket(r["delay_ms"])].append(r)
        keys[r["routing_key"]].append(r)
    seconds = Counter(r["arrived_at"] // 1000 for r in recs)
    return {"unreadable_lines": unreadable, "deliveries": len(recs), "messages": len(firsts),
            "duplicate_deliveries": len(recs) - len(firsts),
            "duplicated_messages": sum(1 for c in ids.values() if c > 1),
            "redelivered": sum(r["redelivered"] for r in recs),
            "without_due": sum(r["due_at"] is None for r in recs),
            "early": sum(1 for r in recs if r["due_at"] is not None and r["arrived_at"] < r["due_at"]),
            "lateness": stats(timed), "buckets": {b: stats(rs) for b, rs in groups.items()},
            "keys": {k: stats(rs) for k, rs in keys.items()}, "per_second": dict(seconds)}


def close(a, b):
    return a == pytest.approx(b, abs=1e-3)


def same_stats(got, want):
    assert got["messages"] == want["messages"]
    for k in ("min", "max", "mean", "p50", "p90", "p99", "p999"):
        assert close(got[k], want[k]), (k, got[k], want[k])


def test_report_numbers_match_a_direct_computation(spark, broker, make_chain, run_gateway, tmp_path):
    chain = make_chain(max_level=4, resolution_ms=100)
    run_gateway(chain, "--stamp-due-at")
    records = tmp_path / "records.jsonl"
    n = 60
    with open(records, "w") as out:
        recorder = DeliveryRecorder(broker, chain.names.pick_up, out, "#", None, chain.prefix)
        thread = threading.Thread(target=recorder.run, kwargs=dict(limit=n), daemon=True)
        thread.start()
        assert recorder.ready.wait(10)
        table = tmp_path / "in.csv"
        table.write_text("routing_key,payload,delay_ms\n" + "".join(
            f"k.{i % 3},row {i},{(i * 37) % 2000}\n" for i in range(n)))
        assert main(["schedule", str(table), "--url", broker, "--prefix", chain.prefix, "--progress-interval", "0",
                     "--errors", str(tmp_path / "errors"), "--summary", str(tmp_path / "s.json"),
                     "--state", str(tmp_path / "state")]) == 0
        thread.join(120)
        recorder.stop()
        thread.join(5)
    lines = records.read_text().splitlines()
    assert len(lines) == n
    recorded = [json.loads(line) for line in lines]
    assert all(r["due_source"] == "stamp" and r["arrived_at"] >= r["due_at"] for r in recorded)
    assert {r["routing_key"] for r in recorded} == {"k.0", "k.1", "k.2"}
    assert not any(r["redelivered"] for r in recorded)

    # What a real run rarely shows, added as lines `record` would write: a redelivered
    # duplicate, an early delivery, one without due time or id, delays in other buckets, and
    # lines that are not records at all.
    first = recorded[0]
    extra = [dict(first, arrived_at=first["arrived_at"] + 1500, redelivered=True),
             dict(first, message_id="early-1", due_at=first["arrived_at"] + 40, delay_ms=90_000),
             dict(first, message_id="slow-1", due_at=first["arrived_at"] - 250, delay_ms=7_200_000,
                  routing_key="k.other"),
             dict(first, message_id="no-due", due_at=None, due_source=None, delay_ms=None),
             dict(first, message_id=None, due_at=first["arrived_at"] - 5),
             dict(first, message_id="overdue-1", due_at=first["arrived_at"] - 900, delay_ms=-800)]
    lines += [json.dumps(e) for e in extra] + ["", "not json at all", '{"message_id": "half"']
    records.write_text("\n".join(lines) + "\n")

    out = tmp_path / "report"
    assert main(["report", str(records), "--out", str(out)]) == 0
    got = json.loads((out / "summary.json").read_text())
    want = direct(lines)
    for k in ("unreadable_lines", "deliveries", "messages", "duplicate_deliveries", "duplicated_messages",
              "redelivered", "without_due", "early"):
        assert got[k] == want[k], k
    assert (want["early"], want["duplicate_deliveries"], want["unreadable_lines"]) == (1, 1, 2)
    same_stats(got["lateness_ms"], want["lateness"])
    assert {b["delay_bucket"] for b in got["by_delay_bucket"]} == set(want["buckets"])
    for b in got["by_delay_bucket"]:
        same_stats(b, want["buckets"][b["delay_bucket"]])
    assert {k["routing_key"] for k in got["by_routing_key"]} == set(want["keys"])
    for k in got["by_routing_key"]:
        same_stats(k, want["keys"][k["routing_key"]])
    per_second = {r["second"]: r["count"] for r in spark.read.parquet(str(out / "per_second")).collect()}
    assert per_second == want["per_second"]
    assert got["throughput"]["peak_per_second"] == max(want["per_second"].values())
    assert spark.read.parquet(str(out / "deliveries")).count() == want["deliveries"]
    md = (out / "summary.md").read_text()
    assert f"early (delivered before due): **{want['early']}**" in md
    for png in ("lateness.png", "deliveries.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
