"""The delay-gateway command: settings from flags and environment, and each subcommand."""

import json
import os
import subprocess
import sys


from gateway.cli import parser
from gateway.settings import redact, settings_from

from .support import ROOT, Receiver, broker_url, chain_args, now_ms, remove


def cli(*args, env=None, timeout=60):
    return subprocess.run([sys.executable, "-m", "gateway", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "DELAY_GATEWAY_URL": broker_url(), **(env or {})})


def test_every_setting_reads_its_environment_variable():
    environ = {"DELAY_GATEWAY_URL": "amqp://a/,amqp://b/", "DELAY_GATEWAY_PREFIX": "px",
               "DELAY_GATEWAY_MAX_LEVEL": "7", "DELAY_GATEWAY_RESOLUTION_MS": "250",
               "DELAY_GATEWAY_QUEUE_TYPE": "classic", "DELAY_GATEWAY_ZERO_BITS": "exchange",
               "DELAY_GATEWAY_ROLE": "distributor", "DELAY_GATEWAY_PREFETCH": "5",
               "DELAY_GATEWAY_METRICS_PORT": "9999", "DELAY_GATEWAY_DECLARE": "false"}
    s = settings_from(parser(environ).parse_args(["run"]))
    assert s.urls == ("amqp://a/", "amqp://b/")
    assert (s.chain.prefix, s.chain.max_level, s.chain.resolution_ms) == ("px", 7, 250)
    assert (s.chain.queue_type, s.chain.zero_bits) == ("classic", "exchange")
    assert (s.role, s.prefetch, s.metrics_port, s.declare) == ("distributor", 5, 9999, False)
    # a flag beats the environment
    assert settings_from(parser(environ).parse_args(["run", "--max-level", "9"])).chain.max_level == 9


def test_defaults_work_against_a_local_broker():
    s = settings_from(parser({}).parse_args(["run"]))
    assert s.urls == ("amqp://guest:guest@127.0.0.1:5672/%2F",)
    assert (s.chain.prefix, s.chain.max_level, s.chain.resolution_ms) == ("delay", 20, 1000)
    assert (s.chain.queue_type, s.chain.zero_bits, s.role) == ("quorum", "queue", "all")


def test_passwords_are_redacted():
    assert redact("amqp://u:s3cret@host:5673/v") == "amqp://u:***@host:5673/v"
    assert redact("amqp://host/") == "amqp://host/"


def test_settings_rabbitmq_cannot_hold_fail_with_the_fix():
    r = cli("declare", "--max-level", "30")
    assert r.returncode == 2
    assert "use max_level <= 28" in r.stderr


def test_an_unreachable_broker_is_named_without_its_password():
    r = cli("declare", env={"DELAY_GATEWAY_URL": "amqp://guest:hunter2@127.0.0.1:1/%2F"})
    assert r.returncode == 2
    assert "cannot connect to amqp://guest:***@127.0.0.1:1/%2F" in r.stderr
    assert "hunter2" not in r.stderr + r.stdout


def test_definitions_prints_json_for_import():
    r = cli("definitions", "--prefix", "x", "--max-level", "2", "--vhost", "prod")
    doc = json.loads(r.stdout)
    assert {q["name"] for q in doc["queues"]} >= {"x.check-in", "x.meditation", "x.level.01.delay", "x.parked"}


def test_explain_shows_the_route():
    r = cli("explain", "27000", "--max-level", "4")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert "delay.meditation" in lines[1] and "key '1.1.0.1'" in lines[2]
    assert "hold 999 ms" in lines[-1]


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
        assert m.properties.headers == {"x-delay": 400, "n": 5, "s": "text"}
        assert m.at_ms >= before + 400


def test_demo_runs_and_checks_its_own_result():
    prefix = "demo" + str(now_ms())
    r = cli("demo", "--prefix", prefix, "--max-level", "4", "--delays", "600,0,300", timeout=120)
    try:
        assert r.returncode == 0, r.stdout + r.stderr
        assert "3 delivered, in due order, 0 early" in r.stdout
    finally:
        from topology import ChainSettings
        remove(ChainSettings(prefix=prefix, max_level=4))
