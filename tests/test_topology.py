"""The computed topology (pure), and its two adapters against a real broker."""

import json
import os
import subprocess
import tempfile

import pika
import pytest

from topology import ChainSettings, build
from topology.broker.declare import TopologyConflict, declare, max_age_s, short_retention
from topology.definitions import render
from topology.encoding import level_pattern
from topology.model import cancel_window_ms

from gateway.settings import Settings, UsageError

from .support import connect, drain, remove, unique_prefix, wait_until


G = "d.500ms-quorum-queue."


def test_quorum_queues_dead_letter_at_least_once():
    t = build(ChainSettings(prefix="d", max_level=3, resolution_ms=500))
    level2 = t.queue(G + "level.02.delay").arguments
    assert level2 == {"x-queue-type": "quorum", "x-message-ttl": 2000, "x-dead-letter-exchange": G + "level.01",
                      "x-dead-letter-strategy": "at-least-once", "x-overflow": "reject-publish"}
    assert t.queue(G + "level.00.pass").arguments["x-message-ttl"] == 1
    assert t.queue(G + "level.00.pass").dead_letter_exchange == "d.distributor"
    assert t.queue(G + "meditation.03").arguments["x-message-ttl"] == 7 * 500
    assert t.queue(G + "meditation.03").dead_letter_exchange == "d.returning"
    for consumed in ("d.check-in", "d.returning", "d.distributor", "d.parking"):
        args = t.queue(consumed).arguments
        assert args["x-delivery-limit"] == 20 and args["x-queue-type"] == "quorum"
        assert args["x-dead-letter-routing-key"] == t.queue(consumed).role
    assert t.queue("d.parked").arguments == {"x-queue-type": "quorum", "x-delivery-limit": 2**31 - 1}


def test_classic_chains_carry_no_quorum_arguments_and_have_classic_exits():
    t = build(ChainSettings(prefix="d", max_level=2, queue_type="classic"))
    exits = {"d.distributor.classic", "d.returning.classic"}
    for q in t.queues:
        if (t.in_chain(q.name) or q.name in exits) and q.role != "presence":
            assert q.arguments["x-queue-type"] == "classic"
            assert not {"x-dead-letter-strategy", "x-overflow", "x-delivery-limit"} & set(q.arguments)
        elif q.role not in ("registry", "cancellations", "waiting"):  # (streams)
            assert q.arguments["x-queue-type"] == "quorum"
    # a classic queue dead-letters at most once: never into a quorum queue, which is not up
    # yet while the broker starts
    targets = {q.dead_letter_exchange for q in t.queues if t.in_chain(q.name)}
    assert targets & {"d.distributor", "d.returning"} == set() and exits <= targets
    assert t.exchange("d.returning.classic").internal


def test_zero_bits_as_exchange_bindings_replace_pass_queues():
    t = build(ChainSettings(prefix="d", max_level=3, zero_bits="exchange"))
    g = "d.1000ms-quorum-exchange."
    assert not [q for q in t.queues if q.name.endswith(".pass")]
    assert [(b.source, b.destination, b.routing_key) for b in t.bindings if b.destination_type == "exchange"] == [
        (g + "level.00", "d.distributor", "0.#"), (g + "level.01", g + "level.00", "*.0.#"),
        (g + "level.02", g + "level.01", "*.*.0.#")]


def test_the_contract_exchanges_take_no_arguments_and_the_chains_catch_stray_keys():
    t = build(ChainSettings(prefix="d", max_level=4))
    for e in t.exchanges:
        if e.name in ("d.check-in", "d.pick-up"):
            assert (e.type, dict(e.arguments), e.internal) == ("topic", {}, False)
        elif e.name == "d.waiting":  # a record no stream takes comes back (mandatory) and is dropped, not parked
            assert (e.type, dict(e.arguments)) == ("topic", {})
        elif e.type == "topic":
            assert e.arguments == {"alternate-exchange": "d.parking"}
    assert t.exchange("d.returning").internal  # only dead-lettering reaches it


