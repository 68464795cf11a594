"""Every command on a cluster whose first node is down, and what a user sees when something
is wrong: one line on stderr, the documented exit code, no traceback, no pika log lines.

Against the shared broker (each test with a prefix of its own), and a port that is bound and
not listening, so nothing can answer there for as long as the test holds it.
"""

import concurrent.futures
import json
import os
import socket
import subprocess
import sys
import uuid
from typing import Dict, List, Sequence
from urllib.parse import urlsplit, urlunsplit

import pytest

from .support import ROOT, chain_args, connect

NO_BROKER, BAD_USAGE, REFUSED = 1, 2, 3


def wanted(params: dict) -> bool:
    """The commands' own behaviour, not the broker's: on the shared node only."""
    return params.get("broker") in (None, "rmq3.10")


@pytest.fixture
def closed_port():
    """A port no one listens on: bound here (so no one else can take it), never listening."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    yield sock.getsockname()[1]
    sock.close()


def cli(*args: str, url: str, timeout: float = 60) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DELAY_GATEWAY_")}
    return subprocess.run([sys.executable, "-m", "gateway", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, env={**env, "DELAY_GATEWAY_URL": url})


def together(runs: Dict[str, Sequence[str]], url: str, timeout: float = 60) -> Dict[str, subprocess.CompletedProcess]:
    """Each command line of `runs` at once (they are independent): the test takes as long as the slowest."""
    with concurrent.futures.ThreadPoolExecutor(len(runs)) as pool:
        futures = {name: pool.submit(cli, *argv, url=url, timeout=timeout) for name, argv in runs.items()}
        return {name: f.result() for name, f in futures.items()}


def with_port(url: str, port: int, password: str = "") -> str:
    parts = urlsplit(url)
    user = parts.username or "guest"
    secret = password or parts.password or "guest"
    return urlunsplit(parts._replace(netloc=f"{user}:{secret}@{parts.hostname}:{port}"))


def one_line(r: subprocess.CompletedProcess, command: str) -> str:
    """The whole of stderr: exactly one line, from the command itself."""
    lines = r.stderr.splitlines()
    assert len(lines) == 1, f"{command}: stderr is not one line:\n{r.stderr}"
    assert lines[0].startswith("delay-gateway "), lines
    assert "Traceback" not in r.stderr and "pika" not in r.stderr
    return lines[0]


def test_every_command_moves_on_to_the_next_node(broker, make_chain, run_gateway, closed_port, tmp_path):
    chain = make_chain(max_level=3, resolution_ms=100)
    urls = f"{with_port(broker, closed_port)},{broker}"
    args = chain_args(chain)
    run_gateway(chain)
    runs = {
        "declare": ["declare", *args],
        "status": ["status", *args],
        "publish": ["publish", *args, "--delay", "100", "--routing-key", "failover"],
        "parked": ["parked", "list", *args],
        "selftest": ["selftest", *args, "--delay-ms", "200", "--timeout", "30"],
        "record": ["record", "--prefix", chain.prefix, "--idle-timeout", "1",
                   "--out", str(tmp_path / "recorded.jsonl")],
        "migrate": ["migrate", *args, "--dry-run"],
    }
    results = together(runs, urls)
    for name, r in results.items():
        assert r.returncode == 0, f"{name}: exit {r.returncode}\n{r.stderr}"
        assert "Traceback" not in r.stderr, (name, r.stderr)
    assert json.loads(results["selftest"].stdout)["delivered"] is True
    assert "declared" in results["declare"].stdout


def test_the_schedule_check_moves_on_too(broker, closed_port, make_chain):
    from gateway.spark.table_job import check_exchange
    chain = make_chain(max_level=2, resolution_ms=100)
    check_exchange([with_port(broker, closed_port), broker], None, chain.names.check_in, "schedule")  # raises if not


def test_unreachable_and_refused_are_one_line_with_their_exit_codes(broker, make_chain, closed_port):
    chain = make_chain(max_level=2, resolution_ms=100)
    args = chain_args(chain)
    commands: Dict[str, List[str]] = {
        "status": ["status", *args],
        "publish": ["publish", *args, "--delay", "10"],
        "declare": ["declare", *args],
        "parked": ["parked", "list", *args],
        "selftest": ["selftest", *args, "--delay-ms", "10", "--timeout", "1"],
    }
    wrong = f"wrong-{uuid.uuid4().hex[:8]}"
    port = urlsplit(broker).port or 5672
    refused = together(commands, with_port(broker, port, password=wrong))
    unreachable = together(commands, with_port(broker, closed_port))
    for name in commands:
        line = one_line(refused[name], name)
        assert refused[name].returncode == REFUSED, (name, line)
        assert "login refused for user 'guest'" in line and "check the user name and password" in line
        assert wrong not in line
        line = one_line(unreachable[name], name)
        assert unreachable[name].returncode == NO_BROKER, (name, line)
        assert f":{closed_port}" in line and "connection refused" in line and "check the host and port" in line


def test_run_ends_with_a_plain_line_when_it_gives_up(broker, make_chain, closed_port):
    chain = make_chain(max_level=2, resolution_ms=100)
    wrong = f"wrong-{uuid.uuid4().hex[:8]}"
    port = urlsplit(broker).port or 5672
    runs = {"unreachable": ["run", *chain_args(chain), "--connect-timeout", "1", "--no-declare"],
            "refused": ["run", *chain_args(chain), "--connect-timeout", "30", "--no-declare"]}
    gone = cli(*runs["unreachable"], url=with_port(broker, closed_port))
    refused = cli(*runs["refused"], url=with_port(broker, port, password=wrong))
    for r, code in ((gone, NO_BROKER), (refused, REFUSED)):
        assert r.returncode == code, r.stderr
        assert "Traceback" not in r.stderr
        assert not [line for line in r.stderr.splitlines() if '"logger": "pika' in line], r.stderr
        last = r.stderr.splitlines()[-1]
        assert last.startswith("delay-gateway run: ") and not last.startswith("{"), last
    assert "giving up" in gone.stderr.splitlines()[-1] and "connection refused" in gone.stderr.splitlines()[-1]
    assert "login refused" in refused.stderr.splitlines()[-1]


def test_a_missing_topology_is_refused_in_one_line(broker):
    prefix = "nothing" + uuid.uuid4().hex[:8]
    r = cli("publish", "--prefix", prefix, "--delay", "10", url=broker)
    line = one_line(r, "publish")
    assert r.returncode == REFUSED and f"{prefix}.check-in" in line and "delay-gateway declare" in line
    # check-in there, but no queue behind it: the broker returns the message (mandatory)
    with connect(broker) as connection:
        connection.channel().exchange_declare(f"{prefix}.check-in", "topic")
        try:
            r = cli("publish", "--prefix", prefix, "--delay", "10", url=broker)
        finally:
            connection.channel().exchange_delete(f"{prefix}.check-in")
    line = one_line(r, "publish")
    assert r.returncode == REFUSED and "routed the message to no queue" in line and "declare" in line


# -- the smaller points ----------------------------------------------------------------------------
def test_selftest_says_at_once_that_no_gateway_consumes(broker, make_chain):
    chain = make_chain(max_level=2, resolution_ms=100)
    r = cli("selftest", "--prefix", chain.prefix, "--timeout", "60", url=broker)
    line = one_line(r, "selftest")
    assert r.returncode == 1 and r.stdout == ""
    assert f"nothing consumes {chain.names.check_in}" in line and "delay-gateway run" in line


def test_migrate_dry_run_prints_the_plan_and_changes_nothing(broker, make_chain):
    old = make_chain(max_level=2, resolution_ms=100)
    assert cli("declare", *chain_args(old), url=broker).returncode == 0  # recorded in the registry
    alone = cli("migrate", *chain_args(old), "--dry-run", url=broker)
    new = make_chain(prefix=old.prefix, max_level=3, resolution_ms=100)
    assert cli("declare", *chain_args(new), url=broker).returncode == 0
    r = cli("migrate", *chain_args(new), "--dry-run", "--retire-after", "0", url=broker)
    assert r.returncode == 0 and alone.returncode == 0, r.stderr + alone.stderr
    assert "nothing to do" in json.loads(alone.stdout.splitlines()[-1])["summary"], alone.stdout
    events = [json.loads(line) for line in r.stdout.splitlines()]
    assert any(e["event"].startswith("would_") for e in events), events
    assert {"event": "chain_remaining", "chain": "100ms-quorum-queue, 2 levels", "gateways": 0,
            "empty_by": None} in events
    assert events[-1]["event"] == "dry_run" and events[-1]["other_chains"] == 1 and "nothing changed" in \
        events[-1]["summary"]
    status = json.loads(cli("status", *chain_args(old), "--json", url=broker).stdout)
    assert [c["chain"]["max_level"] for c in status["chains"] if c["declared"]] == [2, 3]  # both still there


def test_the_pypi_topology_distribution_beside_the_gateway_is_said_in_one_line(tmp_path):
    """Installed in the same environment, the unrelated PyPI `topology` shares the import
    name: the command says so before anything imports it, exit 3, instead of a traceback
    from whichever files won."""
    info = tmp_path / "topology-1.2.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: topology\nVersion: 1.2\n")
    env = dict(os.environ, PYTHONPATH=str(tmp_path))
    r = subprocess.run([sys.executable, "-m", "gateway", "--version"], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == REFUSED and r.stdout == "", r
    [line] = r.stderr.splitlines()
    assert "`topology` 1.2" in line and "environment of its own" in line, line
    assert subprocess.run([sys.executable, "-m", "gateway", "--version"], cwd=ROOT, capture_output=True,
                          timeout=60).returncode == 0


# -- what a new user met following the docs -------------------------------------------------
def test_an_unknown_flag_names_the_command_and_the_fix(capsys):
    from gateway.cli import main
    assert main(["status", "--bogus"], environ={}) == BAD_USAGE
    assert capsys.readouterr().err.strip() == \
        "delay-gateway status: error: unrecognized arguments: --bogus: see `delay-gateway status --help`"
    assert main(["parked", "list", "--dry-run"], environ={}) == BAD_USAGE  # replay's flag, not list's
    assert capsys.readouterr().err.strip().startswith("delay-gateway parked list: error: unrecognized arguments")


def test_a_bad_environment_value_names_the_command_and_only_its_command_reads_it(capsys):
    from gateway.cli import main
    assert main(["run"], environ={"DELAY_GATEWAY_DECLARE": "maybe"}) == BAD_USAGE
    [line] = capsys.readouterr().err.splitlines()
    assert line.startswith("delay-gateway run: error: DELAY_GATEWAY_DECLARE: 'maybe' is not true or false"), line
    assert line.endswith(": set it to one, or unset it"), line
    # explain takes no --declare: a variable only `run` reads cannot break it
    assert main(["explain", "1000"], environ={"DELAY_GATEWAY_DECLARE": "maybe"}) == 0


def test_each_parked_verb_has_its_own_help_and_render_says_its_default(capsys):
    from gateway.cli import main
    pages = {}
    for argv in (["parked", "list", "--help"], ["parked", "replay", "--help"], ["render", "--help"]):
        assert main(argv, environ={}) == 0
        pages[argv[1]] = " ".join(capsys.readouterr().out.split())
    assert "--json" in pages["list"] and "--dry-run" not in pages["list"], pages["list"]
    assert "--dry-run" in pages["replay"] and "--json" not in pages["replay"], pages["replay"]
    assert pages["list"].startswith("usage: delay-gateway parked list") and "moves nothing" in pages["list"]
    assert "(default: definitions)" in pages["--help"], pages["--help"]


def test_run_without_its_topology_says_it_in_its_own_words(broker):
    """--no-declare and nothing declared: exit 3 after its attempts, each logged once as the
    gateway's own event, and no line carries the AMQP client's text."""
    prefix = "nothing" + uuid.uuid4().hex[:8]
    r = cli("run", "--prefix", prefix, "--no-declare", "--log-format", "json", url=broker)
    assert r.returncode == REFUSED, r.stderr
    *logged, last = r.stderr.splitlines()
    assert last.startswith("delay-gateway run: ") and f"'{prefix}.check-in'" in last and "declare" in last, last
    events = [json.loads(line)["event"] for line in logged]  # every other line: the gateway's JSON events
    assert events.count("broker_refused") == 3 and "reconnecting" not in events, events
    for raw in ("ChannelClosedByBroker", "NOT_FOUND - ", "Traceback", "pika"):
        assert raw not in r.stderr, (raw, r.stderr)
