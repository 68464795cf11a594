"""The topology as code, in each format `delay-gateway render` writes: pure functions of a
Topology (what `declare` creates) and the command's options."""

from typing import Callable, Dict

from . import definitions, operator
from .model import Topology

Renderer = Callable[[Topology, object], str]

FORMATS: Dict[str, Renderer] = {
    "definitions": lambda topology, options: definitions.render(topology, getattr(options, "vhost", "/")),
    # messaging-topology-operator resources; options: cluster_name, cluster_namespace,
    # connection_secret, vhost
    "operator": operator.render,
}


def render(fmt: str, topology: Topology, options: object) -> str:
    return FORMATS[fmt](topology, options)
