"""`delay-gateway render`: every format describes exactly what `declare` creates.

One parametrized test covers every entry of topology.render.FORMATS. A format joins it by
adding a reader to READERS (its rendering back as a definitions document, the reference
format, plus the names of objects the format cannot express) and, if `render` needs
options for it, an entry in OPTIONS. A format without a reader fails the test.
"""

import json
from types import SimpleNamespace
from typing import Callable, Dict, Set, Tuple

import hcl2
import pika
import pytest
from hcl2.utils import SerializationOptions

from topology import ChainSettings, build
from topology.broker.declare import declare
from topology.definitions import definitions
from topology.render import DESCRIPTIONS, FORMATS, render
from topology.terraform import hcl_string

from .support import connect, remove, unique_prefix

Reader = Callable[[str], Tuple[dict, Set[str]]]


def _unescape(value):
    """python-hcl2 leaves HCL's template escapes ($${, %%{) in strings."""
    if isinstance(value, str):
        return value.replace("$${", "${").replace("%%{", "%{")
    if isinstance(value, dict):
        return {_unescape(k): _unescape(v) for k, v in value.items()}
    return value


# What the module's generic resource blocks must say for the locals to mean what the
# definitions document says: any other wiring would create something else.
TERRAFORM_RESOURCES = {
    ("rabbitmq_exchange", "exchange"): {
        "for_each": "${local.exchanges}", "name": "${each.key}", "vhost": "${var.vhost}",
        "settings": [{"type": "${each.value.type}", "durable": True, "auto_delete": False,
                      "arguments": "${each.value.arguments}"}],
        "lifecycle": [{"prevent_destroy": True}]},
    ("rabbitmq_queue", "queue"): {
        "for_each": "${local.queues}", "name": "${each.key}", "vhost": "${var.vhost}",
        "settings": [{"durable": True, "auto_delete": False, "arguments_json": "${jsonencode(each.value.arguments)}"}],
        "lifecycle": [{"prevent_destroy": True}]},
    ("rabbitmq_binding", "binding"): {
        "for_each": "${local.bindings}", "vhost": "${var.vhost}", "source": "${each.value.source}",
        "destination": "${each.value.destination}", "destination_type": "${each.value.destination_type}",
        "routing_key": "${each.value.routing_key}",
        "depends_on": ["${rabbitmq_exchange.exchange}", "${terraform_data.internal_exchange}",
                       "${rabbitmq_queue.queue}"],
        "lifecycle": [{"prevent_destroy": True}]},
}


def read_terraform(text: str) -> Tuple[dict, Set[str]]:
    doc = hcl2.loads(text, serialization_options=SerializationOptions(
        strip_string_quotes=True, explicit_blocks=False, with_comments=False))
    providers = doc["terraform"][0]["required_providers"][0]
    assert providers["rabbitmq"]["source"] == "cyrilgdn/rabbitmq"
    variables = {name: body for v in doc["variable"] for name, body in v.items()}
    assert set(variables) == {"vhost", "management_url", "management_username", "management_password"}
    assert variables["management_password"]["sensitive"] is True
    vhost = variables["vhost"]["default"]
    resources = {(kind, name): body for r in doc["resource"] for kind, named in r.items()
                 for name, body in named.items()}
    internal = resources.pop(("terraform_data", "internal_exchange"))
    assert resources == TERRAFORM_RESOURCES
    command = internal["provisioner"][0]["local-exec"]
    assert internal["for_each"] == "${local.internal_exchanges}"
    assert command["environment"]["BODY"] == ("${jsonencode({type = each.value.type, durable = true, "
                                              "auto_delete = false, internal = true, arguments = "
                                              "each.value.arguments})}")
    assert command["environment"]["URL"].endswith("/api/exchanges/${urlencode(var.vhost)}/${urlencode(each.key)}")
    local = _unescape({k: v for block in doc["locals"] for k, v in block.items()})
    exchanges = [{"name": n, "vhost": vhost, "type": e["type"], "durable": True, "auto_delete": False,
                  "internal": internal_flag, "arguments": e["arguments"]}
                 for key, internal_flag in (("exchanges", False), ("internal_exchanges", True))
                 for n, e in local[key].items()]
    queues = [{"name": n, "vhost": vhost, "durable": True, "auto_delete": False, "arguments": q["arguments"]}
              for n, q in local["queues"].items()]
    bindings = [{"source": b["source"], "vhost": vhost, "destination": b["destination"],
                 "destination_type": b["destination_type"], "routing_key": b["routing_key"], "arguments": {}}
                for b in local["bindings"].values()]
    return {"exchanges": exchanges, "queues": queues, "bindings": bindings}, set()


def read_operator(text: str) -> Tuple[dict, Set[str]]:
    """The operator's resources as the RabbitMQ objects it asks for (tests/k8s has how it
    translates each), and the internal exchanges the header says it leaves to the gateway."""
    import re

    import yaml

    from .k8s.test_operator_rendering import as_definitions
    left_out = set(re.findall(r"^# Not included: the internal exchange '([^']+)'", text, re.M))
    return as_definitions([d for d in yaml.safe_load_all(text) if d]), left_out


READERS: Dict[str, Reader] = {
    "definitions": lambda text: (json.loads(text), set()),
    "terraform": read_terraform,
    "operator": read_operator,
}
# Options `render` needs for a format, beyond the vhost.
OPTIONS: Dict[str, dict] = {"operator": dict(cluster_name="rabbitmq", cluster_namespace=None, connection_secret=None)}