def test_a_chain_with_other_settings_has_other_names_and_max_level_only_adds_levels():
    a, b = build(ChainSettings(prefix="d", max_level=3)), build(ChainSettings(prefix="d", max_level=5))
    c = build(ChainSettings(prefix="d", max_level=3, resolution_ms=100))
    fixed = {q.name for q in a.queues if not a.in_chain(q.name)}
    assert fixed == {"d.check-in", "d.returning", "d.distributor", "d.parking", "d.parked", "d.chains",
                     "d.cancellations", "d.retry", "d.waiting.00", "d.waiting.01", "d.waiting.02",
                     "d.waiting.done"}
    assert {q.name for q in a.queues} - {q.name for q in b.queues} == {
        "d.1000ms-quorum-queue.meditation.03", "d.1000ms-quorum-queue.gateways.03"}
    levels = {q.name: dict(q.arguments) for q in b.queues}
    assert all(levels[q.name] == dict(q.arguments) for q in a.queues if ".level." in q.name)  # the same levels
    assert not {q.name for q in c.queues if c.in_chain(q.name)} & {q.name for q in a.queues}


@pytest.mark.parametrize("bad,message", [
    (dict(max_level=0), "max_level"), (dict(max_level=41), "max_level"),
    (dict(resolution_ms=0), "resolution_ms"), (dict(queue_type="stream"), "queue_type"),
    (dict(zero_bits="bits"), "zero_bits"), (dict(prefix=""), "prefix"), (dict(prefix="a b"), "prefix"),
    (dict(max_level=30, resolution_ms=1000), "use max_level <= 28"),
])
def test_bad_settings_say_what_is_wrong(bad, message):
    with pytest.raises(ValueError, match=message):
        ChainSettings(**bad)


def test_the_cancel_objects_are_part_of_the_topology():
    t = build(ChainSettings(prefix="d", max_level=5, resolution_ms=100), cancel_window=7_200_000)
    assert (t.exchange("d.cancel").type, dict(t.exchange("d.cancel").arguments)) == ("fanout", {})
    assert (t.exchange("d.rules").type, dict(t.exchange("d.rules").arguments)) == ("fanout", {})
    stream = t.queue("d.cancellations")
    assert dict(stream.arguments) == {"x-queue-type": "stream", "x-max-age": "7200s",
                                      "x-stream-max-segment-size-bytes": 8_000_000}
    assert stream.declared_once and not t.in_chain(stream.name)
    assert {(b.source, b.destination) for b in t.bindings} >= {("d.cancel", "d.check-in"), ("d.rules", "d.check-in"),
                                                                ("d.cancellations", "d.cancellations")}
    # the default window: 2^max_level units plus a day
    assert build(ChainSettings(prefix="d", max_level=5, resolution_ms=100)).queue("d.cancellations") \
        .arguments["x-max-age"] == f"{(32 * 100 + 86_400_000) // 1000 + 1}s"


def test_a_cancel_retention_shorter_than_a_lap_is_refused_in_one_line():
    """A cancel forgotten before its message passes a gateway again would not win: refused at
    start (exit 2), with the shortest it may be."""
    chain = ChainSettings(prefix="d", max_level=12, resolution_ms=1000)  # a lap of 4,096 s
    assert cancel_window_ms(chain, 4096) == 4_096_000
    with pytest.raises(ValueError, match=r"shorter than .* \(4096 s: 2\^max_level x resolution\)"):
        cancel_window_ms(chain, 4095)
    with pytest.raises(UsageError, match="--cancel-retention 60 s is shorter than"):
        Settings(chain=chain, cancel_retention=60.0)
    assert cancel_window_ms(chain) == 4_096_000 + 86_400_000


def test_definitions_list_every_object():
    t = build(ChainSettings(prefix="d", max_level=5))
    doc = json.loads(render(t, vhost="v"))
    # with the registry's, the cancel, rules, retry and waiting ones
    assert len(doc["exchanges"]) == len(t.exchanges) == 8 + 4 + 5 + 1
    # the registry, gateways, cancellations, retry; the waiting streams (bands 0-3 for laps of 31 s, done)
    assert len(doc["queues"]) == len(t.queues) == 8 + 2 + 2 * 5 + 5
    assert len(doc["bindings"]) == len(t.bindings) == 7 + 4 + 2 * 5 + 5
    assert [e["internal"] for e in doc["exchanges"]].count(True) == 1
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


def test_a_cancellations_stream_that_keeps_less_than_the_window_is_said_and_the_fix_named(broker):
    """The stream keeps the window it was first declared with; a longer one set later (say
    --max-level raised) is said by `declare` (and logged by `run`) with what to do, never a
    refusal: a longer stream than needed, or one just made, says nothing."""
    chain = ChainSettings(prefix=unique_prefix(), max_level=3, resolution_ms=100)
    try:
        with connect() as c:
            declare(c.channel(), build(chain, cancel_window=7_200_000))
            assert short_retention(c.channel(), build(chain, cancel_window=7_200_000)) is None
            assert short_retention(c.channel(), build(chain, cancel_window=3_600_000)) is None  # keeps more
            said = short_retention(c.channel(), build(chain, cancel_window=14_400_000))
            assert said is not None and "keeps records for 7200 s" in said and "14400 s" in said
            assert "delete the stream" in said
        assert max_age_s("14D") == 14 * 86_400 and max_age_s("1209600s") == 1_209_600 and max_age_s("x") is None
        assert max_age_s("7200000") == 7200  # (RabbitMQ 4: milliseconds)
    finally:
        remove(chain)


