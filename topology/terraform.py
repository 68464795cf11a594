"""Render a topology as a Terraform module for the cyrilgdn/rabbitmq provider (pure).

The objects are data (`locals`), and one generic resource block per kind creates them with
`for_each`, keyed by the object's name: the module reads like the definitions document, and
a resource's address is its RabbitMQ name (`rabbitmq_queue.queue["delay.check-in"]`).

What the provider cannot say, and how the module says it anyway:
- Queue arguments are numbers as well as strings (x-message-ttl, x-delivery-limit): they go
  through `arguments_json`, which keeps their types; the provider's `arguments` map would
  send every value as a string, and the broker would refuse or misread them.
- An *internal* exchange (`<prefix>.returning`: clients cannot publish to it, so what
  reaches its queue is the gateway's own): the provider's exchange has no `internal`
  setting, and an exchange declared without it clashes (406) with the gateway's declare.
  The module creates it with one call of RabbitMQ's HTTP API (curl, from a `terraform_data`
  provisioner) with the management URL and credentials given as variables.
- Every resource carries `prevent_destroy`: queues hold the delayed messages, and an old
  chain's exchanges and bindings carry them down its levels until it is empty. A plan that
  would delete one (a changed chain setting renames the chain) stops instead; docs/operating.md
  (Changing the chain) says how to hand the old chain to the gateway, which removes it
  once it is empty.
"""

import json
from typing import Any, Dict, List

from topology.model import Topology

Json = Dict[str, Any]  # a JSON object

PROVIDER_VERSION = ">= 1.8.0"


def hcl_string(value: str) -> str:
    """A quoted HCL string: JSON's escapes are HCL's, and template sequences are doubled."""
    return json.dumps(value, ensure_ascii=False).replace("${", "$${").replace("%{", "%%{")


def hcl_value(value: Any, indent: int) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, str):
        return hcl_string(value)
    if isinstance(value, dict):
        if not value:
            return "{}"
        pad = "  " * (indent + 1)
        inner = "\n".join(f"{pad}{hcl_string(str(k))} = {hcl_value(v, indent + 1)}" for k, v in value.items())
        return "{\n" + inner + "\n" + "  " * indent + "}"
    raise TypeError(f"cannot write {value!r} as HCL")


def _inline(value: Json) -> str:
    """A short object on one line: { type = "topic", arguments = {} }."""
    parts = []
    for k, v in value.items():
        if isinstance(v, dict) and v:
            v_text = "{ " + ", ".join(f"{hcl_string(str(a))} = {hcl_value(b, 0)}" for a, b in v.items()) + " }"
        else:
            v_text = hcl_value(v, 0)
        parts.append(f"{k} = {v_text}")
    return "{ " + ", ".join(parts) + " }"


def binding_key(source: str, destination: str, routing_key: str) -> str:
    return f"{source} -> {destination} [{routing_key}]"


def render(topology: Topology, options: object = None) -> str:
    vhost = getattr(options, "vhost", "/") if options is not None else "/"
    return "\n".join(_preamble(topology, vhost) + _locals(topology) + RESOURCES) + "\n"


def _preamble(topology: Topology, vhost: str) -> List[str]:
    s = topology.settings
    return [
        f"# The delay gateway's topology for prefix {s.prefix!r}: chain {s.generation}, {s.max_level} levels.",
        "# Rendered by `delay-gateway render --format terraform`: the objects `delay-gateway declare` creates,",
        "# for the cyrilgdn/rabbitmq provider. Everything has prevent_destroy (the queues hold delayed messages):",
        "# after changing a chain setting, see docs/operating.md, 'Changing the chain', before applying.",
        "",
        "terraform {",
        "  required_providers {",
        "    rabbitmq = {",
        '      source  = "cyrilgdn/rabbitmq"',
        f"      version = {hcl_string(PROVIDER_VERSION)}",
        "    }",
        "  }",
        "}",
        "",
        'variable "vhost" {',
        '  description = "The virtual host of every object."',
        "  type        = string",
        f"  default     = {hcl_string(vhost)}",
        "}",
        "",
        'variable "management_url" {',
        '  description = "RabbitMQ\'s HTTP API, e.g. https://rabbit:15671, for the one object the provider cannot '
        'create: an internal exchange (created with curl)."',
        "  type        = string",
        "}",
        "",
        'variable "management_username" {',
        "  type = string",
        "}",
        "",
        'variable "management_password" {',
        "  type      = string",
        "  sensitive = true",
        "}",
        "",
    ]