def canonical(doc: dict, left_out: Set[str] = frozenset()) -> dict:
    def key(o):
        return json.dumps(o, sort_keys=True)

    return {kind: sorted((o for o in doc[kind] if kind != "exchanges" or o["name"] not in left_out), key=key)
            for kind in ("exchanges", "queues", "bindings")}


VARIANTS = [dict(queue_type="quorum", zero_bits="queue"), dict(queue_type="classic", zero_bits="exchange")]


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: f"{v['queue_type']}-{v['zero_bits']}")
@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_each_rendering_describes_exactly_what_declare_creates(broker, fmt, variant):
    """Read the rendering back (a real parser for each format) into a definitions document,
    the reference format; it must equal what declare declares, and on a broker where
    `declare` made the topology every rendered object exists with exactly the rendered
    settings: declaring it again with them is accepted (RabbitMQ answers 406 to any other
    type, flag or argument, which is how AMQP lets one read them back)."""
    assert fmt in READERS, f"add a reader for the {fmt!r} format to READERS in {__file__}"
    chain = ChainSettings(prefix=unique_prefix(), max_level=3, resolution_ms=100, **variant)
    topology = build(chain)
    text = render(fmt, topology, SimpleNamespace(vhost="/", **OPTIONS.get(fmt, {})))
    doc, left_out = READERS[fmt](text)
    assert canonical(doc) == canonical(definitions(topology), left_out)
    try:
        with connect() as c:
            declare(c.channel(), topology)
            ch = c.channel()
            for e in doc["exchanges"]:
                ch.exchange_declare(e["name"], passive=True)  # exists (404 otherwise)
                ch.exchange_declare(e["name"], e["type"], durable=e["durable"], auto_delete=e["auto_delete"],
                                    internal=e["internal"], arguments=e["arguments"])
            for q in doc["queues"]:
                ch.queue_declare(q["name"], passive=True)
                ch.queue_declare(q["name"], durable=q["durable"], auto_delete=q["auto_delete"],
                                 arguments=q["arguments"])
            for b in doc["bindings"]:  # bindings cannot be read back over AMQP; binding again must work
                (ch.queue_bind if b["destination_type"] == "queue" else ch.exchange_bind)(
                    b["destination"], b["source"], routing_key=b["routing_key"])
    finally:
        remove(chain)


def test_every_format_is_described_in_the_help():
    assert set(DESCRIPTIONS) >= set(FORMATS) - {"operator"}  # the k8s format describes itself in cli.py


@pytest.mark.parametrize("tricky", ['q"uote\\back', "dollar ${x} and %{y}", "ünïcödé", "new\nline\ttab", "#*.1.#"])
def test_hcl_strings_read_back_as_written(tricky):
    doc = hcl2.loads(f"locals {{\n  a = {hcl_string(tricky)}\n}}\n", serialization_options=SerializationOptions(
        strip_string_quotes=True, explicit_blocks=False, with_comments=False))
    assert _unescape(doc["locals"][0]["a"]) == tricky


def test_a_declared_argument_of_another_type_is_refused_so_the_broker_check_can_fail(broker):
    """The broker check above relies on a 406 for any difference: one with a TTL as text."""
    chain = ChainSettings(prefix=unique_prefix(), max_level=1, resolution_ms=100)
    q = build(chain).queue(chain.names.delay_queue(0))
    try:
        with connect() as c:
            declare(c.channel(), build(chain))
            with pytest.raises(pika.exceptions.ChannelClosedByBroker) as refused:
                c.channel().queue_declare(q.name, durable=True, arguments={**q.arguments, "x-message-ttl": "100"})
            assert refused.value.reply_code == 406
    finally:
        remove(chain)


def test_a_gateway_runs_with_no_declare_on_the_topology_a_rendering_applied(broker, broker_ctl):
    """What `render` prints is all a gateway needs: the definitions imported with the broker's
    own CLI, `run --no-declare` consumes, delivers and cancels (the cancel objects included)."""
    from .support import GatewayProcess, Receiver, publish_sentinel
    chain = ChainSettings(prefix=unique_prefix(), max_level=3, resolution_ms=100)
    text = render("definitions", build(chain), SimpleNamespace(vhost="/"))
    broker_ctl("import_definitions", broker_ctl.file(text, ".json"))
    gateway = None
    try:
        gateway = GatewayProcess(chain, "--no-declare").wait_ready()
        receiver = Receiver(chain)
        with connect() as c:
            ch = c.channel()
            ch.confirm_delivery()
            for mid in ("kept", "cancelled"):
                ch.basic_publish(chain.names.check_in, "k", b"", pika.BasicProperties(
                    message_id=mid, headers={"x-delay": 1500}), mandatory=True)
            ch.basic_publish(chain.names.cancel, "", b"", pika.BasicProperties(message_id="cancelled"),
                             mandatory=True)
        publish_sentinel(chain, 1500)  # once it came, the cancelled one cannot come any more
        receiver.until_sentinel(10)
        assert [m.properties.message_id for m in receiver.messages] == ["kept"]
        assert gateway.events("topology_found") and not gateway.errors()
    finally:
        if gateway is not None:
            gateway.terminate()
        remove(chain)