def test_a_clash_with_objects_declared_elsewhere_fails_with_a_clear_error(broker):
    chain = ChainSettings(prefix=unique_prefix(), max_level=3)
    try:
        with connect() as c:
            c.channel().queue_declare(chain.names.parked, durable=True)  # a classic queue of that name
            with pytest.raises(TopologyConflict, match=r"queue '.*\.parked' already exists with other arguments"):
                declare(c.channel(), build(chain))
    finally:
        remove(chain)


def exists(connection, kind: str, name: str) -> bool:
    """Whether a passive declare finds the queue or exchange `name` (a 404 closes only the
    channel it was asked on)."""
    channel = connection.channel()
    try:
        if kind == "queue":
            channel.queue_declare(name, passive=True)
        else:
            channel.exchange_declare(name, passive=True)
    except pika.exceptions.ChannelClosedByBroker as exc:
        assert exc.reply_code == 404, exc
        return False
    channel.close()
    return True


def test_chains_with_other_settings_are_declared_beside_each_other(broker):
    chain = ChainSettings(prefix=unique_prefix(), max_level=3)
    others = [ChainSettings(prefix=chain.prefix, max_level=5), ChainSettings(prefix=chain.prefix, max_level=2,
              resolution_ms=100, queue_type="classic", zero_bits="exchange")]
    try:
        with connect() as c:
            for settings in [chain] + others:
                declare(c.channel(), build(settings))
            # each whole beside the others: every queue and exchange of each is there
            missing = [(kind, name) for settings in [chain] + others
                       for kind, names in (("queue", [q.name for q in build(settings).queues]),
                                           ("exchange", [e.name for e in build(settings).exchanges]))
                       for name in names if not exists(c, kind, name)]
        assert not missing, missing
    finally:
        for settings in [chain] + others:
            remove(settings)


@pytest.mark.brokers("rmq3.10", reason="imports with the host's rabbitmqctl into the local node; "
                                       "test_broker_versions.py imports the definitions on each version")
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
                wait_until(lambda: exists(c, "queue", topology.queues[-1].name), 10, 0.1,
                           f"the import showing {topology.queues[-1].name}", sleep=c.sleep)
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
        ch.confirm_delivery()  # each publish returns once routed: in its queues, or in none
        for length in range(1, max_level + 1):
            for n in range(1 << length):
                key = ".".join("1" if n >> i & 1 else "0" for i in range(length))
                ch.basic_publish(ex, key, key.encode())
                sent[key] = {(k, key.split(".")[k]) for k in range(length)}
        got = {key: set() for key in sent}
        for q, level_bit in queues.items():
            for _, _, body in drain(ch, q):
                got[body.decode()].add(level_bit)
        assert got == sent
        ch.exchange_delete(ex)


def test_the_waiting_streams_cover_a_lap_and_keep_a_span_and_an_hour():
    """One stream per band up to the chain's lap (4^b s each), one of done records, all
    behind `<prefix>.waiting` by band; retention: the band's span plus an hour."""
    t = build(ChainSettings(prefix="d"))  # a lap of 2^20 - 1 s: bands 0 to 10
    streams = {q.name: dict(q.arguments) for q in t.queues if q.role == "waiting"}
    assert list(streams) == [f"d.waiting.{b:02d}" for b in range(11)] + ["d.waiting.done"]
    assert streams["d.waiting.00"] == {"x-queue-type": "stream", "x-max-age": "3601s",
                                       "x-stream-max-segment-size-bytes": 4_000_000}
    assert streams["d.waiting.10"]["x-max-age"] == f"{4**10 + 3600}s" and streams["d.waiting.done"]["x-max-age"] == \
        "3600s"
    assert {(b.routing_key, b.destination) for b in t.bindings_from("d.waiting")} == {
        (name.rsplit(".", 1)[1], name) for name in streams}
    # more levels, more bands (a chain of other settings adds to what is there)
    assert len([q for q in build(ChainSettings(prefix="d", max_level=28)).queues if q.role == "waiting"]) == 16
