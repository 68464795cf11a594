"""`delay-gateway schedule` end to end: a real local Spark, the real broker and gateway.

Cost: about 10 s per format on an idle 2-core machine once the shared SparkSession runs,
and 30-40 s for the kill test (a Spark process of its own, started and killed)."""

import json
import os
import signal
import subprocess
import sys
import uuid

import pytest

from gateway.cli import main
from gateway.spark import rows as R

from ..support import ROOT, Receiver, chain_args, connect, drain, now_ms, publish_sentinel, unique_prefix, wait_until
from . import data

# The Spark jobs are publishers and consumers like any other: what they test is Spark's
# side (formats, rejections, resuming, the report), not the broker's. On 4.3 `schedule` from
# CSV, `record` with the report, and the publisher's confirms; the other formats and the
# resuming cases on 3.10 only, about 90 s each.
pytestmark = [pytest.mark.spark,
              pytest.mark.brokers("rmq3.10", when={"fmt": "json"}),
              pytest.mark.brokers("rmq3.10", when={"fmt": "parquet"})]

# "On time" here only means "not stuck or parked": lateness targets live in the benchmark,
# and a loaded CI machine stalls for seconds.
ON_TIME_MS = 10_000


def schedule_args(chain, broker, path, tmp, *extra):
    return ["schedule", path, "--url", broker, "--prefix", chain.prefix, "--spark-conf", "spark.ui.enabled=false",
            "--errors", str(tmp / "errors"),
            "--summary", str(tmp / "summary.json"), "--state", str(tmp / "state"),
            "--max-payload-bytes", str(data.MAX_PAYLOAD), "--progress-interval", "0", *extra]


def read_errors(spark, fmt, path):
    reader = spark.read
    if fmt == "csv":
        df = reader.option("header", True).option("escape", '"').csv(path)
    elif fmt == "json":
        df = reader.json(path)
    else:
        df = reader.parquet(path)
    return df.collect()


@pytest.mark.parametrize("fmt", ["csv", "json", "parquet"])
def test_every_good_row_arrives_on_time_and_every_bad_row_is_rejected_with_its_reason(
        fmt, spark, broker, make_chain, run_gateway, tmp_path):
    chain = make_chain(max_level=4, resolution_ms=100)
    run_gateway(chain, "--stamp-due-at")
    receiver = Receiver(chain)
    t = data.table(fmt, now_ms())
    path = str(tmp_path / f"orders.{fmt}")
    data.write(t, fmt, path, spark)

    before = now_ms()
    assert main(schedule_args(chain, broker, path, tmp_path, "--rows-per-partition", "10")) == 0
    after = now_ms()

    # the summary adds up, reason by reason
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["read"] == data.row_count(t)
    assert summary["published"] == len(t.good)
    assert summary["rejected"] == data.row_count(t) - len(t.good)
    assert summary["read"] == summary["published"] + summary["rejected"]
    assert summary["rejected_by_reason"] == data.expected_reasons(t)
    assert summary["complete"] and summary["resumed"] == 0 and summary["not_published"] == 0

    # every bad row is in the errors output, with its reason and a readable detail
    errors = read_errors(spark, fmt, str(tmp_path / "errors"))
    by_case = {r["case"]: r for r in errors if r["case"] is not None}
    assert {case: r["_reason"] for case, r in by_case.items()} == t.bad
    assert all(r["_detail"] for r in errors)
    if fmt == "json":
        broken = [r for r in errors if r["case"] is None]
        assert [r["_reason"] for r in broken] == [R.UNPARSEABLE]
        assert broken[0]["_line"] == t.extra_lines[0]

    # every good row arrives once, as published, never early, and on time: anything extra
    # would show before a sentinel due after the last of them
    last_due = max(want["at"] if want["at"] is not None else after + want["delay"] for want in t.good.values())
    publish_sentinel(chain, last_due, absolute=True)
    got = receiver.until_sentinel(60)
    assert len(got) == len(t.good)
    by_id = {m.properties.message_id: m for m in got}
    by_body = {m.body: m for m in got}
    for case, want in t.good.items():
        m = by_id[want["message_id"]] if want["message_id"] else by_body[want["payload"].encode()]
        assert m.routing_key == want["key"] and m.body == want["payload"].encode(), case
        h = m.properties.headers
        due = h["x-gateway-due-at"]  # the gateway's stamp (--stamp-due-at) ...
        assert h["x-deliver-at"] == due  # ... is the due time the job published
        if want["at"] is not None:
            assert due == want["at"], case
        else:
            assert before + want["delay"] <= due <= after + want["delay"], case
        assert due <= m.at_ms < max(due, after) + ON_TIME_MS, case  # never early; on time
        assert m.properties.delivery_mode == 2
        if want["message_id"]:
            assert m.properties.message_id == want["message_id"]
        else:
            assert uuid.UUID(m.properties.message_id).version == 5
        if want["headers"]:
            assert {k: h[k] for k in want["headers"]} == want["headers"]
            assert isinstance(h["f"], float)


