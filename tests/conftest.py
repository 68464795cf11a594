import socket
from urllib.parse import urlsplit

import pytest

from .support import GatewayProcess, broker_url, chains


# Fixtures that talk to a broker: a test using one (directly or through another) is marked
# `broker`, so `pytest -m "not broker"` runs the pure tests in seconds with no broker at all.
BROKER_FIXTURES = {"broker", "make_chain", "run_gateway", "own_cluster", "own_node", "node_chain"}


def pytest_collection_modifyitems(items):
    for item in items:
        if BROKER_FIXTURES & set(getattr(item, "fixturenames", ())) or "/faults/" in str(item.fspath):
            item.add_marker(pytest.mark.broker)


@pytest.fixture(scope="session")
def broker() -> str:
    """A reachable broker, or a failure that says how to get one (never a skip)."""
    url = broker_url()
    parts = urlsplit(url)
    try:
        socket.create_connection((parts.hostname, parts.port or 5672), timeout=3).close()
    except OSError as exc:
        pytest.fail(f"no RabbitMQ at {parts.hostname}:{parts.port or 5672} ({exc}); "
                    "run scripts/ensure-rabbitmq or set DELAY_GATEWAY_URL", pytrace=False)
    return url


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


@pytest.fixture(autouse=True, scope="session")
def _pika_encodes_floats():
    """Test publishers send double headers as other clients do (the gateway installs this in main)."""
    from gateway import codec
    codec.install()


def pytest_terminal_summary(terminalreporter):
    from .support import FIGURES
    for section, lines in FIGURES.items():
        terminalreporter.section(section)
        for line in lines:
            terminalreporter.write_line(line)
