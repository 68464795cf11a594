"""`render --format operator`: messaging-topology-operator resources that describe exactly what
`declare` creates.

The operator turns each resource into one HTTP API call (messaging-topology-operator,
internal/exchange_settings.go, queue_settings.go, binding.go): `as_definitions` below is that
translation, written as a definitions document so it compares with the `definitions`
rendering, the reference. On the broker the same calls are made over AMQP (the HTTP API's
PUT declares through the same broker functions), then `declare` runs over them: any argument
that differs would be a 406. About 10 s in all (rabbitmqctl reads the broker back).
"""

import argparse
import json
import re
import subprocess

import pika
import pytest
import yaml
from hypothesis import given, settings, strategies as st

from topology import ChainSettings, build
from topology.definitions import definitions
from topology.broker.declare import declare
from topology.operator import ClusterReference, k8s_name, left_out, resources
from topology.render import render

from ..support import chain_args, connect, examples, remove, unique_prefix
from ..test_cli import cli
from .manifests import check_operator_resource

SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
COMBOS = [(q, z) for q in ("quorum", "classic") for z in ("queue", "exchange")]


def as_definitions(docs, vhost_default: str = "/") -> dict:
    """What the operator asks RabbitMQ for, resource by resource, as a definitions document."""
    out = {"exchanges": [], "queues": [], "bindings": []}
    for d in docs:
        spec, kind = d["spec"], d["kind"]
        vhost = spec.get("vhost", vhost_default)
        if kind == "Exchange":  # rabbit-hole's ExchangeSettings has no `internal`
            out["exchanges"].append({"name": spec["name"], "vhost": vhost, "type": spec.get("type", "direct"),
                                     "durable": spec.get("durable", False),
                                     "auto_delete": spec.get("autoDelete", False),
                                     "internal": False, "arguments": spec.get("arguments", {})})
        elif kind == "Queue":  # DeclareQueue adds x-queue-type from spec.type
            arguments = dict(spec.get("arguments", {}))
            if spec.get("type"):
                arguments["x-queue-type"] = spec["type"]
            out["queues"].append({"name": spec["name"], "vhost": vhost, "durable": spec.get("durable", True),
                                  "auto_delete": spec.get("autoDelete", False), "arguments": arguments})
        elif kind == "Binding":
            out["bindings"].append({"source": spec["source"], "vhost": vhost, "destination": spec["destination"],
                                    "destination_type": spec["destinationType"],
                                    "routing_key": spec.get("routingKey", ""), "arguments": spec.get("arguments", {})})
        else:
            raise AssertionError(f"unexpected kind {kind}")
    return out


def apply_like_the_operator(connection, doc: dict) -> list:
    """The operator's API calls, made over AMQP with exactly its settings. A binding whose
    exchange does not exist yet fails (404) and is returned: the operator retries those."""
    channel = connection.channel()
    for e in doc["exchanges"]:
        channel.exchange_declare(e["name"], e["type"], durable=e["durable"], auto_delete=e["auto_delete"],
                                 internal=e["internal"], arguments=e["arguments"])
    for q in doc["queues"]:
        channel.queue_declare(q["name"], durable=q["durable"], auto_delete=q["auto_delete"],
                              arguments=q["arguments"])
    pending = []
    for b in doc["bindings"]:
        try:
            if b["destination_type"] == "queue":
                channel.queue_bind(b["destination"], b["source"], b["routing_key"])
            else:
                channel.exchange_bind(b["destination"], b["source"], b["routing_key"])
        except pika.exceptions.ChannelClosedByBroker as exc:
            assert exc.reply_code == 404, exc
            pending.append(b)
            channel = connection.channel()
    return pending


def sort(doc: dict) -> dict:
    key = lambda o: json.dumps(o, sort_keys=True)  # noqa: E731
    return {kind: sorted(doc[kind], key=key) for kind in ("exchanges", "queues", "bindings")}


def without(doc: dict, exchanges) -> dict:
    names = {e.name for e in exchanges}
    return {**doc, "exchanges": [e for e in doc["exchanges"] if e["name"] not in names]}


def _listed(what: str, *columns: str) -> list:
    out = subprocess.run(["rabbitmqctl", "-q", f"list_{what}", "-p", "/", *columns, "--formatter", "json"],
                         check=True, capture_output=True, text=True, timeout=60).stdout
    rows = json.loads(out)
    for row in rows:  # [[name, type, value], ...]: argument types depend on the client, values do not
        row["arguments"] = {name: value for name, _, value in row["arguments"]}
    return rows


def on_broker(*prefixes: str) -> dict:
    """What the broker holds under each prefix, read back with rabbitmqctl (its definitions
    export leaves internal exchanges out, so the list commands are used)."""
    exchanges = _listed("exchanges", "name", "type", "durable", "auto_delete", "internal", "arguments")
    queues = _listed("queues", "name", "durable", "auto_delete", "arguments")
    bindings = _listed("bindings", "source_name", "destination_name", "destination_kind", "routing_key",
                       "arguments")
    out = {}
    for prefix in prefixes:
        mine = lambda name, prefix=prefix: name.startswith(prefix + ".")  # noqa: E731
        out[prefix] = {
            "exchanges": [{**e, "vhost": "/"} for e in exchanges if mine(e["name"])],
            "queues": [{**q, "vhost": "/"} for q in queues if mine(q["name"])],
            "bindings": [{"source": b["source_name"], "vhost": "/", "destination": b["destination_name"],
                          "destination_type": b["destination_kind"], "routing_key": b["routing_key"],
                          "arguments": b["arguments"]} for b in bindings if mine(b["source_name"])],
        }
    return out


