"""Render a topology as messaging-topology-operator resources: `rabbitmq.com/v1beta1` Exchange,
Queue and Binding objects, for those who keep their RabbitMQ objects as Kubernetes objects.

The operator turns each resource into one call of RabbitMQ's HTTP API (exchange: type,
durable, auto_delete, arguments; queue: durable, auto_delete, arguments with `spec.type` as
`x-queue-type`; binding: source, destination, destination type, routing key). What that API
call creates must be exactly what `declare` creates, or the gateway's own idempotent declare
at start would fail with 406 (tests/k8s/test_operator_rendering.py proves it on a broker).

One object cannot be expressed: an *internal* exchange. The operator's Exchange resource has
no `internal` field (its HTTP client deliberately leaves the flag out), and an exchange
declared without it clashes with the gateway's declare of the internal `<prefix>.returning`.
So that exchange is left out, named in the rendering's header, and `delay-gateway run`
declares it at start; its binding is rendered and takes effect once the exchange exists.
"""

import hashlib
import re
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

from topology.model import Binding, Exchange, Queue, Topology

Json = Dict[str, Any]  # a JSON object

API_VERSION = "rabbitmq.com/v1beta1"
# Labels of the rendered objects. Chain objects carry their generation, so the objects of a
# retired chain can be found (and deleted) with one selector.
PART_OF = {"app.kubernetes.io/part-of": "delay-gateway"}
GENERATION_LABEL = "delay-gateway/generation"
# Kubernetes object names (metadata.name): a DNS-1123 subdomain of at most 253 characters.
_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
MAX_NAME = 253


@dataclass(frozen=True)
class ClusterReference:
    """Which RabbitmqCluster the objects belong to: by name (and namespace), or through a
    Secret holding the HTTP API's uri, username and password (never both: the operator's
    rule)."""

    name: Optional[str] = None
    namespace: Optional[str] = None
    connection_secret: Optional[str] = None

    def __post_init__(self) -> None:
        if bool(self.name) == bool(self.connection_secret):
            raise ValueError("the operator format needs a RabbitmqCluster: give either --cluster-name "
                             "or --connection-secret (not both)")

    def spec(self) -> Json:
        ref: Json = {}
        if self.name:
            ref["name"] = self.name
        if self.namespace:
            ref["namespace"] = self.namespace
        if self.connection_secret:
            ref["connectionSecret"] = {"name": self.connection_secret}
        return ref


def k8s_name(name: str) -> str:
    """A valid, stable Kubernetes object name for an AMQP name: the name itself when it is
    one already (the gateway's names are, for a lower-case prefix), otherwise a cleaned-up
    form with a short hash of the original, so two AMQP names never share one."""
    if len(name) <= MAX_NAME and _SUBDOMAIN.match(name):
        return name
    digest = hashlib.sha256(name.encode()).hexdigest()[:8]
    cleaned = re.sub(r"[^a-z0-9.-]+", "-", name.lower())
    cleaned = re.sub(r"\.[-.]*", ".", re.sub(r"-*\.", ".", cleaned)).strip(".-")
    cleaned = cleaned[:MAX_NAME - len(digest) - 1].rstrip(".-")
    return f"{cleaned}-{digest}" if cleaned else digest


def binding_name(b: Binding) -> str:
    return k8s_name(f"{b.source}.to.{b.destination}")


def left_out(topology: Topology) -> Tuple[Exchange, ...]:
    """What the operator cannot declare: internal exchanges (see the module's docstring)."""
    return tuple(e for e in topology.exchanges if e.internal)


def _labels(topology: Topology, name: str) -> Dict[str, str]:
    labels = dict(PART_OF)
    if topology.in_chain(name):
        labels[GENERATION_LABEL] = topology.settings.generation
    return labels


def _resource(kind: str, name: str, labels: Dict[str, str], spec: Json) -> Json:
    return {"apiVersion": API_VERSION, "kind": kind, "metadata": {"name": name, "labels": labels}, "spec": spec}


def _exchange(t: Topology, e: Exchange, common: Json) -> Json:
    spec = {"name": e.name, **common, "type": e.type, "durable": True, "autoDelete": False}
    if e.arguments:
        spec["arguments"] = dict(e.arguments)
    return _resource("Exchange", k8s_name(e.name), _labels(t, e.name), spec)


def _queue(t: Topology, q: Queue, common: Json) -> Json:
    arguments = dict(q.arguments)
    # spec.type is how the operator spells x-queue-type (its client adds the argument), and
    # its admission webhook checks that a quorum queue is durable only when it is set.
    spec = {"name": q.name, **common, "type": arguments.pop("x-queue-type"), "durable": True,
            "autoDelete": False}
    if arguments:
        spec["arguments"] = arguments
    # Deleting the resource must not delete the messages waiting in the queue: a chain
    # holds delayed messages for up to years, and a `helm upgrade` or a pruning `kubectl
    # apply` deletes the resources it no longer renders.
    spec["deletionPolicy"] = "retain"
    return _resource("Queue", k8s_name(q.name), _labels(t, q.name), spec)


def _binding(t: Topology, b: Binding, common: Json) -> Json:
    spec = {"source": b.source, "destination": b.destination, "destinationType": b.destination_type,
            "routingKey": b.routing_key, **common}
    return _resource("Binding", binding_name(b), _labels(t, b.source), spec)


def resources(topology: Topology, cluster: ClusterReference, vhost: str = "/") -> List[Json]:
    """Every object of the topology the operator can declare, as resources (plain dicts)."""
    common = {"vhost": vhost, "rabbitmqClusterReference": cluster.spec()}
    skipped = {e.name for e in left_out(topology)}
    out = [_exchange(topology, e, common) for e in topology.exchanges if e.name not in skipped]
    out += [_queue(topology, q, common) for q in topology.queues]
    out += [_binding(topology, b, common) for b in topology.bindings]
    _check_unique(out)
    return out


def _check_unique(objects: Sequence[Json]) -> None:
    seen = set()
    for o in objects:
        key = (o["kind"], o["metadata"]["name"])
        if key in seen:
            raise ValueError(f"two {key[0]} resources would be named {key[1]!r}")
        seen.add(key)


def header(topology: Topology) -> str:
    s = topology.settings
    lines = [f"messaging-topology-operator resources for prefix {s.prefix!r}: chain {s.generation}, "
             f"{s.max_level} levels.", "Rendered by `delay-gateway render --format operator`."]
    for e in left_out(topology):
        lines.append(f"Not included: the internal exchange {e.name!r}. The operator cannot declare internal "
                     "exchanges; `delay-gateway run` declares it at start.")
    return "".join(f"# {line}\n" for line in lines)


def render(topology: Topology, options: object) -> str:
    import yaml  # here, so that importing the topology needs nothing beyond the standard library

    cluster = ClusterReference(getattr(options, "cluster_name", None), getattr(options, "cluster_namespace", None),
                               getattr(options, "connection_secret", None))
    docs = resources(topology, cluster, getattr(options, "vhost", "/"))
    return header(topology) + yaml.safe_dump_all(docs, sort_keys=False, explicit_start=True, width=1000)
