"""The settings table: flags, environment variables, defaults, errors, and the README (pure)."""

import os

import pytest

from gateway.cli import COMMANDS, main, parser
from gateway.settings import OPTIONS, settings_from, settings_table

from .support import ROOT

ENV = {"DELAY_GATEWAY_URL": "amqp://a/,amqp://b/", "DELAY_GATEWAY_PREFIX": "px",
       "DELAY_GATEWAY_MAX_LEVEL": "7", "DELAY_GATEWAY_RESOLUTION_MS": "250",
       "DELAY_GATEWAY_QUEUE_TYPE": "classic", "DELAY_GATEWAY_ZERO_BITS": "exchange",
       "DELAY_GATEWAY_ROLE": "distributor", "DELAY_GATEWAY_PREFETCH": "5",
       "DELAY_GATEWAY_DISTRIBUTOR_PREFETCH": "6", "DELAY_GATEWAY_LEAD_MS": "70",
       "DELAY_GATEWAY_HOLD_WITHIN_MS": "3000", "DELAY_GATEWAY_HOLD_MESSAGES": "30",
       "DELAY_GATEWAY_CATCH_UP_RATE": "250.5", "DELAY_GATEWAY_DUE_GAUGES_EVERY": "30.5",
       "DELAY_GATEWAY_STAMP_DUE_AT": "true", "DELAY_GATEWAY_DECLARE": "false",
       "DELAY_GATEWAY_METRICS_PORT": "9999", "DELAY_GATEWAY_CONNECT_TIMEOUT": "12.5",
       "DELAY_GATEWAY_LOG_LEVEL": "warning", "DELAY_GATEWAY_LOG_FORMAT": "json",
       "DELAY_GATEWAY_RETIRE": "false", "DELAY_GATEWAY_RETIRE_AFTER": "30", "DELAY_GATEWAY_PENDING_INDEX": "false",
       "DELAY_GATEWAY_CARRIER_MESSAGES": "50", "DELAY_GATEWAY_CARRIER_WAIT_MS": "7",
       "DELAY_GATEWAY_CARRIER_BYTES": "65536", "DELAY_GATEWAY_CONFIRM_TIMEOUT": "9",
       "DELAY_GATEWAY_CANCEL_RETENTION": "3600", "DELAY_GATEWAY_RETRY_BASE_MS": "250",
       "DELAY_GATEWAY_RETRY_FACTOR": "3", "DELAY_GATEWAY_RETRY_CAP_MS": "60000", "DELAY_GATEWAY_RETRY_ATTEMPTS": "4",
       "DELAY_GATEWAY_RETRY_JITTER": "0.5", "DELAY_GATEWAY_RETRY_POLICIES": '[{"queue": "q.*", "attempts": 1}]',
       "DELAY_GATEWAY_RETRY_QUEUES": "q.*,jobs", "DELAY_GATEWAY_VHOSTS": "orders, billing",
       "DELAY_GATEWAY_GATEWAY_USER": "delay-gw", "DELAY_GATEWAY_MANAGEMENT_URL": "http://rabbit-1:15672"}


def test_every_setting_reads_its_environment_variable_and_a_flag_beats_it():
    assert {o.env for o in OPTIONS} - set(ENV) == {
        "DELAY_GATEWAY_PASSWORD_FILE", "DELAY_GATEWAY_TLS_CA_FILE", "DELAY_GATEWAY_TLS_CERT_FILE",
        "DELAY_GATEWAY_TLS_KEY_FILE"}  # files: tested with real files in test_faults_units
    s = settings_from(parser(ENV).parse_args(["run"]))
    assert s.urls == ("amqp://a/", "amqp://b/")
    assert s.vhosts == ("orders", "billing")
    assert s.gateway_user == s.trusted_user == "delay-gw"
    assert (s.chain.prefix, s.chain.max_level, s.chain.resolution_ms) == ("px", 7, 250)
    assert (s.chain.queue_type, s.chain.zero_bits) == ("classic", "exchange")
    assert (s.role, s.prefetch, s.distributor_prefetch, s.lead_ms) == ("distributor", 5, 6, 70)
    assert (s.stamp_due_at, s.declare, s.metrics_port, s.connect_timeout) == (True, False, 9999, 12.5)
    assert (s.log_level, s.log_format, s.retire, s.retire_after) == ("warning", "json", False, 30.0)
    assert s.pending_index is False
    assert (s.hold_within_ms, s.hold_messages, s.catch_up_rate, s.due_gauges_every) == (3000, 30, 250.5, 30.5)
    assert (s.carrier_messages, s.carrier_wait_ms, s.carrier_bytes, s.confirm_timeout) == (50, 7, 65536, 9.0)
    assert s.cancel_retention == 3600.0
    assert (s.retry_base_ms, s.retry_factor, s.retry_cap_ms, s.retry_attempts, s.retry_jitter, s.retry_queues) == \
        (250, 3.0, 60000, 4, 0.5, "q.*,jobs")
    assert [(p.queue, p.attempts, p.base_ms) for p in s.retry_rules()] == [("q.*", 1, 250), ("*", 4, 250)]
    assert s.management_url is None  # not a setting of run
    assert settings_from(parser(ENV).parse_args(["declare"])).management_url == "http://rabbit-1:15672"
    flags = settings_from(parser(ENV).parse_args(["run", "--max-level", "9", "--declare", "--lead-ms", "1"]))
    assert (flags.chain.max_level, flags.declare, flags.lead_ms) == (9, True, 1)


