"""Fixtures shared by every test that talks to a broker.

`broker` is parametrized over the RabbitMQ versions the gateway is tested on, so each
broker-facing test runs once per version and its id says which: `[rmq3.10]` is the shared
node on 5672 (Debian bookworm's 3.10.8, or DELAY_GATEWAY_URL); `[rmq4.3]` (Debian forky's
4.3.x, Khepri) and `[rmq4.0]` (Debian trixie's 4.0.x) are private nodes this session starts
from the roots scripts/ensure-rabbitmq4 caches, with the broker's arrival stamp on.

Which versions run: DELAY_GATEWAY_TEST_BROKERS, comma-separated, default "3.10,4.3" (the
oldest supported and the newest: the whole suite within its 15 minutes on 2 cores);
"3.10,4.3,4.0" adds 4.0. The others are deselected, never skipped. `-k rmq4.3` picks one.
"""

import os
import socket
import subprocess
import tempfile
from typing import Callable, Dict, List
from urllib.parse import urlsplit

import pytest
from hypothesis import settings as hypothesis_settings

from . import support
from .faults.nodes import (ARRIVAL_STAMP, BROKER_LABELS, CTL, HOST_RUNTIME, Cluster, Node, NodeError, Runtime,
                           runtime_for, unique_names)
from .support import GatewayProcess, chains, main_broker_url

DEFAULT_BROKERS = "3.10,4.3"

# Property tests: a quick budget while developing, the full one in the test command
# (scripts/test exports HYPOTHESIS_PROFILE=full); each test scales its own with
# support.examples.
hypothesis_settings.register_profile("full", deadline=None)
hypothesis_settings.register_profile("quick", max_examples=10, deadline=None)
hypothesis_settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "quick"))


def brokers_wanted(environ=os.environ) -> List[str]:
    """The broker labels this run uses (DELAY_GATEWAY_TEST_BROKERS)."""
    text = environ.get("DELAY_GATEWAY_TEST_BROKERS", "").strip() or DEFAULT_BROKERS
    wanted = []
    for part in text.split(","):
        label = part.strip()
        label = label if label.startswith("rmq") else "rmq" + label
        if label not in BROKER_LABELS:
            raise pytest.UsageError(f"DELAY_GATEWAY_TEST_BROKERS={text!r}: {part.strip()!r} is not one of "
                                    + ", ".join(b[3:] for b in BROKER_LABELS))
        wanted.append(label)
    return wanted


# Tests that run on some brokers only say so, and why, with a marker (every other
# broker-facing test runs on each broker of the run; docs/reliability.md, "Tested on", says
# what each version changes):
#     @pytest.mark.brokers("rmq3.10", reason="...")          (a test)
#     pytestmark = [pytest.mark.brokers("rmq3.10", when={"fmt": "json"})]   (a module)
# `when` limits a rule to the parameter combinations it names. The gateway-only checks run
# on 3.10, where the figures in the docs come from, to keep the suite within its 15 minutes.

def broker_label(item) -> str:
    """The broker version a test item runs on: its `broker`, (fault tests) `own_cluster`, or
    (cluster tests) the first part of `cluster`."""
    callspec = getattr(item, "callspec", None)
    params = callspec.params if callspec else {}
    cluster = params.get("cluster")
    return params.get("broker") or params.get("own_cluster") or (cluster[0] if isinstance(cluster, tuple) else None)


# Fixtures that talk to a broker: a test using one (directly or through another) is marked
# `broker`, so `pytest -m "not broker"` runs the pure tests in seconds with no broker at all.
BROKER_FIXTURES = {"broker", "make_chain", "run_gateway", "own_cluster", "own_node", "node_chain"}


def pytest_configure(config):
    config.delay_gateway_brokers = brokers_wanted()


def pytest_report_header(config):
    return "brokers: " + ", ".join(config.delay_gateway_brokers) + " (DELAY_GATEWAY_TEST_BROKERS)"


def pytest_collection_modifyitems(config, items):
    """Mark what needs a broker; leave out (deselect, never skip) the broker versions a test
    is not meant for, and those this run does not use."""
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
        if label and label not in config.delay_gateway_brokers:
            drop.append(item)
            continue
        rules = [(m.args, m.kwargs.get("when", {})) for m in item.iter_markers("brokers")]
        if label and any(label not in labels and all(item.callspec.params.get(k) == v for k, v in when.items())
                         for labels, when in rules):
            drop.append(item)
            continue
        keep.append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
    # The longest files first: the workers (one file each at a time) then end together, not
    # with one of them running a long file alone (2 minutes less of a 20-minute run).
    items[:] = sorted(keep, key=lambda item: LONGEST_FIRST.get(_file_of(item), len(LONGEST_FIRST)))


