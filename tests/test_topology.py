"""The computed topology (pure), and its two adapters against a real broker."""

import json
import os
import subprocess
import tempfile

import pika
import pytest

from topology import ChainSettings, build
from topology.declare import TopologyConflict, declare
from topology.definitions import render
from topology.encoding import level_pattern

from .support import connect, drain, remove, unique_prefix


def test_quorum_queues_dead_letter_at_least_once():
    t = build(ChainSettings(prefix="d", max_level=3, resolution_ms=500))
    level2 = t.queue("d.level.02.delay").arguments
    assert level2 == {"x-queue-type": "quorum", "x-message-ttl": 2000, "x-dead-letter-exchange": "d.level.01",
                      "x-dead-letter-strategy": "at-least-once", "x-overflow": "reject-publish"}
    assert t.queue("d.level.00.pass").arguments["x-message-ttl"] == 1
    assert t.queue("d.level.00.pass").dead_letter_exchange == "d.distributor"
    assert t.queue("d.meditation").arguments["x-message-ttl"] == 7 * 500
    assert t.queue("d.meditation").dead_letter_exchange == "d.check-in"
    for consumed in ("d.check-in", "d.distributor", "d.parking"):
        assert t.queue(consumed).arguments["x-delivery-limit"] == 20
    assert "x-dead-letter-exchange" not in t.queue("d.parked").arguments


def test_classic_queues_carry_no_quorum_arguments():
    t = build(ChainSettings(prefix="d", max_level=2, queue_type="classic"))
    for q in t.queues:
        assert q.arguments["x-queue-type"] == "classic"
        assert not {"x-dead-letter-strategy", "x-overflow", "x-delivery-limit"} & set(q.arguments)


def test_zero_bits_as_exchange_bindings_replace_pass_queues():
    t = build(ChainSettings(prefix="d", max_level=3, zero_bits="exchange"))
    assert not [q for q in t.queues if q.name.endswith(".pass")]
    assert [(b.source, b.destination, b.routing_key) for b in t.bindings if b.destination_type == "exchange"] == [
        ("d.level.00", "d.distributor", "0.#"), ("d.level.01", "d.level.00", "*.0.#"),
        ("d.level.02", "d.level.01", "*.*.0.#")]


def test_every_exchange_that_routes_by_key_has_a_catch_all():
    t = build(ChainSettings(prefix="d", max_level=4))
    for e in t.exchanges:
        if e.type == "topic":
            assert e.arguments == {"alternate-exchange": "d.parking"}


@pytest.mark.parametrize("bad,message", [
    (dict(max_level=0), "max_level"), (dict(max_level=41), "max_level"),
    (dict(resolution_ms=0), "resolution_ms"), (dict(queue_type="stream"), "queue_type"),
    (dict(zero_bits="bits"), "zero_bits"), (dict(prefix=""), "prefix"), (dict(prefix="a b"), "prefix"),
    (dict(max_level=30, resolution_ms=1000), "use max_level <= 28"),
])
def test_bad_settings_say_what_is_wrong(bad, message):
    with pytest.raises(ValueError, match=message):
        ChainSettings(**bad)


def test_definitions_list_every_object():
    t = build(ChainSettings(prefix="d", max_level=5))
    doc = json.loads(render(t, vhost="v"))
    assert len(doc["exchanges"]) == len(t.exchanges) == 6 + 5
    assert len(doc["queues"]) == len(t.queues) == 5 + 2 * 5
    assert len(doc["bindings"]) == len(t.bindings) == 5 + 2 * 5
    assert {o["vhost"] for kind in doc.values() for o in kind} == {"v"}


@pytest.mark.parametrize("queue_type", ["quorum", "classic"])
@pytest.mark.parametrize("zero_bits", ["queue", "exchange"])
def test_declaring_twice_is_a_no_op(broker, queue_type, zero_bits):
    chain = ChainSettings(prefix=unique_prefix(), max_level=3, queue_type=queue_type, zero_bits=zero_bits)
    try:
        with connect() as c:
            declare(c.channel(), build(chain))
            declare(c.channel(), build(chain))
            ch = c.channel()
            for q in build(chain).queues:
                assert ch.queue_declare(q.name, passive=True).method.message_count == 0
    finally:
        remove(chain)


def test_changed_settings_fail_with_a_clear_error(broker):
    chain = ChainSettings(prefix=unique_prefix(), max_level=3)
    try:
        with connect() as c:
            declare(c.channel(), build(chain))
            with pytest.raises(TopologyConflict, match=r"meditation.*other arguments.*new prefix"):
                declare(c.channel(), build(ChainSettings(prefix=chain.prefix, max_level=4)))
    finally:
        remove(chain)


def test_imported_definitions_equal_what_declare_makes(broker):
    """rabbitmqctl import_definitions, then declare: any difference would be a 406."""
    chain = ChainSettings(prefix=unique_prefix(), max_level=4)
    topology = build(chain)
    # The Debian wrapper runs rabbitmqctl as the rabbitmq user: the file must be readable
    # to it, and 3.10 does not take the document on stdin.
    with tempfile.NamedTemporaryFile("w", suffix=".json", dir="/tmp") as f:
        f.write(render(topology))
        f.flush()
        os.chmod(f.name, 0o644)
        try:
            subprocess.run(["rabbitmqctl", "-q", "import_definitions", f.name], check=True, timeout=60)
            with connect() as c:
                # The import runs asynchronously: wait until the last queue exists.
                for _ in range(100):
                    try:
                        c.channel().queue_declare(topology.queues[-1].name, passive=True)
                        break
                    except pika.exceptions.ChannelClosedByBroker:
                        c.sleep(0.1)
                declare(c.channel(), topology)
        finally:
            remove(chain)


@pytest.mark.parametrize("max_level", [6])
def test_broker_topic_matching_agrees_with_the_level_patterns(broker, max_level):
    """Bind plain queues with each level's patterns and publish every key of up to
    max_level words: the broker routes each to exactly the queue the model says."""
    ex = unique_prefix()
    with connect() as c:
        ch = c.channel()
        ch.exchange_declare(ex, "topic", auto_delete=True)
        queues = {}
        for k in range(max_level):
            for bit in "01":
                q = ch.queue_declare("", exclusive=True).method.queue
                ch.queue_bind(q, ex, level_pattern(k, bit))
                queues[q] = (k, bit)
        sent = {}
        for length in range(1, max_level + 1):
            for n in range(1 << length):
                key = ".".join("1" if n >> i & 1 else "0" for i in range(length))
                ch.basic_publish(ex, key, key.encode())
                sent[key] = {(k, key.split(".")[k]) for k in range(length)}
        got = {key: set() for key in sent}
        c.sleep(0.3)
        for q, level_bit in queues.items():
            for _, _, body in drain(ch, q):
                got[body.decode()].add(level_bit)
        assert got == sent
        ch.exchange_delete(ex)
