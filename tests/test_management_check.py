"""`declare --management-url` on a node of each suite broker with the management plugin: on
RabbitMQ 3.x it refuses, before declaring anything, a prefix whose quorum queues would fill a
node's file-handle budget (the node would then answer no one); `status` shows each node's
reservations, the same as the node's own bookkeeping; 4.x keeps none and nothing is said.
Users it cannot trust (a wrong password, no monitoring tag) and a management API that does not
answer are refused in one line. About 30 s."""

import re
import subprocess
import sys
from typing import Dict, Tuple

import pika
import pytest

from topology import ChainSettings, build
from topology.footprint import quorum_queues

from .conftest import broker_label, checked_runtime
from .faults.nodes import Cluster, Node, free_port, unique_names
from .launcher import chain_args
from .support import ROOT

# A 3.x node of this open-files limit has 303 handles to reserve: one prefix of the default
# chain (48 quorum queues, 3 each) fits, with the second the node would have reserved 288.
OPEN_FILES = 400


def gateway(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gateway", *argv], cwd=ROOT, capture_output=True, text=True,
                          timeout=120, env={"PATH": "/usr/bin:/bin"})


def queues_of(node, prefix: str) -> list:
    out = node.ctl("list_queues", "name", "--quiet", "--no-table-headers").stdout.split()
    return [name for name in out if name.startswith(prefix + ".")]


def reserved_by_the_node(node) -> tuple:
    """(reserved, limit): what `rabbitmqctl status` says under File Descriptors (3.x)."""
    total, limit = re.search(r"Total: (\d+), limit: (\d+)", node.ctl("status").stdout).groups()
    return int(total), int(limit)


@pytest.fixture(scope="module")
def managed_nodes():
    """`managed_nodes(label)`: this module's node of that broker, started on first use."""
    started: Dict[str, Tuple[Cluster, str]] = {}

    def node(label: str) -> Tuple[Node, str]:
        if label not in started:
            cluster = Cluster(unique_names(1, "mgmt"), ports=["management.tcp.port"], runtime=checked_runtime(label),
                              plugins=["rabbitmq_management"], open_files=OPEN_FILES)
            cluster.start_or_fail(f"a RabbitMQ node with the management plugin ({label})")
            started[label] = cluster, f"http://127.0.0.1:{cluster.nodes[0].ports['management.tcp.port']}"
        cluster, management = started[label]
        return cluster.nodes[0], management

    yield node
    for cluster, _ in started.values():
        cluster.close()


@pytest.fixture
def managed_node(broker, request, managed_nodes):
    label = broker_label(request.node)
    return (label, *managed_nodes(label))


