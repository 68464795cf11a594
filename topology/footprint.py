"""What a chain costs the broker by the broker's own bookkeeping (pure): RabbitMQ 3.x reserves
file handles for each quorum queue (2 plus the cluster size on the node that leads it, 2 on
each other), against the node's open-files limit less 97, and a node whose reservations fill
it answers no one. 4.x keeps no such account. `declare` and `status` say it on 3.x
(docs/operating.md: What a prefix costs the broker; measured by `python -m bench footprint`)."""

from dataclasses import dataclass
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

from topology.model import Topology


def quorum_names(topology: Topology) -> List[str]:
    """The names of the topology's quorum queues: what 3.x reserves file handles for."""
    return [q.name for q in topology.queues if q.arguments.get("x-queue-type") == "quorum"]


def quorum_queues(topology: Topology) -> int:
    return len(quorum_names(topology))


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
            "with `rabbitmqctl status`, File Descriptors, or give --management-url to have them checked "
            "(docs/operating.md: What a prefix costs the broker)")


# -- checked against the nodes, where the management API shows them (`declare`, `status`) ----
KEPT_BACK = 97  # of its open-files limit, what a 3.x node keeps for itself (measured: 503 of 600)
ROOM_KEPT = 0.10  # `declare` leaves this share of a node's budget for connections and other queues


@dataclass(frozen=True)
class NodeHandles:
    """One node as the management API shows it: its open-files limit, and what its quorum
    queues and sockets reserve now."""

    name: str
    limit: int
    reserved: int

    @property
    def budget(self) -> int:
        return max(self.limit - KEPT_BACK, 0)


def reserved_by_node(quorum: Iterable[Tuple[str, Sequence[str]]]) -> Dict[str, int]:
    """What quorum queues, each (leader, members), reserve on each node: 2 plus the number
    of members on the leader, 2 on every other member."""
    reserved: Dict[str, int] = {}
    for leader, members in quorum:
        group = set(members) | {leader}
        for node in group:
            reserved[node] = reserved.get(node, 0) + (2 + len(group) if node == leader else 2)
    return reserved


@dataclass(frozen=True)
class Fit:
    """Whether `new` quorum queues fit every node, each checked as if it led them all (a
    3.x queue's leader is the node of the client that declares it, by default)."""

    new: int
    nodes: Tuple[NodeHandles, ...]

    def after(self, node: NodeHandles) -> int:
        return node.reserved + self.new * (2 + len(self.nodes))

    @property
    def tightest(self) -> NodeHandles:
        return max(self.nodes, key=lambda n: self.after(n) / max(n.budget, 1))

    @property
    def fits(self) -> bool:
        return all(self.after(n) <= (1 - ROOM_KEPT) * n.budget for n in self.nodes)

    @property
    def refused(self) -> bool:
        """`declare` refuses only what adds quorum queues: declaring a prefix again adds none."""
        return self.new > 0 and not self.fits

    def said(self) -> str:
        n = self.tightest
        after = self.after(n)
        of = (f"{after} of its {n.budget} file handles ({100 * after / max(n.budget, 1):.0f} %; open-files limit "
              f"{n.limit} less {KEPT_BACK})")
        if not self.new:
            return f"{n.name} reserves {of}"
        return (f"with this prefix's {self.new} new quorum queues, {n.name} would reserve {of}"
                + ("" if len(self.nodes) == 1 else ", counted as if it led them all"))


def over_budget(fit: Fit) -> str:
    """What a node near its budget risks, and the fix (`declare` refuses, `status` warns)."""
    return (f"{fit.said()}, more than {100 * (1 - ROOM_KEPT):.0f} %; a RabbitMQ 3.x node whose reservations fill "
            "its budget stops answering everyone. Raise the node's open-files limit (LimitNOFILE, ulimit -n) and "
            "restart it, or delete prefixes you do not use (docs/operating.md: What a prefix costs the broker)")
