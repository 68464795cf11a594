"""The delay-gateway command: settings from flags and environment, and each subcommand."""

import json
import os
import re
import socket
import subprocess
import sys

import pytest

from gateway.urls import redact
from topology import ChainSettings

from .support import ROOT, START_NOTICES, Receiver, broker_url, chain_args, now_ms, remove, sent_headers, unique_prefix


def cli(*args, env=None, timeout=60):
    return subprocess.run([sys.executable, "-m", "gateway", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "DELAY_GATEWAY_URL": broker_url(), **(env or {})})


def test_passwords_are_redacted():
    assert redact("amqp://u:s3cret@host:5673/v") == "amqp://u:***@host:5673/v"
    assert redact("amqp://host/") == "amqp://host/"


def test_an_unreachable_broker_is_named_without_its_password():
    r = cli("declare", env={"DELAY_GATEWAY_URL": "amqp://guest:hunter2@127.0.0.1:1/%2F"})
    assert r.returncode == 1
    assert "amqp://guest:***@127.0.0.1:1/%2F: cannot connect" in r.stderr
    assert "hunter2" not in r.stderr + r.stdout


def test_render_prints_definitions_for_import():
    r = cli("render", "--format", "definitions", "--prefix", "x", "--max-level", "2", "--vhost", "prod")
    doc = json.loads(r.stdout)
    assert {q["name"] for q in doc["queues"]} >= {"x.check-in", "x.1000ms-quorum-queue.meditation.02",
                                                 "x.1000ms-quorum-queue.level.01.delay", "x.parked"}


def test_explain_shows_the_route():
    r = cli("explain", "27000", "--max-level", "4")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert "delay.1000ms-quorum-queue.meditation.04" in lines[1] and "key '1.1.0.1'" in lines[2]
    assert "hold 999 ms" in lines[-1]


def test_output_cut_short_by_a_pipe_is_no_error():
    # `explain ... | head -1`: the reader goes away before the command has written all
    r = subprocess.run(f"{sys.executable} -m gateway explain 3000000000000 --max-level 4 | head -1", shell=True,
                       cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.stdout.count("\n") == 1 and r.stderr == "", r.stderr


def test_publish_and_declare_commands_end_to_end(make_chain, run_gateway):
    chain = make_chain(max_level=3, resolution_ms=100)
    assert cli("declare", *chain_args(chain)).returncode == 0  # again: a no-op
    run_gateway(chain)
    receiver = Receiver(chain)
    before = now_ms()
    r = cli("publish", *chain_args(chain), "--delay", "400", "--routing-key", "cli.test", "--body", "hello",
            "--header", "n=5", "--header", "s=text", "--count", "2")
    assert r.returncode == 0, r.stderr
    published = [json.loads(line) for line in r.stdout.splitlines()]
    got = receiver.collect(2, timeout=10)
    assert sorted(m.properties.message_id for m in got) == sorted(p["published"] for p in published)
    for m in got:
        assert m.body == b"hello" and m.routing_key == "cli.test"
        assert sent_headers(m.properties) == {"x-delay": 400, "n": 5, "s": "text"}
        assert m.at_ms >= before + 400


def test_demo_runs_and_checks_its_own_result(broker):
    prefix = "demo" + str(now_ms())
    with socket.socket() as closed:  # bound, never listening: the first node is down
        closed.bind(("127.0.0.1", 0))
        down = f"amqp://guest:guest@127.0.0.1:{closed.getsockname()[1]}/%2F"
        r = cli("demo", "--prefix", prefix, "--max-level", "4", "--delays", "600,0,300", timeout=120,
                env={"DELAY_GATEWAY_URL": f"{down},{broker_url()}"})
    try:
        assert r.returncode == 0, r.stdout + r.stderr
        assert "3 delivered, in due order, 0 early" in r.stdout
    finally:
        remove(ChainSettings(prefix=prefix, max_level=4))


def demo(prefix: str, env=None) -> subprocess.CompletedProcess:
    """`delay-gateway demo` as ./scripts/run starts it, stdout and stderr in one stream as a
    terminal shows them (not a terminal here: the gateway's log lines would be JSON)."""
    return subprocess.run([sys.executable, "-m", "gateway", "demo", "--prefix", prefix, "--max-level", "4",
                           "--delays", "600,0,300"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, timeout=120, env={**os.environ, "DELAY_GATEWAY_URL": broker_url(), **(env or {})})


def test_the_demo_says_only_what_concerns_the_demo(broker):
    """The first minute: on 3.10 (no arrival stamp) the gateway warns at start about cancels
    with several replicas, which the demo has neither of; the demo shows its table and its
    summary and nothing else."""
    prefix = unique_prefix()
    try:
        r = demo(prefix)
        assert r.returncode == 0, r.stdout
        lines = r.stdout.splitlines()
        assert not [line for line in lines if any(notice in line for notice in START_NOTICES)], r.stdout
        assert lines[0] == (f"publishing 3 messages to {prefix}.check-in; receiving from {prefix}.pick-up "
                            "(binding demo.#)")
        assert lines[1] == "" and lines[2].split() == ["routing", "key", "x-delay", "arrived", "after", "late", "by"]
        assert [line.split()[:3] for line in lines[3:6]] == [["demo.1", "0", "ms"], ["demo.2", "300", "ms"],
                                                             ["demo.0", "600", "ms"]]
        assert lines[6] == "" and lines[7].startswith("3 delivered, in due order, 0 early; lateness ")
        assert len(lines) == 8, r.stdout
    finally:
        remove(ChainSettings(prefix=prefix, max_level=4))


@pytest.mark.brokers("rmq3.10", reason="the demo's own handling of its gateway's exit; the broker plays no part")
def test_the_demo_names_its_gateways_log_when_the_gateway_fails(broker):
    """The gateway's log goes to a file; when the gateway stops on an error, the demo says so
    in one line with the gateway's last line and where the whole log is, and keeps the file."""
    prefix = unique_prefix()
    with socket.socket() as taken:  # the gateway's metrics port, already bound: it cannot start
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        try:
            r = demo(prefix, env={"DELAY_GATEWAY_METRICS_PORT": str(taken.getsockname()[1])})
        finally:
            remove(ChainSettings(prefix=prefix, max_level=4))
    assert r.returncode == 1, r.stdout
    [said] = [line for line in r.stdout.splitlines() if line.startswith("delay-gateway demo: ")]
    found = re.search(r"the gateway exited early \(exit \d+\): .*Address already in use.* \(its log: (\S+)\)$",
                      said)
    assert found, said
    try:
        assert "Address already in use" in open(found.group(1)).read()
    finally:
        os.unlink(found.group(1))
