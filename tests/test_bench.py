"""The benchmark (`python -m bench`) runs end to end at tiny sizes, so it cannot rot.

Only the shape of its output and correctness (nothing early, nothing lost) are checked here:
timing targets live in BENCHMARKS.md, never in assertions. The broker tests run the real
gateway through tests/launcher.py against this session's private RabbitMQ 4.3 node
(tests/conftest.py, ONE_BROKER_IN_MODULE), which has no delayed-message plugin whatever the
shared node on 5672 has (4.3 cannot even run it): `--compare-plugin` must say so in one
line and still measure the gateway.
"""

import json
import os
import shlex
import subprocess
import sys

import pytest

from bench import cli, profile, report
from bench.context import Context, gateway_targets
from bench.delayed import Load, schedule, writes_model
from bench.systems import DELAY, DELIVER_AT, Target, headers_for, whole_seconds
from topology import ChainSettings

from .support import ROOT, broker_url, main_broker_url

# The benchmark's own output and bookkeeping, not the broker's behaviour; about 40 s. On the
# private 4.3 node: it must have no delayed-message plugin (and 4.3 cannot run it), and its
# node-wide write counters are then this test's alone.
pytestmark = [pytest.mark.brokers("rmq4.3")]


def bench(tmp_path, *args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    env = dict(os.environ, DELAY_GATEWAY_URL=broker_url())
    return subprocess.run([sys.executable, "-m", "bench", *args, "--out", str(tmp_path / "out")],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


DELAYED_KEYS = ("round", "system", "header", "label", "publish_rate", "p50_ms", "p90_ms", "p99_ms", "max_ms",
                "early", "lost", "duplicates", "broker_cpu_us_per_message", "gateway_cpu_us_per_message",
                "broker_idle_cpu_pct", "resources", "series", "writes_model_per_message")


def test_loads_side_by_side_with_the_plugin_absent(broker, broker_ctl, tmp_path):
    """paced and at-once with both delay headers, asking for the plugin the broker lacks:
    one line says so, the run goes on (exit 0), and the broker's own counters (read with
    this node's rabbitmqctl) give the writes per message (about 25 s)."""
    proc = bench(tmp_path, "paced", "at-once", "--compare-plugin", "--messages", "40", "--rate", "200",
                 "--min-delay", "300", "--max-delay", "1200", "--at-once-ms", "1500", "--idle-seconds", "0.2",
                 "--rabbitmqctl", shlex.join(broker_ctl.command()))
    assert proc.returncode == 0, proc.stderr[-3000:]
    said = [line for line in proc.stderr.splitlines() if "delayed_message_exchange" in line]
    assert len(said) == 1 and "gateway only" in said[0], proc.stderr
    data = json.loads((tmp_path / "out" / "results.json").read_text())
    assert data["meta"]["plugin"] == "absent"
    assert {"date", "machine", "command", "rabbitmq", "load_average_start",
            "busiest_processes_start"} <= set(data["meta"])
    for name in ("paced", "at-once"):
        runs = data["results"][name]
        assert [(r["system"], r["header"]) for r in runs] == [("gateway", DELAY), ("gateway", DELIVER_AT)]
        for r in runs:
            assert all(k in r for k in DELAYED_KEYS), set(DELAYED_KEYS) - set(r)
            assert r["received"] >= 40 and r["early"] == 0 and r["lost"] == 0, r
            # counted by the broker: each message is written at least into check-in and the
            # receiver's queue; carriers share the chain's and the distributor's writes
            # (node-wide counters: on this private node, only this test adds to them)
            assert r["queue_writes_per_message"] >= 2, r["broker_counters"]
    at_once = data["results"]["at-once"][0]
    assert at_once["delay_ms"][1] <= 1500 and at_once["at_once_ms"] == 1500
    md = (tmp_path / "out" / "results.md").read_text()
    assert "paced:" in md and "at-once:" in md and "gateway quorum/queue (x-deliver-at)" in md
    assert (tmp_path / "out" / "lateness-paced.png").stat().st_size > 1000


def test_every_other_scenario_runs(broker, tmp_path):
    """steady, pending, roles, hops, naive, ceiling, idle and trickle at tiny sizes, without
    rabbitmqctl (no write counters: the figures say so rather than guess); about 60 s. (burst:
    the kombu test below, with the counters.)"""
    proc = bench(tmp_path, "steady", "pending", "roles", "hops", "naive", "ceiling", "idle", "trickle",
                 "--headers", "x-delay", "--messages", "60", "--rates", "100", "--duration", "0.6",
                 "--ceiling-rates", "100,200", "--ceiling-seconds", "2", "--idle-window", "1", "--min-delay", "300",
                 "--max-delay", "1500", "--rabbitmqctl", "none", "--idle-seconds", "0.2", "--profile", timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads((tmp_path / "out" / "results.json").read_text())["results"]
    [steady] = results["steady"]
    assert steady["lost"] == 0 and steady["early"] == 0 and "best_rate" in steady
    [pending] = results["pending"]
    assert pending["checked_in"] >= 60 and pending["before"]["broker_rss_mb"] > 0
    assert {r["role"] for r in results["roles"]} == {"check-in", "distributor"}
    assert all(r["done"] >= 60 for r in results["roles"]), results["roles"]
    # --profile: py-spy attached to each role and stopped with its samples (60 messages: too few to share out)
    assert all(r["profile_note"] is None and isinstance(r["steps_us_per_message"], dict) for r in results["roles"])
    [hops] = results["hops"]
    assert hops["arrived"] == 60 and hops["hops_per_s"] > 0
    [naive] = results["naive"]
    assert naive["lost"] == 0 and naive["early"] == 0
    # rising rates until one misses p99 < 100 ms: every run tried says which rate is the best
    ceiling = results["ceiling"]
    assert [r["target_rate"] for r in ceiling][:1] == [100] and len({r["best_rate"] for r in ceiling}) == 1
    assert all(r["lost"] == 0 and r["early"] == 0 and r["gateway_wakeups_per_message"] > 0 for r in ceiling), ceiling
    # (without rabbitmqctl: no write counters, and the figures say so rather than guess)
    assert all("queue_writes_per_message" not in r and r["broker_counters"] is None for r in ceiling), ceiling
    [idle] = results["idle"]
    assert idle["seconds"] >= 1 and 0 <= idle["gateway_cpu_pct"] < 100 and idle["gateway_wakeups_per_s"] > 0, idle
    assert [r["target_rate"] for r in results["trickle"]] == [10, 100]
    md = (tmp_path / "out" / "results.md").read_text()
    assert "ceiling: target" in md and "idle: target" in md and "trickle:" in md


def test_holding_measures_what_a_held_message_costs(broker, tmp_path):
    """holding at a tiny size: a fresh gateway per run holds every message on the shorter
    path, in carriers and alone, and says what each cost in RSS (about 30 s)."""
    proc = bench(tmp_path, "holding", "--messages", "100", "--holding-sizes", "1024",
                 "--min-delay", "6000", "--max-delay", "7000", "--rabbitmqctl", "none")
    assert proc.returncode == 0, proc.stderr[-3000:]
    runs = json.loads((tmp_path / "out" / "results.json").read_text())["results"]["holding"]
    assert [r["carriers"] for r in runs] == ["default", "1"]
    for r in runs:
        assert r["straight_to_distributor"] == r["held"] == 100, r
        assert 0 < r["rss_rest_mib"] <= r["rss_holding_mib"] and r["bytes_per_held_message"] is not None, r
    assert runs[1]["held_deliveries"] == 100 and runs[0]["held_deliveries"] < 100
    assert "holding: target" in (tmp_path / "out" / "results.md").read_text()


def test_soak_feeds_each_interpreters_gateway_in_turn(broker, tmp_path):
    """soak, briefly, with two interpreters (here the same one by two paths): each keeps one
    gateway for the whole flow, the windows take turns, and nothing is lost or early."""
    other = os.path.join(os.path.dirname(sys.executable), "python3")
    proc = bench(tmp_path, "soak", "--flow-seconds", "6", "--window-seconds", "2", "--rate", "200",
                 "--min-delay", "300", "--max-delay", "600", "--gateway-python", other, "--rabbitmqctl", "none")
    assert proc.returncode == 0, proc.stderr[-3000:]
    [run] = json.loads((tmp_path / "out" / "results.json").read_text())["results"]["soak"]
    assert [w["gateway"] for w in run["windows"]] == [0, 1, 0], run["windows"]
    assert all(w["messages"] > 0 and w["gateway_cpu_us_per_message"] > 0 and w["early"] == 0 for w in run["windows"])
    assert [t["path"] for t in run["totals"]] == [sys.executable, other]
    assert all(t["published"] > 0 and t["lost"] == 0 and t["early"] == 0 for t in run["totals"]), run["totals"]
    assert "| window | from s | interpreter |" in (tmp_path / "out" / "results.md").read_text()


def test_catch_up_releases_an_outages_backlog_at_once_then_paced(broker, tmp_path):
    """catch-up at a tiny size (about 40 s): 200 messages fall due in an outage of 1 s, then a
    distributor releases them at once, and in a second run at 100 a second (a tenth of a
    second's worth at once), with nothing lost or early in either."""
    proc = bench(tmp_path, "catch-up", "--messages", "200", "--outage-seconds", "1", "--catch-up-rate", "100",
                 "--rabbitmqctl", "none")
    assert proc.returncode == 0, proc.stderr[-3000:]
    at_once, paced = json.loads((tmp_path / "out" / "results.json").read_text())["results"]["catch-up"]
    assert (at_once["rate"], paced["rate"]) == (0, 100)
    for r in (at_once, paced):
        assert r["overdue"]["published"] == 200 and r["on_time"]["published"] > 0, r
        assert r["overdue"]["lost"] == r["on_time"]["lost"] == r["overdue"]["early"] == r["on_time"]["early"] == 0, r
    # (a busy machine only slows the catch-up; its arrivals may bunch a little: 110 a second released at most)
    assert paced["peak_per_s"] <= 150 and paced["catch_up_s"] >= 1.9, paced
    assert "| catch-up: round |" in (tmp_path / "out" / "results.md").read_text()


def test_move_takes_what_waits_to_another_broker(broker, tmp_path):
    """move at a tiny size (about 50 s): 300 published to this node's gateway, moved to the
    suite's 3.10 broker, delivered there (three due during the move, by either side)."""
    proc = bench(tmp_path, "move", "--to-url", main_broker_url(), "--messages", "300", "--wait-seconds", "25",
                 "--spread-seconds", "5")
    assert proc.returncode == 0, proc.stderr[-3000:]
    [r] = json.loads((tmp_path / "out" / "results.json").read_text())["results"]["move"]
    late = r["lateness"]
    assert (late["lost"], late["early"], late["duplicates"]) == (0, 0, 0), r
    assert r["delivered_old"] + r["delivered_new"] == 300 and r["moved"] >= 297 and r["passes"] >= 1, r


def test_footprint_counts_what_a_prefix_declares_and_leaves_nothing(broker, broker_ctl, tmp_path):
    """footprint with one prefix of each zero-bits mode: what the broker itself counts matches
    the topology model, 4.3 has no file-handle bookkeeping to report, and the chains are gone
    afterwards (about 15 s)."""
    proc = bench(tmp_path, "footprint", "--footprint-prefixes", "1", "--idle-window", "1",
                 "--zero-bits", "queue,exchange", "--rabbitmqctl", shlex.join(broker_ctl.command()))
    assert proc.returncode == 0, proc.stderr[-3000:]
    runs = json.loads((tmp_path / "out" / "results.json").read_text())["results"]["footprint"]
    assert [(r["zero_bits"], r["quorum"], r["stream"], r["classic"], r["exchanges"], r["bindings"])
            for r in runs] == [("queue", 48, 14, 0, 33, 63), ("exchange", 28, 14, 0, 33, 63)], runs
    for r in runs:
        assert r["nodes"] == 1 and r["file_handles"] is None and r["prefixes_the_limit_holds"] is None, r
        # (memory at rest moves by megabytes as the node collects garbage: a figure, not checked)
        assert r["processes"] > r["quorum"] and r["open_fds"] > 0, r
        assert r["model"]["queues"] == r["quorum"] + r["stream"], r
    assert "footprint per prefix" in (tmp_path / "out" / "results.md").read_text()
    left = broker_ctl("list_queues", "name", "-q") + broker_ctl("list_exchanges", "name", "-q")
    assert "bench-footprint" not in left, left


def test_vhosts_serves_each_from_one_gateway_and_deletes_them(broker, broker_ctl, tmp_path):
    """vhosts with two: one gateway ready for both, its figures at rest, a paced load spread
    over them delivered (none lost, none early), and the vhosts gone afterwards (about 20 s)."""
    proc = bench(tmp_path, "vhosts", "--vhosts-count", "2", "--rate", "20", "--duration", "1", "--idle-window", "1",
                 "--min-delay", "300", "--max-delay", "800", "--rabbitmqctl", shlex.join(broker_ctl.command()))
    assert proc.returncode == 0, proc.stderr[-3000:]
    [r] = json.loads((tmp_path / "out" / "results.json").read_text())["results"]["vhosts"]
    assert (r["vhosts"], r["messages"], r["received"], r["lost"], r["early"]) == (2, 20, 20, 0, 0), r
    assert r["rest"]["threads"] > 1 and r["rest"]["rss_mib"] > 0 and r["broker_links"]["connections"] >= 6, r
    assert "vhosts: one gateway" in (tmp_path / "out" / "results.md").read_text()
    assert "bench-vh-" not in broker_ctl("list_vhosts", "-q")


def test_kombu_chain_side_by_side_and_the_floor(broker, broker_ctl, tmp_path):
    """--compare-kombu: Celery's native delayed delivery, declared by kombu's own function,
    alternates with the gateway on the same load (nothing early: whole seconds rounded up);
    `floor` measures a plain quorum and a plain classic queue at the same rate; every queue
    and exchange the runs declared is gone afterwards (about 40 s)."""
    proc = bench(tmp_path, "burst", "floor", "--compare-kombu", "--headers", "x-delay", "--messages", "40",
                 "--rate", "200", "--min-delay", "300", "--max-delay", "1500", "--idle-seconds", "0.2",
                 "--rabbitmqctl", shlex.join(broker_ctl.command()))
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads((tmp_path / "out" / "results.json").read_text())
    assert data["meta"]["kombu"].startswith("compared (kombu 5.")
    kombu, gateway = data["results"]["burst"]
    assert (kombu["system"], gateway["system"]) == ("kombu", "gateway")
    for r in (kombu, gateway):
        assert r["received"] == 40 and r["early"] == 0 and r["lost"] == 0 and r["duplicates"] == 0, r
    # kombu rounds each delay up to whole seconds: 300-1500 ms become 1-2 s
    assert kombu["min_ms"] >= 0 and kombu["gateway_cpu_us_per_message"] is None
    floors = {r["queue_type"]: r for r in data["results"]["floor"]}
    assert set(floors) == {"quorum", "classic"}
    for r in floors.values():
        assert r["received"] == 40 and r["lost"] == 0 and r["broker_cpu_us_per_message"] > 0, r
    md = (tmp_path / "out" / "results.md").read_text()
    assert "kombu native delayed delivery (whole seconds)" in md and "plain quorum queue" in md
    left = subprocess.run([*broker_ctl.command(), "list_queues", "name", "-q"], capture_output=True, text=True,
                          timeout=60).stdout + subprocess.run(
        [*broker_ctl.command(), "list_exchanges", "name", "-q"], capture_output=True, text=True, timeout=60).stdout
    assert "celery_delayed" not in left and "bench-floor" not in left, left


def test_kombu_compare_without_kombu_is_one_line(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "kombu.transport.native_delayed_delivery", None)
    assert cli.main(["paced", "--compare-kombu"], environ={}) == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    assert "kombu 5.5" in line


# -- pure parts: no broker ----------------------------------------------------------------------
def test_profile_puts_each_sample_in_the_step_of_its_innermost_gateway_frame():
    """py-spy's raw lines (`frames count`): pika calls count as the step that made them;
    samples in the poll are waiting, not a step's cost."""
    loop = "IOLoop.start (pika/adapters/select_connection.py:583);run (gateway/broker/run/worker.py:208)"
    raw = "\n".join([
        f"{loop};Pipe._on_message (gateway/broker/run/consumer.py:246);CheckIn.__call__ (gateway/core/handlers.py:187)"
        ";Properties.headers (gateway/core/wire.py:294) 3",
        f"{loop};Flow._send (gateway/core/flow.py:382);publish (gateway/broker/plumbing/publish_frames.py:45);"
        "Channel.basic_publish (pika/channel.py:10) 1",
        f"{loop};CheckIn.__call__ (gateway/core/handlers.py:191);due_at (gateway/core/envelope.py:124) 4",
        "IOLoop.start (pika/adapters/select_connection.py:583);PollPoller.poll "
        "(pika/adapters/select_connection.py:1240) 2",
        "junk",
    ])
    shares = profile.shares(raw)
    assert shares == {"decide (core)": 0.4, "frames in: read, parse": 0.3, "waiting (poll)": 0.2,
                      "frames out: build, write": 0.1}
    assert profile.per_message(shares, 80.0) == {"decide (core)": 40.0, "frames in: read, parse": 30.0,
                                                 "frames out: build, write": 10.0}
    assert profile.per_message({}, 80.0) == {} and profile.per_message(shares, None) == {}


def test_runs_alternate_plugin_and_gateway_round_after_round():
    gw = [Target("gateway", DELAY, "quorum", "queue"), Target("gateway", DELIVER_AT, "quorum", "queue")]
    order = [(r, t.system, t.header) for r, t in schedule(gw, 2, plugin=True)]
    assert order == [(1, "plugin", DELAY), (1, "gateway", DELAY), (1, "gateway", DELIVER_AT),
                     (2, "plugin", DELAY), (2, "gateway", DELAY), (2, "gateway", DELIVER_AT)]
    assert [t.system for _, t in schedule(gw, 1, plugin=False)] == ["gateway", "gateway"]
    assert [t.system for _, t in schedule(gw[:1], 2, plugin=False, kombu=True)] == [
        "kombu", "gateway", "kombu", "gateway"]


@pytest.mark.parametrize("delay_ms, seconds", [(0, 1), (1, 1), (1000, 1), (1001, 2), (9_999, 10)])
def test_kombu_delays_are_whole_seconds_rounded_up(delay_ms, seconds):
    assert whole_seconds(delay_ms) == seconds


def test_floor_lines_compare_each_paced_total_with_the_replicated_floor():
    floor = [{"queue_type": "quorum", "label": "plain quorum queue", "messages": 10, "broker_cpu_us_per_message": 600},
             {"queue_type": "classic", "label": "plain classic queue", "messages": 10,
              "broker_cpu_us_per_message": 250}]
    paced = [{"label": "gw", "round": 1, "broker_cpu_us_per_message": 700.0, "gateway_cpu_us_per_message": 300.0}]
    text = "\n".join(report.floor_lines({"floor": floor, "paced": paced}, "classic"))
    assert "850 µs/msg" in text and "gw: 1000 µs/msg = 1.18x" in text


def test_gateway_targets_cover_every_topology_and_header():
    ctx = Context(url="", out_dir="", broker=None, queue_types=["quorum", "classic"], zero_bits=["queue", "exchange"])
    labels = [t.label for t in gateway_targets(ctx)]
    assert len(labels) == 8 and len(set(labels)) == 8
    assert labels[0] == "gateway quorum/queue (x-delay)"


def test_due_time_is_the_publishers_view():
    assert headers_for(DELAY, 1000.25, 5000) == ({"x-delay": 5000}, 6000.25)
    assert headers_for(DELIVER_AT, 1000.25, 5000) == ({"x-deliver-at": 6000}, 6000.0)


@pytest.mark.parametrize("delay, zero_bits, writes", [
    (0, "queue", 3),           # check-in, distributor, the user's queue
    (1_049, "queue", 3),       # less than a unit after the 50 ms lead
    (1_050, "queue", 4),       # one unit: level 0
    (5_050, "queue", 6),       # 5 = 0b101: levels 2, 1 (pass), 0
    (5_050, "exchange", 5),    # the zero bit is a binding, not a queue
])
def test_writes_model(delay, zero_bits, writes):
    assert writes_model(delay, ChainSettings(prefix="p", zero_bits=zero_bits), 50) == writes


def test_side_by_side_table_groups_rounds_per_target():
    def run(label, system, r, p99):
        return {"label": label, "system": system, "round": r, "messages": 10, "p50_ms": 1.0, "p99_ms": p99,
                "max_ms": p99, "early": 0, "lost": 0, "duplicates": 0, "queue_writes_per_message": 1.0}
    runs = [run("plugin (x-delay)", "plugin", 1, 5.0), run("gw", "gateway", 1, 50.0),
            run("plugin (x-delay)", "plugin", 2, 7.0), run("gw", "gateway", 2, 40.0)]
    text = report.markdown({"paced": runs}, {"command": "python -m bench paced"})
    assert "| plugin (x-delay) | 2 | 1 | 5-7 |" in text
    assert "| gw | 2 | 1 | 40-50 |" in text


@pytest.mark.parametrize("argv", [["nosuch"], ["paced", "--rounds", "0"], ["paced", "--headers", "x-later"],
                                  ["paced", "--queue-types", "stream"], ["paced", "--rate", "fast"]])
def test_usage_errors_are_one_line_and_exit_2(argv, capsys):
    assert cli.main(argv, environ={}) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "error" in err[0]


def test_scenario_groups():
    assert cli.expand(["issue", "paced"]) == ["paced", "burst", "at-once", "floor", "ceiling", "idle", "trickle"]
    assert "pending" not in cli.expand(["all"]) and "holding" not in cli.expand(["all"])
    assert Load("paced", 1, (1, 2)).rate is None
