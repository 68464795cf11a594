"""Fixtures shared by every test that talks to a broker.

`broker` is parametrized over the RabbitMQ versions the gateway is tested on, so each
broker-facing test runs once per version and its id says which: `[rmq3.10]` is the shared
node on 5672 (Debian bookworm's 3.10.8, or DELAY_GATEWAY_URL), `[rmq4.0]` a private node of
Debian trixie's 4.0.5 that this session starts from the root scripts/ensure-rabbitmq4
caches, with the broker's arrival stamp on. `./scripts/test -k rmq4.0` runs one version.
"""

import os
import socket
import subprocess
import tempfile
from urllib.parse import urlsplit

import pytest

from . import support
from .faults.nodes import ARRIVAL_STAMP, BROKER_LABELS, Cluster, NodeError, rabbitmq4_runtime, unique_names
from .support import GatewayProcess, chains, main_broker_url


# Tests that run on one broker only, and why; every other broker-facing test runs on both
# (README, "Tested on", says what each version changes). Keyed by test function name, with
# the parameters a rule is limited to. The gateway-only checks run on 3.10, where the
# README's figures come from, to keep the suite within its 15 minutes.
ONE_BROKER = {
    "test_imported_definitions_equal_what_declare_makes":
        ("rmq3.10", {}, "imports with the host's rabbitmqctl into the local node; "
                        "test_broker_versions.py imports the definitions on each version"),
    "test_password_never_in_logs_or_errors":
        ("rmq3.10", {}, "scans the gateway's own output; the broker only refuses a login; 10-15 s"),
    "test_broker_down_at_start_and_connections_closed":
        ("rmq3.10", {}, "the gateway's retries and reconnects; restarts and connection loss on 4.0 "
                        "are covered by the broker restart and cluster tests; 25-40 s"),
    "test_resource_alarm_blocks_then_resumes":
        ("rmq3.10", {"alarm": "disk"}, "the same connection.blocked as the memory alarm, which runs on "
                                       "both; 11-17 s"),
    "test_the_broker_then_holds_exactly_the_definitions_rendering":
        ("rmq3.10", {}, "reads back with the host's rabbitmqctl; the operator rendering is compared with "
                        "declare over AMQP on both brokers by test_render.py"),
    "test_a_message_the_broker_refuses_is_parked_and_touches_no_other":
        ("rmq3.10", {}, "lowers max_message_size at run time, which 4.0 reads once at boot; how the gateway "
                        "isolates a refused publish does not depend on the version"),
    "test_helm_upgrade_changes_the_chain_without_losing_or_delaying_a_message":
        ("rmq3.10", {}, "runs the chart's containers as processes: the chain change itself is "
                        "test_live_change.py's, on both brokers; 20 s"),
    "test_arrival_stamp_is_added_and_a_publishers_own_is_kept":
        ("rmq4.0", {}, "message interceptors exist from 3.12 on"),
    "test_the_receiver_sees_the_stamp_of_the_original_publish":
        ("rmq4.0", {}, "message interceptors exist from 3.12 on"),
}
# Whole modules whose parameter combinations run on one broker only.
ONE_BROKER_IN_MODULE = {
    # the Spark jobs are publishers and consumers like any other: what they test is Spark's
    # side (formats, rejections, resuming, the report), not the broker's; about 90 s each run
    "test_schedule": [("rmq3.10", {})],
    "test_report": [("rmq3.10", {})],
    "test_units": [("rmq3.10", {})],
    # the benchmark's own output and bookkeeping, not the broker's behaviour; about 40 s
    "test_bench": [("rmq3.10", {})],
    # quorum/queue (the default) and classic/exchange use every broker feature the four
    # modes use (quorum and classic v2 queues, pass queues, exchange-to-exchange bindings);
    # the other two run on 3.10. Saves about 30 s.
    "test_delivery": [("rmq3.10", {"chain": ("quorum", "exchange")}), ("rmq3.10", {"chain": ("classic", "queue")})],
}

def broker_label(item) -> str:
    """The broker version a test item runs on: its `broker` or (fault tests) `own_cluster`."""
    callspec = getattr(item, "callspec", None)
    params = callspec.params if callspec else {}
    return params.get("broker") or params.get("own_cluster")


# Fixtures that talk to a broker: a test using one (directly or through another) is marked
# `broker`, so `pytest -m "not broker"` runs the pure tests in seconds with no broker at all.
BROKER_FIXTURES = {"broker", "make_chain", "run_gateway", "own_cluster", "own_node", "node_chain"}


def pytest_collection_modifyitems(config, items):
    """Mark what needs a broker; leave out (deselect, never skip) the broker versions a test
    is not meant for."""
    for item in items:
        if BROKER_FIXTURES & set(getattr(item, "fixturenames", ())) or "/faults/" in str(item.fspath):
            item.add_marker(pytest.mark.broker)
    keep, drop = [], []
    for item in items:
        # A test module may say which of its parameter combinations run: `wanted(params)`.
        wanted = getattr(getattr(item, "module", None), "wanted", None)
        if wanted and hasattr(item, "callspec") and not wanted(item.callspec.params):
            drop.append(item)
            continue
        label = broker_label(item)
        rules = [ONE_BROKER[name] for name in [getattr(item, "originalname", item.name)] if name in ONE_BROKER]
        rules += ONE_BROKER_IN_MODULE.get(getattr(getattr(item, "module", None), "__name__", "").rpartition(".")[2], [])
        if label and any(label != rule[0] and all(item.callspec.params.get(k) == v for k, v in rule[1].items())
                         for rule in rules):
            drop.append(item)
            continue
        keep.append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