@pytest.mark.brokers("rmq3.10", reason="Spark's bookkeeping of what it published; `schedule` itself runs on 4.3 too")
def test_a_re_run_makes_the_same_message_ids_and_a_finished_run_publishes_nothing_again(
        spark, broker, make_chain, tmp_path):
    chain = make_chain(max_level=4, resolution_ms=100)  # no gateway: messages stay in check-in
    t = data.table("csv", now_ms(), copies=1)
    path = str(tmp_path / "orders.csv")
    data.write(t, "csv", path)
    args = schedule_args(chain, broker, path, tmp_path)
    assert main(args) == 0
    assert main(args) == 0  # the same command again: everything is resumed
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["resumed"] == len(t.good) and summary["published_this_run"] == 0
    assert main(args + ["--restart"]) == 0  # publish everything again, with the same ids
    with connect() as c:
        ids = [p.message_id for _, p, _ in drain(c.channel(), chain.names.check_in)]
    assert len(ids) == 2 * len(t.good)
    assert all(ids.count(i) == 2 for i in ids)


@pytest.mark.brokers("rmq3.10", reason="Spark's resume record; `schedule` itself runs on 4.3 too")
def test_a_run_killed_half_way_resumes_where_it_stopped(spark, broker, make_chain, tmp_path):
    chain = make_chain(max_level=4, resolution_ms=100)  # no gateway: count what reached check-in
    n = 4000
    path = tmp_path / "big.csv"
    with open(path, "w") as f:
        f.write("routing_key,payload,delay_ms\n")
        for i in range(n):
            f.write(f"k.{i % 7},row {i},{i % 1000}\n")
    args = schedule_args(chain, broker, str(path), tmp_path, "--rows-per-partition", "250", "--max-rate", "800")
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    first = subprocess.Popen([sys.executable, "-m", "gateway", *args, "--master", "local[2]"], cwd=ROOT, env=env,
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
    done_dir = tmp_path / "state" / "done"

    def four_done() -> bool:  # 4 of 16 partitions finished
        assert first.poll() is None, first.stderr.read()
        return len(list(done_dir.glob("*.json"))) >= 4
    try:
        wait_until(four_done, 120, 0.1, "the first run getting going")
    finally:
        os.killpg(first.pid, signal.SIGKILL)  # the driver, its JVM and the Python workers
        first.wait()
    finished_before = {json.loads(p.read_text())["partition"]: json.loads(p.read_text())["rows"]
                       for p in done_dir.glob("*.json")}
    assert 4 <= len(finished_before) < 16

    assert main(args) == 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["read"] == n and summary["rejected"] == 0 and summary["published"] == n
    assert summary["partitions_resumed"] == len(finished_before)
    assert summary["resumed"] == sum(finished_before.values())
    assert summary["published_this_run"] == n - summary["resumed"]
    with connect() as c:
        bodies = {b for _, _, b in drain(c.channel(), chain.names.check_in)}
    assert bodies == {f"row {i}".encode() for i in range(n)}  # every row at least once


@pytest.mark.brokers("rmq3.10", reason="Spark's retry of failed partitions; `schedule` itself runs on 4.3 too")
def test_failed_partitions_are_reported_and_published_by_the_next_run(spark, broker, make_chain, tmp_path):
    prefix = unique_prefix()
    path = tmp_path / "in.csv"
    path.write_text("routing_key,payload,delay_ms\n" + "".join(f"k,row {i},100\n" for i in range(30)))
    chain = make_chain(prefix=prefix, max_level=4, resolution_ms=100)
    with connect() as c:  # check-in routes to no queue: every publish comes back unroutable
        c.channel().queue_unbind(chain.names.check_in, chain.names.check_in, "#")
    args = schedule_args(chain, broker, str(path), tmp_path, "--rows-per-partition", "10")
    assert main(args) == 1
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert (summary["read"], summary["published"], summary["not_published"]) == (30, 0, 30)
    assert summary["partitions_failed"] == summary["partitions"] == 3 and not summary["complete"]
    assert "routed a message to no queue" in summary["failure"] and "delay-gateway declare" in summary["failure"]

    with connect() as c:
        c.channel().queue_bind(chain.names.check_in, chain.names.check_in, "#")
    assert main(args) == 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert (summary["published"], summary["published_this_run"], summary["resumed"]) == (30, 30, 0)
    with connect() as c:
        assert sorted(b for _, _, b in drain(c.channel(), chain.names.check_in)) == sorted(
            f"row {i}".encode() for i in range(30))


@pytest.mark.brokers("rmq3.10", reason="Spark's side of cancel-table (formats, rejections, counts); cancels on every "
                                       "version are test_cancel_e2e.py's. On 4.x x-delay counts from the broker's "
                                       "arrival, so its messages fall due while Spark starts, before the cancels are "
                                       "sent")
def test_cancel_table_cancels_every_id_of_a_table_and_rejects_bad_rows_like_schedule(
        spark, broker, make_chain, run_gateway, tmp_path):
    import pika
    chain = make_chain(max_level=6, resolution_ms=100)  # no gateway yet: messages, then cancels, wait in check-in
    receiver = Receiver(chain)
    ids = [f"order-{n}" for n in range(40)]
    with connect() as c:
        ch = c.channel()
        ch.confirm_delivery()
        for mid in ids:
            ch.basic_publish(chain.names.check_in, "reminder", b"", pika.BasicProperties(
                message_id=mid, headers={"x-delay": 3000}), mandatory=True)
    path = tmp_path / "cancelled.csv"
    path.write_text("order_id,why\n" + "".join(f"{mid},customer\n" for mid in ids[::2]) + ",no id\n"
                    + "x" * 256 + ",too long\n")
    assert main(["cancel-table", str(path), "--url", broker, *chain_args(chain), "--message-id-column",
                 "order_id", "--errors", str(tmp_path / "errors"), "--summary", str(tmp_path / "summary.json"),
                 "--rows-per-partition", "7", "--spark-conf", "spark.ui.enabled=false"]) == 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert (summary["read"], summary["published"], summary["rejected"], summary["not_published"]) == (22, 20, 2, 0)
    assert summary["rejected_by_reason"] == {"message_id_missing": 1, "message_id_too_long": 1}
    errors = read_errors(spark, "csv", str(tmp_path / "errors"))
    assert sorted(r["_reason"] for r in errors) == ["message_id_missing", "message_id_too_long"]
    assert all(r["_detail"] for r in errors)
    publish_sentinel(chain, 3000)  # behind the messages and their cancels: none of those can come after it
    run_gateway(chain)
    got = receiver.until_sentinel(30)
    assert sorted(m.properties.message_id for m in got) == sorted(ids[1::2])
