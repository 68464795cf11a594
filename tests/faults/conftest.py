"""Fixtures for the fault tests: private broker nodes, chains on them, and a figures report.

Every fault test reports its figures (sent, faults, lost, early, duplicates) through
`fault_report`; they are printed in pytest's terminal summary whether or not -s is given
(tests/conftest.py), and are in the test's properties (JUnit XML).
"""

import os
import shutil
import tempfile

import pytest

from ..conftest import broker_label, checked_runtime
from ..support import chains, report_figures
from .load import Figures
from .nodes import BROKER_LABELS, Cluster, unique_names


@pytest.fixture
def fault_report(request):
    label = broker_label(request.node)

    def report(figures: Figures) -> Figures:
        line = figures.line() + (f" broker={label}" if label else "")
        report_figures("fault figures", line)
        return figures
    return report


@pytest.fixture(scope="session")
def tls_files():
    """A CA, a server certificate for localhost and a client certificate, made by trustme."""
    import trustme
    directory = tempfile.mkdtemp(prefix="delay-gateway-tls-")
    ca = trustme.CA()
    server = ca.issue_cert("localhost", "127.0.0.1")
    client = ca.issue_cert("delay-gateway-client")
    files = {"ca": os.path.join(directory, "ca.pem"), "cert": os.path.join(directory, "server.pem"),
             "key": os.path.join(directory, "server.key"), "client": os.path.join(directory, "client.pem")}
    ca.cert_pem.write_to_path(files["ca"])
    server.cert_chain_pems[0].write_to_path(files["cert"])
    server.private_key_pem.write_to_path(files["key"])
    client.private_key_and_cert_chain_pem.write_to_path(files["client"])
    for path in files.values():
        os.chmod(path, 0o644)
    yield files
    shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture(scope="session", params=BROKER_LABELS)
def own_cluster(request, tls_files):
    """One private node (AMQP and a TLS listener) of each broker version in turn, for the
    tests that disturb a broker."""
    from .nodes import free_port
    runtime = checked_runtime(request.param)
    tls_port = free_port()
    cluster = Cluster(unique_names(1), runtime=runtime)
    # The node reads its certificates from where it runs (inside its root for 4.x).
    tls_dir = os.path.join(cluster.home, "tls")
    os.makedirs(tls_dir)
    for name in ("ca", "cert", "key"):
        shutil.copy(tls_files[name], os.path.join(tls_dir, name + ".pem"))
    inside = runtime.inside(tls_dir)
    cluster.nodes[0].extra_config += [
        f"listeners.ssl.default = 127.0.0.1:{tls_port}",
        f"ssl_options.cacertfile = {inside}/ca.pem",
        f"ssl_options.certfile = {inside}/cert.pem",
        f"ssl_options.keyfile = {inside}/key.pem",
        "ssl_options.verify = verify_peer",
        "ssl_options.fail_if_no_peer_cert = false",
    ]
    cluster.tls_port = tls_port
    cluster.start_or_fail(f"a private RabbitMQ node ({request.param})")
    yield cluster
    cluster.close()


@pytest.fixture
def own_node(own_cluster):
    """The private node, running and without alarms, whatever the test before did to it."""
    node = own_cluster.nodes[0]
    if node.process is None or node.process.poll() is not None:
        node.start()
    node.ctl("set_vm_memory_high_watermark", "0.9", check=False)
    node.tls_port = own_cluster.tls_port
    return node


@pytest.fixture
def node_chain(own_node):
    """Declare a chain with a unique prefix on the private node; delete it after."""
    with chains(own_node.url, cleanup=lambda: own_node.process is not None and own_node.process.poll() is None) as make:
        yield make
