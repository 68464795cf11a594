"""The Spark jobs' pure parts, without Spark; the publisher against the real broker; and one Spark start."""

import json
import os
import subprocess
import sys
import uuid
from types import SimpleNamespace

import pika
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.core.envelope import MS_PER_YEAR
from gateway.spark import example, progress, record, report
from gateway.spark import rows as R
from gateway.spark.publisher import PartitionPublisher, PublishError, Target

from ..support import ROOT, connect, drain, examples

NOW = 1_800_000_000_000
LIMITS = R.Limits(NOW, max_overdue_ms=60_000, max_payload_bytes=100)


def check(rk="k", size=1, delay=None, at=None, at_ts=None, mid=None, headers=None, row='{"a":1}', corrupt=None):
    return R.check(rk, size, delay, at, at_ts, mid, headers, row, corrupt, LIMITS)


@pytest.mark.parametrize("kwargs, reason", [
    (dict(delay="10", corrupt="{x"), R.UNPARSEABLE),
    (dict(rk=None, delay="10"), R.KEY_MISSING),
    (dict(rk="é" * 128, delay="10"), R.KEY_TOO_LONG),  # 256 bytes
    (dict(), R.DUE_MISSING),
    (dict(delay="ten"), R.DUE_UNREADABLE),
    (dict(delay="NaN"), R.DUE_UNREADABLE),
    (dict(at="tomorrow"), R.DUE_UNREADABLE),
    (dict(delay="10", at=str(NOW)), R.DUE_AMBIGUOUS),
    (dict(at=str(NOW // 1000)), R.DUE_SECONDS),
    (dict(at=str(NOW - 60_001)), R.DUE_PAST),
    (dict(delay="-60001"), R.DUE_PAST),
    (dict(at="x", at_ts=NOW - 3_600_000), R.DUE_PAST),
    (dict(delay=str(1001 * MS_PER_YEAR)), R.DUE_TOO_FAR),
    (dict(delay="10", size=101), R.PAYLOAD_TOO_LARGE),
    (dict(delay="10", headers="{"), R.HEADERS_INVALID),
    (dict(delay="10", headers="[]"), R.HEADERS_INVALID),
    (dict(delay="10", headers='{"x-deliver-at": 1}'), R.HEADERS_INVALID),
    (dict(delay="10", headers='{"big": 9223372036854775808}'), R.HEADERS_INVALID),
    (dict(delay="10", headers='{"deep": {"inf": 1e999}}'), R.HEADERS_INVALID),
    (dict(delay="10", mid="m" * 256), R.ID_TOO_LONG),
])
def test_each_kind_of_bad_row_has_its_reason(kwargs, reason):
    c = check(**kwargs)
    assert (c.reason, c.message_id) == (reason, None)
    assert c.detail


@pytest.mark.parametrize("kwargs, at, delay", [
    (dict(delay="0"), None, 0),
    (dict(delay="250.01"), None, 251),  # fractions round up: never early
    (dict(delay="-60000"), None, -60000),  # due now, at the overdue limit
    (dict(at=str(NOW + 5)), NOW + 5, None),
    (dict(at="1.8e12"), 1_800_000_000_000, None),
    (dict(at="2027-01-15 08:00:00", at_ts=NOW + 7), NOW + 7, None),  # Spark read it as a timestamp
    (dict(at=str(NOW - 60_000)), NOW - 60_000, None),
])
def test_good_rows_and_their_due_time(kwargs, at, delay):
    c = check(**kwargs)
    assert c.reason is None
    assert (c.deliver_at_ms, c.delay_ms) == (at, delay)
    assert R.due_at(c, NOW + 100) == (at if at is not None else NOW + 100 + max(delay, 0))


def test_message_ids_are_given_or_made_from_the_row_the_same_every_time():
    assert check(delay="1", mid="order-42").message_id == "order-42"
    made = check(delay="1", row='{"order": 42}').message_id
    assert made == check(delay="1", row='{"order": 42}').message_id
    assert made != check(delay="1", row='{"order": 43}').message_id
    assert uuid.UUID(made).version == 5


def test_headers_travel_with_the_due_time():
    c = check(delay="1", headers='{"tenant": "acme", "f": 1.5, "n": [1, {"x": null}]}')
    assert R.message_headers(c.headers, NOW) == {"tenant": "acme", "f": 1.5, "n": [1, {"x": None}],
                                                 "x-deliver-at": NOW}


text = st.one_of(st.none(), st.text(max_size=30), st.integers().map(str), st.floats().map(str))


@settings(max_examples=examples(300))
@given(rk=st.one_of(st.none(), st.text(max_size=300)), size=st.integers(0, 200), delay=text, at=text,
       at_ts=st.one_of(st.none(), st.integers(-2**62, 2**62)), mid=st.one_of(st.none(), st.text(max_size=300)),
       headers=st.one_of(st.none(), st.text(max_size=20), st.dictionaries(st.text(max_size=5), st.one_of(
           st.integers(), st.floats(), st.text(max_size=5), st.none())).map(json.dumps)))
def test_any_row_is_a_message_or_a_rejection_with_a_known_reason(rk, size, delay, at, at_ts, mid, headers):
    c = R.check(rk, size, delay, at, at_ts, mid, headers, "{}", None, LIMITS)
    if c.reason is not None:
        assert c.reason in R.REASONS and c.detail and c.message_id is None
        return
    assert (c.deliver_at_ms is None) != (c.delay_ms is None)
    due = R.due_at(c, NOW)
    assert NOW - LIMITS.max_overdue_ms <= due <= NOW + R.MAX_AHEAD_MS
    assert c.deliver_at_ms is None or c.deliver_at_ms >= R.SMALLEST_DELIVER_AT
    assert len(rk.encode()) <= 255 and len(c.message_id.encode()) <= 255


def test_a_record_line_has_the_due_time_from_the_stamp_or_the_publishers_header():
    method = SimpleNamespace(routing_key="k.1", redelivered=True)
    props = pika.BasicProperties(message_id="m1", timestamp=1_800_000_000,
                                 headers={"x-gateway-due-at": 1_800_000_002_500, "x-deliver-at": 1})
    assert record.line(method, props, 1_800_000_002_510) == {
        "message_id": "m1", "routing_key": "k.1", "due_at": 1_800_000_002_500, "due_source": "stamp",
        "arrived_at": 1_800_000_002_510, "redelivered": True, "published_at": 1_800_000_000_000,
        "delay_ms": 2500}
    plain = record.line(method, pika.BasicProperties(headers={"x-deliver-at": 5, "x-delay": 700}), 9)
    assert (plain["due_at"], plain["due_source"], plain["delay_ms"]) == (5, "x-deliver-at", 700)
    assert record.line(method, pika.BasicProperties(), 9)["due_at"] is None


@pytest.mark.parametrize("delay, label", [(None, "unknown"), (-5, "overdue"), (0, "0-1s"), (999, "0-1s"),
                                          (1000, "1-10s"),
                                          (59_999, "10s-1m"), (60_000, "1-10m"), (3_600_000, "1h-1d"),
                                          (86_400_000, "1d+")])
def test_delay_buckets(delay, label):
    assert report.bucket_of(delay) == label


def test_the_example_orders_fall_due_within_the_window():
    now = NOW
    rows = example.orders(300, 6, 60_000, 120_000, now, seed=1)
    assert len(rows) == 300 and len({r["order_id"] for r in rows}) == 300
    from datetime import datetime
    broken = 0
    for r in rows:
        try:
            due = datetime.fromisoformat(r["delivered_at"]).timestamp() * 1000 + example.WEEK_MS
        except ValueError:
            broken += 1
            continue
        if due < now:
            broken += 1
        else:
            assert now + 60_000 <= due <= now + 180_000
    assert broken == 6


def test_the_resume_record_survives_a_new_process(tmp_path):
    p = progress.Progress(str(tmp_path / "state"))
    assert p.run() is None and p.done() == {}
    p.begin({"fingerprint": "f", "started_at_ms": 1})
    p.mark(3, 500, 1.5)
    p.mark(0, 499, 1.0)
    p.update(partitions=4)
    again = progress.Progress(str(tmp_path / "state"))
    assert again.done() == {3: 500, 0: 499}
    assert again.run() == {"fingerprint": "f", "started_at_ms": 1, "partitions": 4}
    again.begin({"fingerprint": "g", "started_at_ms": 2})
    assert again.done() == {}
    assert progress.fingerprint({"a": 1, "b": [1]}) == progress.fingerprint({"b": [1], "a": 1})


def test_without_pyspark_the_spark_commands_say_how_to_install_it():
    code = ("import sys; sys.modules['pyspark'] = None\n"
            "from gateway.cli import main\n"
            "sys.exit(main(['report', 'records.jsonl']))")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "delay-gateway report: error: this command runs on Spark and PySpark is not installed: "
        "python -m pip install -e '.[spark]' in a clone of the repository (docs/spark.md)"]


def test_no_module_of_the_spark_jobs_imports_pyspark_before_a_job_runs():
    """PySpark is imported by the jobs when they run, never by importing a module of
    gateway/spark (the verbs are loaded before they can say that PySpark is missing)."""
    code = ("import importlib, pkgutil, sys\n"
            "import gateway.spark\n"
            "for module in pkgutil.iter_modules(gateway.spark.__path__):\n"
            "    importlib.import_module('gateway.spark.' + module.name)\n"
            "print(sorted(name for name in sys.modules if name.split('.')[0] in ('pyspark', 'py4j')))")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_record_and_example_orders_need_no_pyspark_at_all(tmp_path):
    out = tmp_path / "orders.csv"
    code = ("import sys; sys.modules['pyspark'] = None\n"
            "import gateway.spark.record\n"
            "from gateway.cli import main\n"
            f"sys.exit(main(['example-orders', {str(out)!r}, '--rows', '10', '--broken', '1']))")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert len(out.read_text().splitlines()) == 11  # the header line and ten orders


@pytest.mark.spark
def test_a_session_the_commands_start_keeps_sparks_start_up_log_lines_to_itself(tmp_path):
    """Spark's default log4j profile writes warnings (host name, native libraries, "Setting
    default log level") among a command's output; the commands start Spark with errors only."""
    code = ("from gateway.spark import session\n"
            "spark, _ = session.start('quiet', 'local[1]', (('spark.ui.enabled', 'false'),))\n"
            "print('rows', spark.range(3).count())\n"
            "spark.stop()")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYSPARK_", "SPARK_CONF"))}
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=240,
                          env={**env, "TMPDIR": str(tmp_path)})
    assert done.returncode == 0, done.stderr
    assert done.stdout == "rows 3\n"
    # the JVM's own notice of the vector module is not log4j's, and not ours to silence
    said = [line for line in done.stderr.splitlines() if "incubator modules" not in line]
    assert said == [], done.stderr
    assert list(tmp_path.glob("delay-gateway-log4j2-*")) == []  # the profile is removed once read


def test_the_publisher_confirms_every_message_and_refuses_a_check_in_without_queue(broker, make_chain):
    chain = make_chain(max_level=2)
    items = iter(range(2500))

    def make(i):
        return "k", str(i).encode(), pika.BasicProperties(delivery_mode=2, headers={"f": 0.5, "i": i})

    published = PartitionPublisher(Target((broker,), chain.names.check_in, window=300), items, make).run()
    assert published.rows == 2500
    with connect() as c:
        got = drain(c.channel(), chain.names.check_in)
    assert sorted(int(b) for _, _, b in got) == list(range(2500))
    assert got[0][1].headers["f"] == 0.5  # a double, not truncated
    with connect() as c:
        ch = c.channel()
        ch.exchange_declare(chain.prefix + ".lonely", "topic", auto_delete=True)
        with pytest.raises(PublishError, match="routed a message to no queue.*delay-gateway declare"):
            PartitionPublisher(Target((broker,), chain.prefix + ".lonely"), iter([1]), make).run()
        ch.exchange_delete(chain.prefix + ".lonely")


def test_a_due_expression_without_a_value_rejects_the_row_not_the_job():
    c = R.check("k", 1, None, None, None, None, None, "{}", None, LIMITS, due_expr=True)
    assert c.reason == R.DUE_MISSING and "--due-expr" in c.detail
