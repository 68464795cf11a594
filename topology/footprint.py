"""What a chain costs the broker by the broker's own bookkeeping (pure): RabbitMQ 3.x reserves
file handles for each quorum queue (2 plus the cluster size on the node that leads it, 2 on
each other), against the node's open-files limit less 97, and a node whose reservations fill
it answers no one. 4.x keeps no such account. `declare` and `status` say it on 3.x
(docs/operating.md: What a prefix costs the broker; measured by `python -m bench footprint`)."""

from typing import Optional, Tuple

from topology.model import Topology


def quorum_queues(topology: Topology) -> int:
    return sum(1 for q in topology.queues if q.arguments.get("x-queue-type") == "quorum")


def reserved_handles(topology: Topology, version: Optional[Tuple[int, int]]) -> Optional[str]:
    """What the topology's quorum queues reserve, where the broker `version` reserves (3.x),
    with what to compare it to: AMQP shows neither the limit nor what is reserved. None on
    4.x, or when the version is not known."""
    if version is None or version[0] != 3:
        return None
    quorum = quorum_queues(topology)
    return (f"RabbitMQ {version[0]}.{version[1]} reserves file handles for quorum queues: this prefix's {quorum} "
            f"reserve {3 * quorum} on one node, up to {5 * quorum} on a node of three that leads them all, "
            "against its open-files limit less 97; a node whose reservations fill it stops answering. Compare "
            "with `rabbitmqctl status`, File Descriptors (docs/operating.md: What a prefix costs the broker)")