def test_defaults_work_against_a_local_broker():
    s = settings_from(parser({}).parse_args(["run"]))
    assert s.urls == ("amqp://guest:guest@127.0.0.1:5672/%2F",)
    assert (s.chain.prefix, s.chain.max_level, s.chain.resolution_ms) == ("delay", 20, 1000)
    assert (s.chain.queue_type, s.chain.zero_bits, s.role, s.lead_ms) == ("quorum", "queue", "all", 50)
    assert (s.declare, s.stamp_due_at, s.metrics_port) == (True, False, 0)
    assert (s.hold_within_ms, s.hold_messages) == (10_000, 1000)
    assert s.gateway_user is None and s.trusted_user == "guest"


@pytest.mark.parametrize("urls,user", [("amqp://guest:guest@127.0.0.1/%2F", "guest"),
                                       ("amqp://rabbit-1/,amqp://other@rabbit-2/", "guest"),
                                       ("amqps://delay%2Dgw:x@rabbit-1/,amqp://other@rabbit-2/", "delay-gw")])
def test_the_trusted_writer_is_the_first_urls_user_unless_named(urls, user):
    """Readers trust the records of the gateway user: --gateway-user, else the first URL's
    user (guest when it names none, as the client logs in)."""
    s = settings_from(parser({"DELAY_GATEWAY_URL": urls}).parse_args(["pending", "count"]))
    assert s.trusted_user == user
    named = settings_from(parser({"DELAY_GATEWAY_URL": urls}).parse_args(["pending", "count", "--gateway-user",
                                                                         "gw"]))
    assert named.trusted_user == "gw"


BAD = {"DELAY_GATEWAY_MAX_LEVEL": "many", "DELAY_GATEWAY_RESOLUTION_MS": "0", "DELAY_GATEWAY_QUEUE_TYPE": "stream",
       "DELAY_GATEWAY_ZERO_BITS": "bits", "DELAY_GATEWAY_ROLE": "both", "DELAY_GATEWAY_PREFETCH": "abc",
       "DELAY_GATEWAY_DISTRIBUTOR_PREFETCH": "-1", "DELAY_GATEWAY_LEAD_MS": "1.5",
       "DELAY_GATEWAY_STAMP_DUE_AT": "maybe", "DELAY_GATEWAY_DECLARE": "sometimes",
       "DELAY_GATEWAY_METRICS_PORT": "70000", "DELAY_GATEWAY_CONNECT_TIMEOUT": "soon",
       "DELAY_GATEWAY_LOG_LEVEL": "loud", "DELAY_GATEWAY_LOG_FORMAT": "xml",
       "DELAY_GATEWAY_RETIRE": "perhaps", "DELAY_GATEWAY_RETIRE_AFTER": "-5",
       "DELAY_GATEWAY_CARRIER_MESSAGES": "0", "DELAY_GATEWAY_CARRIER_WAIT_MS": "soon",
       "DELAY_GATEWAY_CARRIER_BYTES": "1", "DELAY_GATEWAY_CONFIRM_TIMEOUT": "-1"}


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_bad_environment_value_is_one_line_and_exit_2_for_every_command(command, capsys):
    for name, value in BAD.items():
        option = next(o for o in OPTIONS if o.env == name)
        if not COMMANDS[command].takes(option):
            continue  # a command that does not take the option does not read it (test_cli_errors)
        args = [command] + {"explain": ["100"], "parked": ["list"], "pending": ["count"]}.get(command, [])
        code = main(args, environ={name: value})
        err = capsys.readouterr().err
        assert code == 2, (command, name)
        assert len(err.strip().splitlines()) == 1, (command, name, err)
        assert name in err and "Traceback" not in err


def test_a_bad_flag_is_one_line_and_exit_2(capsys):
    assert main(["run", "--max-level", "41"], environ={}) == 2
    assert capsys.readouterr().err.strip() == \
        "delay-gateway run: error: argument --max-level: 41 is out of range (from 1 to 40)"


def test_settings_rabbitmq_cannot_hold_are_refused_with_the_fix(capsys):
    assert main(["render", "--max-level", "30"], environ={}) == 2
    assert "use max_level <= 28" in capsys.readouterr().err


def test_the_operating_guide_settings_table_is_the_settings_table():
    with open(os.path.join(ROOT, "docs", "operating.md"), encoding="utf-8") as f:
        guide = f.read()
    assert settings_table() in guide


def test_explain_reads_the_lead_from_the_environment(capsys):
    assert main(["explain", "1000"], environ={"DELAY_GATEWAY_LEAD_MS": "200"}) == 0
    assert "lead 200 ms" in capsys.readouterr().out