@pytest.fixture(scope="session")
def rabbitmq4_runtime_checked():
    """The cached RabbitMQ 4.0 root, or a failure that says how to get it (never a skip)."""
    runtime = rabbitmq4_runtime()
    try:
        runtime.check()
    except NodeError as exc:
        pytest.fail(str(exc), pytrace=False)
    return runtime


def private_rabbitmq4(runtime, tag: str, *config: str):
    cluster = Cluster(unique_names(1, tag), extra_config=list(config), runtime=runtime)
    cluster.start_or_fail(f"a RabbitMQ 4.0 node ({tag})")
    return cluster


@pytest.fixture(scope="session")
def rabbitmq4_node(rabbitmq4_runtime_checked):
    """A private RabbitMQ 4.0 node for the end-to-end tests, stamping arrival times."""
    cluster = private_rabbitmq4(rabbitmq4_runtime_checked, "e2e4", ARRIVAL_STAMP)
    yield cluster.nodes[0]
    cluster.close()


def reachable_or_fail(url: str) -> str:
    parts = urlsplit(url)
    try:
        socket.create_connection((parts.hostname, parts.port or 5672), timeout=3).close()
    except OSError as exc:
        pytest.fail(f"no RabbitMQ at {parts.hostname}:{parts.port or 5672} ({exc}); "
                    "run scripts/ensure-rabbitmq or set DELAY_GATEWAY_URL", pytrace=False)
    return url


@pytest.fixture(scope="session", params=BROKER_LABELS)
def broker(request) -> str:
    """A reachable broker of each version in turn, or a failure that says how to get one."""
    if request.param == "rmq3.10":
        return reachable_or_fail(main_broker_url())
    return request.getfixturevalue("rabbitmq4_node").url


class BrokerCtl:
    """rabbitmqctl for this test's broker, for reading (list_queues) and for what AMQP
    cannot do (import_definitions): the shared node's own CLI, or the private 4.0 node's."""

    def __init__(self, node=None) -> None:
        self.node = node

    def __call__(self, *args: str) -> str:
        if self.node is not None:
            return self.node.ctl(*args).stdout
        result = subprocess.run(["rabbitmqctl", *args], capture_output=True, text=True, timeout=60)
        assert result.returncode == 0, result.stderr
        return result.stdout

    def file(self, text: str, suffix: str) -> str:
        """Write `text` where the broker's CLI can read it; returns the path it sees."""
        directory = self.node.dir if self.node is not None else "/tmp"
        fd, path = tempfile.mkstemp(suffix=suffix, dir=directory)
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.chmod(path, 0o644)  # the CLI runs as the rabbitmq user
        return self.node.runtime.inside(path) if self.node is not None else path


@pytest.fixture
def broker_ctl(broker, request):
    if broker_label(request.node) == "rmq4.0":
        return BrokerCtl(request.getfixturevalue("rabbitmq4_node"))
    if os.environ.get("DELAY_GATEWAY_URL"):
        pytest.fail("this test drives the broker with rabbitmqctl: run it against the local node "
                    "(unset DELAY_GATEWAY_URL)", pytrace=False)
    return BrokerCtl()


@pytest.fixture(autouse=True)
def _broker_of_this_test(request):
    """Point support.broker_url() (used by connect(), GatewayProcess, the CLI helpers) at this
    test's broker: the version it is parametrized with, else the main one."""
    url = request.getfixturevalue("broker") if "broker" in request.fixturenames else None
    support.use_broker(url)
    yield
    support.use_broker(None)


@pytest.fixture
def make_chain(broker):
    """Declare a fresh chain with a unique prefix; delete it after the test."""
    with chains() as make:
        yield make


@pytest.fixture
def run_gateway():
    """Start `delay-gateway run` processes, ready (consuming every queue of their role);
    they are stopped after the test."""
    started = []

    def start(chain, *extra, **kwargs) -> GatewayProcess:
        process = GatewayProcess(chain, *extra, **kwargs)
        started.append(process)
        return process.wait_ready()

    yield start
    for process in started:
        if process.proc.poll() is None:
            process.terminate()


@pytest.fixture(autouse=True)
def _figures_to_report(record_property):
    """What the test passed to support.report_figures goes into its report (user properties),
    which xdist carries from the worker to the process that prints the summary."""
    support.FIGURES.clear()
    yield
    for section, line in support.FIGURES:
        record_property("figures: " + section, line)
    support.FIGURES.clear()


_SUMMARY: dict = {}


def pytest_runtest_logreport(report):
    # Recorded as the fixture tears down, so only the teardown report carries them.
    if report.when == "teardown":
        for name, value in report.user_properties:
            if name.startswith("figures: "):
                _SUMMARY.setdefault(name[9:], []).append(value)


def pytest_terminal_summary(terminalreporter):
    for section, lines in _SUMMARY.items():
        terminalreporter.section(section)
        for line in lines:
            terminalreporter.write_line(line)
