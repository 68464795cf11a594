"""The topology as code, in each format `delay-gateway render` writes: pure functions of a
Topology (what `declare` creates) and the command's options.

A new format is one entry in FORMATS (and a line in DESCRIPTIONS for the command's help);
tests/test_render.py proves every entry against a real broker, with one reader per format
(its READERS table) that turns the rendering back into a definitions document.
"""

from typing import Callable, Dict

from topology import definitions, operator, terraform
from topology.model import Topology

Renderer = Callable[[Topology, object], str]

FORMATS: Dict[str, Renderer] = {
    "definitions": lambda topology, options: definitions.render(topology, getattr(options, "vhost", "/")),
    "terraform": terraform.render,
    # messaging-topology-operator resources; options: cluster_name, cluster_namespace,
    # connection_secret, vhost
    "operator": operator.render,
}

# One line each for `delay-gateway render --help`.
DESCRIPTIONS: Dict[str, str] = {
    "definitions": "JSON for `rabbitmqctl import_definitions` or the management UI",
    "terraform": "a Terraform module for the cyrilgdn/rabbitmq provider (variables: vhost, and the HTTP API "
                 "for the one internal exchange)",
    "operator": "YAML for kubectl apply: messaging-topology-operator Exchange, Queue and Binding resources "
                "(the internal exchange is left to the gateway's own declare)",
}


def render(fmt: str, topology: Topology, options: object) -> str:
    return FORMATS[fmt](topology, options)