@pytest.mark.parametrize("queue_type,zero_bits", COMBOS)
def test_operator_resources_are_the_definitions_less_the_internal_exchange(queue_type, zero_bits):
    t = build(ChainSettings(prefix="p", max_level=5, queue_type=queue_type, zero_bits=zero_bits))
    docs = resources(t, ClusterReference("rabbit", "messaging"), vhost="prod")
    assert [e.name for e in left_out(t)] == [e.name for e in t.exchanges if e.internal]
    assert sort(as_definitions(docs)) == sort(without(definitions(t, "prod"), left_out(t)))
    for d in docs:
        check_operator_resource(d)
        assert SUBDOMAIN.match(d["metadata"]["name"]) and len(d["metadata"]["name"]) <= 253
        assert d["spec"]["rabbitmqClusterReference"] == {"name": "rabbit", "namespace": "messaging"}
        # the operator's webhook refuses a quorum queue that is not durable
        if d["kind"] == "Queue":
            assert d["spec"]["durable"] is True and d["spec"]["deletionPolicy"] == "retain"
    chain_objects = [d for d in docs if d["metadata"]["labels"].get("delay-gateway/generation")]
    assert {d["metadata"]["labels"]["delay-gateway/generation"] for d in chain_objects} == {t.settings.generation}
    assert all(t.in_chain(d["spec"].get("name", d["spec"].get("source"))) for d in chain_objects)


def declare_both_ways(made: list) -> None:
    """For each queue type and zero-bits mode, two prefixes: one declared by `declare`
    alone, one made by the operator's calls from the rendered YAML and then `declare` over
    them, which fails (406) if any argument differs from what the operator made."""
    with connect() as c:
        for queue_type, zero_bits in COMBOS:
            for who in ("declare", "operator"):
                chain = ChainSettings(prefix=unique_prefix(), max_level=4, resolution_ms=250,
                                      queue_type=queue_type, zero_bits=zero_bits)
                made.append(chain)
                t, pending = build(chain), []
                if who == "operator":
                    if (queue_type, zero_bits) == COMBOS[0]:  # the command itself, once
                        r = cli("render", "--format", "operator", *chain_args(chain), "--cluster-name", "rabbit")
                        assert r.returncode == 0, r.stderr
                        text = r.stdout
                    else:
                        text = render("operator", t, argparse.Namespace(cluster_name="rabbit", vhost="/"))
                    pending = apply_like_the_operator(c, as_definitions(yaml.safe_load_all(text)))
                    # only the binding of the exchange the operator cannot declare waits
                    assert [b["source"] for b in pending] == [e.name for e in left_out(t)]
                declare(c.channel(), t)
                assert apply_like_the_operator(c, {"exchanges": [], "queues": [], "bindings": pending}) == []


def test_declare_over_what_the_operator_creates_changes_nothing(broker):
    """Over AMQP alone, so it holds on any broker version."""
    made = []
    try:
        declare_both_ways(made)
    finally:
        for chain in made:
            remove(chain)


@pytest.mark.brokers("rmq3.10", reason="reads back with the host's rabbitmqctl; the operator rendering is compared with"
                                       " declare over AMQP on every version by test_render.py")
def test_the_broker_then_holds_exactly_the_definitions_rendering(broker):
    """Read back with the host's rabbitmqctl (so: the local node): both prefixes of each
    topology hold exactly the objects of the definitions rendering, the reference."""
    made = []
    try:
        declare_both_ways(made)
        held = on_broker(*[chain.prefix for chain in made])
        for chain in made:
            assert sort(held[chain.prefix]) == sort(definitions(build(chain))), chain
    finally:
        for chain in made:
            remove(chain)


def test_the_cli_needs_a_cluster_and_says_so():
    r = cli("render", "--format", "operator")
    assert r.returncode == 2
    assert "--cluster-name or --connection-secret" in r.stderr
    r = cli("render", "--format", "operator", "--connection-secret", "rabbit-api", "--max-level", "1")
    assert r.returncode == 0, r.stderr
    docs = list(yaml.safe_load_all(r.stdout))
    assert {d["spec"]["rabbitmqClusterReference"]["connectionSecret"]["name"] for d in docs} == {"rabbit-api"}
    assert "Not included: the internal exchange 'delay.returning'" in r.stdout


@settings(max_examples=examples(200))
@given(st.text(min_size=1, max_size=300))
def test_every_amqp_name_gets_a_valid_distinct_kubernetes_name(name):
    n = k8s_name(name)
    assert SUBDOMAIN.match(n) and len(n) <= 253
    if n != name:  # changed: carries a hash of the original, so two names never meet
        assert k8s_name(name + "x") != n


def test_an_unusual_prefix_still_renders_valid_names():
    t = build(ChainSettings(prefix="Billing_EU", max_level=3))
    docs = resources(t, ClusterReference("rabbit"))
    names = [(d["kind"], d["metadata"]["name"]) for d in docs]
    assert len(set(names)) == len(names)
    assert all(SUBDOMAIN.match(n) for _, n in names)