def test_declare_refuses_a_prefix_that_would_fill_a_nodes_file_handles(managed_node):
    label, node, management = managed_node
    first, second = ChainSettings(prefix="first"), ChainSettings(prefix="second")
    quorum = quorum_queues(build(first))
    url = ["--url", node.url, "--management-url", management]

    ok = gateway("declare", *chain_args(first), *url)
    assert ok.returncode == 0, ok.stderr
    said = [line for line in ok.stdout.splitlines() if "file handles" in line]
    refused = gateway("declare", *chain_args(second), *url)
    again = gateway("declare", *chain_args(first), *url)
    status = gateway("status", *chain_args(first), *url, "--no-index")
    assert again.returncode == 0 and status.returncode == 0, again.stderr + status.stderr

    if label == "rmq4.3":  # no bookkeeping, nothing to check or say
        assert refused.returncode == 0, refused.stderr
        assert said == [] and "file handles" not in status.stdout
        assert len(queues_of(node, "second")) == len(build(second).queues)
        return
    # what the gateway counts is what the node counts (its own handful besides)
    total, budget = reserved_by_the_node(node)
    [line] = said
    reserved = int(re.search(r"reserves (\d+) of its (\d+) file handles", line).group(1))
    assert line == (f"note: file handles, by the management API: {node.node} reserves {reserved} of its {budget} "
                    f"file handles ({100 * reserved / budget:.0f} %; open-files limit {OPEN_FILES} less 97)")
    assert reserved == 3 * quorum and budget == OPEN_FILES - 97 and 0 <= total - reserved <= 5, (total, line)
    # the second prefix is refused in one line, with nothing declared, and the node still answers
    assert refused.returncode == 3, refused.stdout + refused.stderr
    assert refused.stderr.strip().splitlines() == [
        f"delay-gateway declare: refused: with this prefix's {quorum} new quorum queues, {node.node} would reserve "
        f"{2 * reserved} of its {budget} file handles ({100 * 2 * reserved / budget:.0f} %; open-files limit "
        f"{OPEN_FILES} less 97), more than 90 %; a RabbitMQ 3.x node whose reservations fill its budget stops "
        "answering everyone. Raise the node's open-files limit (LimitNOFILE, ulimit -n) and restart it, or delete "
        "prefixes you do not use (docs/operating.md: What a prefix costs the broker); without --management-url, "
        "declare does not check"]
    assert queues_of(node, "second") == [] and refused.stdout == ""
    with pika.BlockingConnection(pika.URLParameters(node.url)) as connection:
        connection.channel().queue_declare(first.names.check_in, passive=True)
    # declaring a prefix again adds nothing, and is never refused; status says the same, give or
    # take the connections open as the node counted (each reserves a handle)
    for out in (again, status):
        [again_line] = [line for line in out.stdout.splitlines() if "file handles" in line]
        counted = int(re.search(r"reserves (\d+) of", again_line).group(1))
        assert 0 <= counted - reserved <= 3 and again_line.replace(f" {counted} of", f" {reserved} of", 1).split(
            " (")[0] == line.split(" (")[0], (again_line, line)


def test_users_the_check_cannot_trust_and_an_api_that_does_not_answer(managed_node):
    """Each refused in one line before anything is declared (on 4.x the check is not made,
    so only a bad URL is refused there)."""
    label, node, management = managed_node
    node.ctl("add_user", "publisher", "secret")
    node.ctl("set_permissions", "publisher", ".*", ".*", ".*")
    node.ctl("set_user_tags", "publisher", "management")  # sees only its own virtual hosts
    chain = ChainSettings(prefix="checked", max_level=4)
    publisher_url = node.url.replace("guest:guest", "publisher:secret")
    cases = {
        "not http": (["--url", node.url, "--management-url", "amqp://127.0.0.1"], 2,
                     "argument --management-url: 'amqp://127.0.0.1' is not an http:// or https:// URL with a host "
                     "(http://HOST:15672)"),
        "wrong password": (["--url", node.url, "--management-url", management.replace("//", "//guest:nope@")], 3,
                           f"the management API at {management} refused user 'guest' (401): check the user and "
                           "password (in --management-url, else the AMQP URL's)"),
        "no monitoring tag": (["--url", publisher_url, "--management-url", management], 3,
                              "the management user 'publisher' sees only its own virtual hosts' queues, so the file "
                              "handles of the others would go uncounted: give it the monitoring tag (rabbitmqctl "
                              "set_user_tags), or name a user that has it in --management-url"),
        "nothing there": (["--url", node.url, "--management-url", f"http://127.0.0.1:{free_port()}"], 1,
                          "did not answer ([Errno 111] Connection refused): check --management-url, and that the "
                          "node runs the management plugin"),
    }
    for case, (argv, code, says) in cases.items():
        r = gateway("declare", *chain_args(chain), *argv)
        if label == "rmq4.3" and code != 2:
            assert r.returncode == 0, (case, r.stderr)
            continue
        assert r.returncode == code, (case, r.stdout, r.stderr)
        [line] = r.stderr.strip().splitlines()
        assert line.startswith("delay-gateway declare: ") and line.endswith(says), (case, line)
        assert queues_of(node, "checked") == [], case
