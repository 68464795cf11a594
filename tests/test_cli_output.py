"""What the commands print, when no broker is needed to see it: explain's route, parked's
grouping, the console log format off a terminal, and the options each command lists."""

import os
import subprocess
import sys

import pytest

from gateway.cli import COMMANDS, main
from gateway.commands import explain, parked
from gateway.core import envelope
from gateway.core.routes import Way
from gateway.core.wire import Properties
from gateway.settings import OPTIONS
from topology import ChainSettings

from .support import ROOT

CHAIN = ChainSettings()


def run(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DELAY_GATEWAY_")}
    return subprocess.run([sys.executable, "-m", "gateway", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=60, env=env)


def naive_laps(delay_ms: int, planner: explain.Planner) -> int:
    laps = 0
    while planner(delay_ms - laps * planner.chain.meditation_ms).way is Way.MEDITATION:
        laps += 1
    return laps


# (the defaults: a lead of 50 ms and a carrier wait of 200 ms leave 2^20 units from 1,048,576,250 ms on)
@pytest.mark.parametrize("delay_ms", [1, 1_048_575_049, 1_048_575_051, 1_048_576_000, 1_048_576_249,
                                      1_048_576_250, 2_097_150_100, 2_097_151_250, 3_000_000_000_000,
                                      10 * 1_048_575_000 + 7])
def test_explain_counts_laps_as_the_gateway_takes_them(delay_ms):
    planner = explain.Planner(CHAIN, 50, 200, 10_000)
    assert explain.laps(delay_ms, planner) == naive_laps(delay_ms, planner)


def test_explain_sums_up_the_laps_in_one_line(capsys):
    assert main(["explain", "3000000000000"], environ={}) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) < 30  # was one line per lap: 2,879
    laps = [line for line in lines if "meditation" in line]
    assert len(laps) == 1 and "2861 times (95.1 years)" in laps[0]
    # the route adds up to the delay: the laps, the levels' waits and the distributor's hold
    levels = sum(int(line.split("wait ")[1].split(" ms")[0]) for line in lines[2:-1] if " wait " in line)
    held = int(lines[-1].split("hold ")[1].split(" ms")[0])
    assert 2861 * CHAIN.meditation_ms + levels + held == 3_000_000_000_000 and 0 <= held <= 1050
    # a delay on a one-unit chain laps trillions of times: still a few lines, at once
    assert main(["explain", "3000000000000", "--max-level", "1", "--resolution-ms", "1", "--hold-within-ms", "0"],
                environ={}) == 0
    assert len(capsys.readouterr().out.splitlines()) == 5  # laps, a level, its hop, the distributor
    assert main(["explain", "3000000000000", "--max-level", "1", "--resolution-ms", "1"], environ={}) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 3 and "straight from returning" in lines[-1]  # laps, then the distributor's hold


@pytest.mark.parametrize("delay", ["-5", "0"])
def test_explain_says_a_delay_of_zero_or_less_is_due_now(delay, capsys):
    assert main(["explain", delay], environ={}) == 0
    out = capsys.readouterr().out
    assert "due now" in out and "hold -" not in out


def test_explain_refuses_a_delay_beyond_the_gateways_range(capsys):
    assert main(["explain", "99999999999999999999"], environ={}) == 2
    assert "beyond the gateway's range" in capsys.readouterr().err


def parked_message(key: bytes, reason: str) -> parked.Parked:
    return parked.Parked(1, envelope.inside(Properties.build(message_id=key), key, 5, reason), b"", key)


def test_parked_list_groups_by_the_kind_of_reason(capsys):
    keys = (b"orders.1", b"orders.2", b"audit.7")  # as CheckIn.unroutable words it
    unroutable = [f"unroutable: no queue bound to exchange 'delay.pick-up' matches routing key {k.decode()!r}"
                  for k in keys]
    messages = [parked_message(k, r) for k, r in zip(keys, unroutable, strict=False)]
    messages += [parked_message(b"x", "x-delay is 'soon', not a number"),
                 parked_message(b"y", "x-delay is 'later', not a number"),
                 parked_message(b"z", "x-delay 99999999999999999999 ms is out of range (at most 31557600000000 "
                                      "ms, 1000 years)")]
    r = parked.report(messages)
    kinds = {k["kind"]: k for k in r["kinds"]}
    key = "unroutable: no queue bound to exchange 'delay.pick-up' matches routing key '…'"
    assert kinds[key]["count"] == 3 and kinds[key]["routing_keys"] == {"orders.1": 1, "orders.2": 1, "audit.7": 1}
    assert kinds["x-delay is '…', not a number"]["count"] == 2
    assert "x-delay N ms is out of range (at most N ms, 1000 years)" in kinds
    assert len(r["reasons"]) == 6  # the full reasons stay in the JSON
    parked.print_report(r, as_json=False)
    out = capsys.readouterr().out
    assert f"       3  {key}" in out and "routing keys: 'orders.1' (1), 'orders.2' (1), 'audit.7' (1)" in out


def test_the_reasons_the_gateway_writes_group_by_kind():
    """Every reason of the same kind with other values reads the same."""
    from gateway.core.envelope import Unreadable, due_at
    from gateway.core.wire import Table, long, longstr

    def reason(headers) -> str:
        with pytest.raises(Unreadable) as exc:
            due_at(Table(headers), 1_800_000_000_000)
        return str(exc.value)
    pairs = [([longstr("x-delay", "soon")], [longstr("x-delay", "tomorrow")]),
             ([long("x-deliver-at", 1_700_000_000)], [long("x-deliver-at", 1_600_000_001)]),
             ([long("x-delay", 10**17)], [long("x-delay", 10**16 * 7)])]
    for a, b in pairs:
        assert parked.kind(reason(a)) == parked.kind(reason(b)), (reason(a), reason(b))


def test_the_console_log_format_has_no_colour_codes_off_a_terminal(tmp_path):
    log = tmp_path / "log.txt"
    with open(log, "w") as f:
        subprocess.run([sys.executable, "-c", "from gateway import logs; import structlog; "
                        "logs.configure('info', 'console'); structlog.get_logger('x').warning('hello', n=1)"],
                       cwd=ROOT, stderr=f, check=True, timeout=60)
    text = log.read_text()
    assert "hello" in text and "n=1" in text and "\x1b[" not in text


@pytest.mark.parametrize("command", ["schedule", "record"])
def test_schedule_and_record_list_only_the_options_they_use(command):
    r = run(command, "--help")
    assert r.returncode == 0
    assert "--prefix" in r.stdout and "--url" in r.stdout
    for option in OPTIONS:
        if option.group == "chain" and option.name != "prefix":
            assert option.flag not in r.stdout, (command, option.flag)
    assert not COMMANDS[command].takes(next(o for o in OPTIONS if o.name == "max_level"))
    refused = run(command, *(["x.csv"] if command == "schedule" else []), "--max-level", "3")
    assert refused.returncode == 2 and "unrecognized arguments: --max-level" in refused.stderr