def _locals(topology: Topology) -> List[str]:
    out = ["locals {", "  exchanges = {"]
    for e in topology.exchanges:
        if not e.internal:
            out.append(f"    {hcl_string(e.name)} = {_inline({'type': e.type, 'arguments': dict(e.arguments)})}")
    out += ["  }", "  # Created through the HTTP API: the provider has no `internal` setting.",
            "  internal_exchanges = {"]
    for e in topology.exchanges:
        if e.internal:
            out.append(f"    {hcl_string(e.name)} = {_inline({'type': e.type, 'arguments': dict(e.arguments)})}")
    out += ["  }", "  queues = {"]
    for q in topology.queues:
        out += [f"    {hcl_string(q.name)} = {{", f"      arguments = {hcl_value(dict(q.arguments), 3)}", "    }"]
    out += ["  }", "  bindings = {"]
    for b in topology.bindings:
        value = {"source": b.source, "destination": b.destination, "destination_type": b.destination_type,
                 "routing_key": b.routing_key}
        out.append(f"    {hcl_string(binding_key(b.source, b.destination, b.routing_key))} = {_inline(value)}")
    out += ["  }", "}", ""]
    return out


# The resources, the same for every topology (they iterate over the locals).
RESOURCES = [
        'resource "rabbitmq_exchange" "exchange" {',
    "  for_each = local.exchanges",
    "  name     = each.key",
    "  vhost    = var.vhost",
    "  settings {",
    "    type        = each.value.type",
    "    durable     = true",
    "    auto_delete = false",
    "    arguments   = each.value.arguments",
    "  }",
    "  lifecycle {",
    "    prevent_destroy = true",
    "  }",
    "}",
    "",
    'resource "terraform_data" "internal_exchange" {',
    "  for_each = local.internal_exchanges",
    "  input    = { vhost = var.vhost, name = each.key, settings = each.value }",
    '  provisioner "local-exec" {',
    '    command = "curl --fail --silent --show-error --user \\"$RABBITMQ_USER:$RABBITMQ_PASSWORD\\" '
    '--request PUT --header content-type:application/json --data \\"$BODY\\" \\"$URL\\""',
    "    environment = {",
    '      URL               = "${trimsuffix(var.management_url, "/")}/api/exchanges/'
    '${urlencode(var.vhost)}/${urlencode(each.key)}"',
    "      BODY              = jsonencode({ type = each.value.type, durable = true, auto_delete = false, "
    "internal = true, arguments = each.value.arguments })",
    "      RABBITMQ_USER     = var.management_username",
    "      RABBITMQ_PASSWORD = var.management_password",
    "    }",
    "  }",
    "}",
    "",
    'resource "rabbitmq_queue" "queue" {',
    "  for_each = local.queues",
    "  name     = each.key",
    "  vhost    = var.vhost",
    "  settings {",
    "    durable        = true",
    "    auto_delete    = false",
    "    arguments_json = jsonencode(each.value.arguments)",
    "  }",
    "  lifecycle {",
    "    prevent_destroy = true",
    "  }",
    "}",
    "",
    'resource "rabbitmq_binding" "binding" {',
    "  for_each         = local.bindings",
    "  vhost            = var.vhost",
    "  source           = each.value.source",
    "  destination      = each.value.destination",
    "  destination_type = each.value.destination_type",
    "  routing_key      = each.value.routing_key",
    "  depends_on       = [rabbitmq_exchange.exchange, terraform_data.internal_exchange, rabbitmq_queue.queue]",
    "  lifecycle {",
    "    prevent_destroy = true",
    "  }",
    "}",
]