# The files that take longest (seconds in a full run on 2 cores with 4 workers, 2026-11-28,
# `--durations=0` summed per file; test_bench and faults/test_refusals with the tests added
# since), in that order; the others after them.
LONGEST_FIRST = {name: rank for rank, name in enumerate([
    "faults/test_cluster.py",  # 352
    "faults/test_broker.py",  # 327
    "test_pending.py",  # 284
    "test_cancel_rules.py",  # 246
    "test_bench.py",  # 246
    "faults/test_security.py",  # 220
    "faults/test_cancel_crash.py",  # 216
    "test_delivery_e2e.py",  # 197
    "faults/test_refusals.py",  # 189
    "faults/test_move_from_plugin.py",  # 188
    "spark/test_schedule.py",  # 165
    "test_move_e2e.py",  # 150 (2026-11-29: three tests of about 50 s)
    "test_live_change.py",  # 150
    "test_vhosts.py",  # 141
    "test_upgrade_release.py",  # 138
    "test_list_after_crash.py",  # 136
    "test_cancel_e2e.py",  # 132
    "test_status.py",  # 115
    "faults/test_rule_edges.py",  # 108
    "faults/test_retry_faults.py",  # 84
    "test_retry_e2e.py",  # 81
    "spark/test_report.py",  # 80
    "test_shorter_path_e2e.py",  # 77
    "faults/test_kill9.py",  # 77
    "k8s/test_upgrade.py",  # 73
    "k8s/test_image.py",  # 70
    "faults/test_consumer_timeout.py",  # 57
    "test_catch_up_e2e.py",  # 55 (2026-11-29)
    "test_broker_alert.py",  # 50 (added since)
    "spark/test_units.py",  # 52
    "test_broker_versions.py",  # 51
    "test_cli_errors.py",  # 47
    "faults/test_parked.py",  # 42
    "faults/test_clock_behind.py",  # 40
    "faults/test_outage_gate.py",  # 36
    "test_management_check.py",  # 36 (added since)
    "test_rule_withdrawal.py",  # 35
    "spark/test_pending_export.py",  # 35
    "faults/test_stamp_notice.py",  # 35
])}


def _file_of(item) -> str:
    path = str(item.fspath)
    return path[path.rindex("/tests/") + len("/tests/"):] if "/tests/" in path else path


def checked_runtime(label: str) -> Runtime:
    """The runtime of a broker label: for 4.x its cached root, or a failure that says how to
    get it (never a skip)."""
    try:
        runtime = runtime_for(label)
        runtime.check()
    except NodeError as exc:
        pytest.fail(str(exc), pytrace=False)
    return runtime


@pytest.fixture(scope="session")
def private_broker() -> Callable[[str], Node]:
    """`private_broker("rmq4.3")`: this session's private node of that version for the
    end-to-end tests, stamping arrival times; started on first use, removed at the end."""
    started: Dict[str, Cluster] = {}

    def node(label: str) -> Node:
        if label not in started:
            runtime = checked_runtime(label)
            cluster = Cluster(unique_names(1, "e2e" + label[3:].replace(".", "")), extra_config=[ARRIVAL_STAMP],
                              runtime=runtime)
            cluster.start_or_fail(f"a RabbitMQ {runtime.version} node")
            started[label] = cluster
        return started[label].nodes[0]

    yield node
    for cluster in started.values():
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
def broker(request, private_broker) -> str:
    """A reachable broker of each version in turn, or a failure that says how to get one."""
    if request.param == HOST_RUNTIME.label:
        return reachable_or_fail(main_broker_url())
    return private_broker(request.param).url


class BrokerCtl:
    """rabbitmqctl for this test's broker, for reading (list_queues) and for what AMQP
    cannot do (import_definitions): the shared node's own CLI, or the private 4.x node's."""

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

    def command(self) -> List[str]:
        """The command line that runs this broker's rabbitmqctl (for `python -m bench`)."""
        if self.node is None:
            return ["rabbitmqctl"]
        argv, _ = self.node.runtime.command([CTL, "-n", self.node.node], self.node.env())
        return argv


@pytest.fixture
def broker_ctl(broker, request, private_broker):
    label = broker_label(request.node)
    if label != HOST_RUNTIME.label:
        return BrokerCtl(private_broker(label))
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
