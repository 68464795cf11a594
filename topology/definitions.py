"""Render a topology as a RabbitMQ definitions document (`rabbitmqctl import_definitions`)."""

import json
from typing import Any, Dict

from topology.model import Topology

Json = Dict[str, Any]  # a JSON object


def definitions(topology: Topology, vhost: str = "/") -> Json:
    return {
        "exchanges": [
            {"name": e.name, "vhost": vhost, "type": e.type, "durable": True,
             "auto_delete": False, "internal": e.internal, "arguments": dict(e.arguments)}
            for e in topology.exchanges
        ],
        "queues": [
            {"name": q.name, "vhost": vhost, "durable": True, "auto_delete": False,
             "arguments": dict(q.arguments)}
            for q in topology.queues
        ],
        "bindings": [
            {"source": b.source, "vhost": vhost, "destination": b.destination,
             "destination_type": b.destination_type, "routing_key": b.routing_key,
             "arguments": {}}
            for b in topology.bindings
        ],
    }


def render(topology: Topology, vhost: str = "/") -> str:
    return json.dumps(definitions(topology, vhost), indent=2, sort_keys=True) + "\n"
