"""Every node the suite uses runs with its open-files limit raised to what the machine allows
(scripts/ensure-rabbitmq for the main node, tests/faults/nodes.py for the private ones):
RabbitMQ 3.x reserves file handles against it, and a node that has reserved them all answers
no one, not even rabbitmqctl. At 1,024, the limit `su rabbitmq` gives by default, that is
about 309 quorum queues: the seventh prefix of the default chain wedges the node."""

import subprocess
import sys

from topology import ChainSettings, build
from topology.footprint import Fit, NodeHandles, over_budget, reserved_by_node

from .conftest import broker_label
from .faults.nodes import open_files_of
from .support import ROOT, broker_url, chain_args, remove, unique_prefix

FLOOR = 4096  # below this a node of the suite's machine could be wedged by the project's own prefixes


def test_the_broker_runs_with_the_open_files_limit_raised(broker, broker_ctl):
    pid = int(broker_ctl("eval", "os:getpid().").strip().strip('"'))
    soft, hard = open_files_of(pid)
    fix = "restart it with scripts/ensure-rabbitmq, which raises the limit (or raise the rabbitmq user's)"
    assert soft == hard, f"the node runs with an open-files limit of {soft} of {hard} allowed: {fix}"
    assert soft == "unlimited" or int(soft) >= FLOOR, f"the node's open-files limit is {soft}: {fix}"


def test_declare_and_status_say_what_a_prefix_reserves_where_the_broker_reserves_handles(broker, request):
    """On 3.x `declare` and `status` say how many file handles the prefix's quorum queues
    reserve (3 a queue on one node, 5 on a node of three that leads it), against what, and
    where to look; 4.x has no such bookkeeping, and the line is not printed."""
    chain = ChainSettings(prefix=unique_prefix(), max_level=4, resolution_ms=100)
    quorum = sum(1 for q in build(chain).queues if q.arguments.get("x-queue-type") == "quorum")
    expected = [
        f"note: RabbitMQ 3.10 reserves file handles for quorum queues: this prefix's {quorum} reserve {3 * quorum} on "
        f"one node, up to {5 * quorum} on a node of three that leads them all, against its open-files limit less 97; "
        "a node whose reservations fill it stops answering. Compare with `rabbitmqctl status`, File Descriptors, "
        "or give --management-url to have them checked (docs/operating.md: What a prefix costs the broker)"
    ] if broker_label(request.node) == "rmq3.10" else []
    try:
        for verb in ("declare", "status"):
            r = subprocess.run([sys.executable, "-m", "gateway", verb, *chain_args(chain), "--url", broker_url()],
                               cwd=ROOT, capture_output=True, text=True, timeout=60)
            assert r.returncode == 0, (verb, r.stderr)
            assert [line for line in r.stdout.splitlines() if "reserves file handles" in line] == expected, r.stdout
    finally:
        remove(chain)


def test_what_quorum_queues_reserve_on_each_node_and_whether_a_prefix_fits():
    """Pure: 2 plus the members on a queue's leader, 2 on each other member; a prefix fits
    when every node, as if it led all its new queues, keeps a tenth of its budget."""
    a, b, c = "rabbit@a", "rabbit@b", "rabbit@c"
    assert reserved_by_node([(a, [a, b, c]), (b, [a, b, c]), (a, [a])]) == {a: 5 + 2 + 3, b: 2 + 5, c: 2 + 2}
    assert reserved_by_node([(a, [])]) == {a: 3}  # members unknown: the leader alone
    nodes = (NodeHandles(a, 1024, 700), NodeHandles(b, 1024, 100), NodeHandles(c, 1024, 100))
    assert [n.budget for n in nodes] == [927] * 3
    fit = Fit(10, nodes)  # 10 queues led by a: 700 + 50 = 750 <= 834
    assert fit.fits and not fit.refused and fit.tightest.name == a
    assert fit.said() == ("with this prefix's 10 new quorum queues, rabbit@a would reserve 750 of its 927 file handles "
                          "(81 %; open-files limit 1024 less 97), counted as if it led them all")
    assert Fit(26, nodes).fits and not Fit(27, nodes).fits and Fit(27, nodes).refused  # 835 > 834.3
    full = Fit(0, (NodeHandles(a, 1024, 900),))
    assert not full.fits and not full.refused  # declaring again adds nothing: never refused
    assert full.said() == "rabbit@a reserves 900 of its 927 file handles (97 %; open-files limit 1024 less 97)"
    assert over_budget(full).startswith(full.said() + ", more than 90 %; a RabbitMQ 3.x node")
