"""Every node the suite uses runs with its open-files limit raised to what the machine allows
(scripts/ensure-rabbitmq for the main node, tests/faults/nodes.py for the private ones):
RabbitMQ 3.x reserves file handles against it, and a node that has reserved them all answers
no one, not even rabbitmqctl. At 1,024, the limit `su rabbitmq` gives by default, that is
about 309 quorum queues: the seventh prefix of the default chain wedges the node."""

from .faults.nodes import open_files_of

FLOOR = 4096  # below this a node of the suite's machine could be wedged by the project's own prefixes


def test_the_broker_runs_with_the_open_files_limit_raised(broker, broker_ctl):
    pid = int(broker_ctl("eval", "os:getpid().").strip().strip('"'))
    soft, hard = open_files_of(pid)
    fix = "restart it with scripts/ensure-rabbitmq, which raises the limit (or raise the rabbitmq user's)"
    assert soft == hard, f"the node runs with an open-files limit of {soft} of {hard} allowed: {fix}"
    assert soft == "unlimited" or int(soft) >= FLOOR, f"the node's open-files limit is {soft}: {fix}"
