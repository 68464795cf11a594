"""Property-based fuzzing at the wire level of what publishers can send to check-in.

Header tables of every AMQP field type, sent by a second client library that writes
short, byte and unsigned integers, 32-bit floats and decimals (aiormq, through pamqp;
pika cannot), and byte by byte for what no client library writes (unsigned bytes,
doubles, names and routing keys that are not UTF-8, timestamps past the year 9999, long
strings that are not UTF-8); odd routing keys, properties and delay headers, forged
x-gateway-* and x-death headers; ordinary messages sent alongside.

Every message must arrive at pick-up byte for byte as sent (each header with its wire
type) and never early, or be parked with a reason; the ordinary ones must all arrive
exactly once and on time; the gateway must not crash, reconnect or log a failure.
"""

import asyncio
import datetime
import decimal
import struct
import uuid
from collections import Counter

import aiormq
import pika
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from gateway.broker.plumbing import lazy_properties
from gateway.core import envelope
from gateway.core.envelope import Inside
from gateway.core.wire import Properties, Table

from ..support import (SENTINEL, START_NOTICES, GatewayProcess, broker_url, connect, drain, examples, now_ms,
                       publish_sentinel, same_entries, wait_until)
from .load import Figures

DELIVER_WITHIN_MS = 3000
INT64 = (-(2 ** 63), 2 ** 63 - 1)

# -- what the second client (pamqp) encodes: its type follows the Python value ---------------
pamqp_scalars = st.one_of(
    st.integers(*INT64),  # b, s, u, I, i or l by magnitude
    st.integers(-300, 70_000),
    st.floats(width=32, allow_nan=False, allow_infinity=False),  # f: 32-bit
    st.decimals(min_value=-10 ** 4, max_value=10 ** 4, places=3, allow_nan=False),  # D
    st.text(max_size=30),  # S
    st.binary(max_size=30).map(bytearray),  # x
    st.booleans(), st.none(),
    st.datetimes(min_value=datetime.datetime(1970, 1, 2), max_value=datetime.datetime(2200, 1, 1)).map(
        lambda d: d.replace(microsecond=0)),
)
names = st.text(min_size=1, max_size=20).filter(lambda s: len(s.encode()) <= 255)
pamqp_values = st.recursive(pamqp_scalars, lambda inner: st.lists(inner, max_size=3)
                            | st.dictionaries(names, inner, max_size=3), max_leaves=8)
delays = st.one_of(st.integers(-3000, 2500), st.integers(*INT64), st.integers(0, 2500).map(str),
                   st.floats(-100, 2500, width=32), pamqp_values)
special = st.sampled_from(["x-delay", "x-deliver-at", "x-death", "x-gateway-due-at", "x-gateway-routing-key",
                           "x-gateway-expiration", "x-gateway-properties", "x-first-death-queue",
                           "x-delivery-count", "timestamp_in_ms", "CC"])


# -- what no client library writes: raw entries --------------------------------------------------
def _entry(name: bytes, kind: bytes, raw: bytes) -> bytes:
    return bytes([len(name)]) + name + kind + raw


raw_entries = st.one_of(
    st.integers(0, 255).map(lambda n: (b"B", bytes([n]))),
    st.floats(allow_nan=False, allow_infinity=False).map(lambda f: (b"d", struct.pack(">d", f))),
    st.integers(2 ** 40, 2 ** 64 - 1).map(lambda s: (b"T", struct.pack(">Q", s))),  # mostly past 9999
    st.binary(max_size=20).map(lambda b: (b"S", struct.pack(">I", len(b)) + b)),  # not always UTF-8
    st.integers(0, 255).flatmap(lambda scale: st.integers(-2**31, 2**31 - 1).map(
        lambda d: (b"D", struct.pack(">Bi", scale, d)))),  # decimals of any scale
)
raw_names = st.binary(min_size=1, max_size=12)


@st.composite
def pamqp_message(draw):
    headers = draw(st.dictionaries(names, pamqp_values, max_size=5))
    if draw(st.booleans()):
        headers["x-delay"] = draw(delays)
    if draw(st.integers(0, 4)) == 0:
        headers[draw(special)] = draw(pamqp_values | delays)
    key = draw(st.text(max_size=60).filter(lambda s: len(s.encode()) <= 255) | st.just("a" * 255))
    return "pamqp", key.encode(), headers, draw(st.binary(max_size=512))


@st.composite
def raw_message(draw):
    entries = [_entry(n, *draw(raw_entries)) for n in draw(st.lists(raw_names, max_size=4, unique=True))]
    if draw(st.booleans()):
        entries.append(_entry(b"x-delay", b"I", struct.pack(">i", draw(st.integers(-1000, 2500)))))
    table = Table.parse(b"".join(entries))
    props = Properties.build(headers=table, message_id=draw(st.binary(max_size=40)),
                             # (long enough not to expire in the test's own queue after pick-up)
                             expiration=draw(st.none() | st.integers(10 ** 5, 10 ** 9).map(str)),
                             priority=draw(st.none() | st.integers(0, 255)),
                             delivery_mode=draw(st.sampled_from([None, 1, 2])))
    return "raw", draw(st.binary(max_size=255)), props, draw(st.binary(max_size=512))


# Each wire type at least once, whatever hypothesis draws.
EVERY_TYPE_PAMQP = ("pamqp", b"every.type", {
    "t": True, "b": -5, "s": -300, "u": 60000, "I": -70000, "i": 4_000_000_000, "l": 2 ** 40, "f": 0.5,
    "D": decimal.Decimal("1.23"), "S": "text", "x": bytearray(b"\x00\xff"), "T": datetime.datetime(2020, 1, 1),
    "V": None, "A": [1, "two", [3.5]], "F": {"k": {"n": 1}}, "x-delay": 100}, b"body")
# Delivered by 3.10; refused (541) by 4.3.6 stamping arrival times, the connection closed.
DECIMAL_STAMP = ("pamqp", b"stamp", {"timestamp_in_ms": {"a": decimal.Decimal("4.845")}, "x-delay": 100}, b"")
EVERY_TYPE_RAW = ("raw", b"\xff\xfe.raw", Properties.build(message_id=b"\xffid", headers=Table.parse(
    _entry(b"B", b"B", b"\xfa") + _entry(b"d", b"d", struct.pack(">d", 1e300))
    + _entry(b"T", b"T", struct.pack(">Q", 2 ** 62)) + _entry(b"\xffname", b"S", struct.pack(">I", 2) + b"\xff\xfe")
    + _entry(b"D", b"D", struct.pack(">Bi", 200, -5)) + _entry(b"x-delay", b"I", struct.pack(">i", 100)))), b"")


def sent_properties(kind, headers_or_props, message_id):
    """The properties exactly as they reach the broker."""
    if kind == "raw":
        return headers_or_props.replace(correlation_id=message_id)
    # (aiormq would add a message id of its own if there were none)
    return Properties.parse(aiormq.spec.Basic.Properties(
        headers=headers_or_props, correlation_id=message_id, message_id=message_id).marshal())


def outcome_expected(props: Properties, now: int) -> str:
    try:
        due = envelope.due_at(envelope.for_pick_up(props).headers, now)
    except envelope.Unreadable:
        return "parked"
    return "delivered" if due - now <= DELIVER_WITHIN_MS else "waiting"


class Publisher:
    """Byte-by-byte publishes with confirms, on a connection of their own: the broker may
    refuse one (3.10.8 closes the connection with 541 on some values it cannot handle);
    such a message was never sent, and the connection is opened again."""

    def __init__(self) -> None:
        self._open()

    def _open(self) -> None:
        self.connection = connect()
        self.channel = self.connection.channel()
        self.channel.confirm_delivery()

    def publish(self, *args, **kwargs) -> bool:
        try:
            self.channel.basic_publish(*args, **kwargs)
            return True
        except (pika.exceptions.ConnectionClosed, pika.exceptions.ChannelClosed,
                pika.exceptions.ChannelWrongStateError, pika.exceptions.StreamLostError):
            self._open()
            return False

    def close(self) -> None:
        if self.connection.is_open:
            self.connection.close()


async def _publish_pamqp(url, exchange, batch) -> set:
    """Publish each with confirms; returns the ids of those the broker refused itself: they
    were never sent. 4.x refuses a CC header that is not an array of strings (406, the
    channel); 4.3.6 stamping arrival times crashes on a decimal anywhere in a
    timestamp_in_ms header before it routes (541, the whole connection)."""
    refused = set()
    connection = await aiormq.connect(url)
    channel = await connection.channel(publisher_confirms=True)
    for key, headers, body, message_id in batch:
        try:
            await channel.basic_publish(body, exchange=exchange, routing_key=key.decode(), mandatory=True,
                                        properties=aiormq.spec.Basic.Properties(
                                            headers=headers, correlation_id=message_id, message_id=message_id))
        except aiormq.exceptions.ChannelPreconditionFailed:
            refused.add(message_id)
            channel = await connection.channel(publisher_confirms=True)
        except aiormq.exceptions.ConnectionInternalError:
            refused.add(message_id)
            connection = await aiormq.connect(url)
            channel = await connection.channel(publisher_confirms=True)
    await connection.close()
    return refused


def test_hostile_publishers_beside_ordinary_traffic(make_chain, fault_report):
    chain = make_chain(max_level=3, resolution_ms=100)
    gateway = GatewayProcess(chain).wait_ready()
    connection = connect()
    channel = connection.channel()
    channel.confirm_delivery()
    sink = channel.queue_declare("", exclusive=True).method.queue
    channel.queue_bind(sink, chain.names.pick_up, "#")
    expected, ordinary, tally = {}, {}, Counter()
    pamqp_batch = []
    raw = Publisher()

    @settings(max_examples=examples(120), database=None, suppress_health_check=list(HealthCheck))
    @given(pamqp_message() | raw_message(), st.integers(0, 1500))
    @example(EVERY_TYPE_PAMQP, 100)
    @example(EVERY_TYPE_RAW, 100)
    @example(DECIMAL_STAMP, 100)
    def generate(message, ordinary_delay):
        kind, key, headers_or_props, body = message
        message_id = uuid.uuid4().hex
        props = sent_properties(kind, headers_or_props, message_id)
        now = now_ms()
        if kind == "raw":
            if not raw.publish(chain.names.check_in, key, body, lazy_properties.WireProperties(props), mandatory=True):
                tally["refused by the broker at publish (not sent)"] += 1
                return
        else:
            pamqp_batch.append((key, headers_or_props, body, message_id))
        expected[message_id] = (props, key, body, now, outcome_expected(props, now))
        tally[f"sent by {kind}"] += 1
        tally["kinds of header value"] = 0
        # an ordinary message beside every hostile one
        oid = f"ordinary-{len(ordinary)}"
        ordinary[oid] = (now_ms(), ordinary_delay)
        channel.basic_publish(chain.names.check_in, "ordinary", oid.encode(), pika.BasicProperties(
            message_id=oid, headers={"x-delay": ordinary_delay}), mandatory=True)

    generate()
    raw.close()
    for message_id in asyncio.run(_publish_pamqp(broker_url(), chain.names.check_in, pamqp_batch)):
        del expected[message_id]
        tally["refused by the broker at publish (not sent)"] += 1
    kinds = {e.kind for props, *_ in expected.values() for e in props.headers.entries}
    wanted = {mid for mid, v in expected.items() if v[4] == "delivered"} | set(ordinary)
    # Behind everything in check-in, due after all that is to be delivered by more than the
    # lead and a unit: once it arrived, nothing due before it (a copy, a message that should
    # have been parked or kept waiting) can still come, and every parking is done.
    publish_sentinel(chain, DELIVER_WITHIN_MS)
    arrived = {}
    copies = Counter()

    def everything() -> bool:
        for method, properties, body in drain(channel, sink):
            if properties.message_id == SENTINEL and body == b"sentinel":
                copies[SENTINEL] += 1
                continue
            mid = properties.message_id if body.startswith(b"ordinary-") else properties.correlation_id
            copies[mid] += 1
            arrived[mid] = (method.routing_key, properties.wire, body, now_ms())
        return copies[SENTINEL] > 0 and wanted <= arrived.keys()
    wait_until(everything, DELIVER_WITHIN_MS / 1000 + 20, sleep=connection.sleep, fail=False)  # (checked below)
    sentinel = copies.pop(SENTINEL, 0)
    parked = {}
    for _, properties, _ in drain(channel, chain.names.parked):
        inside = Inside(properties.wire)
        parked[inside.user.text("correlation_id") if inside.complete else None] = inside.error
    alive = gateway.proc.poll() is None
    connections = gateway.metric("delay_gateway_connections_total")
    assert gateway.terminate() == 0
    connection.close()

    exact, early, problems = 0, [], []
    for mid, (props, key, body, _sent_at, outcome) in expected.items():
        if mid in arrived:
            got_key, got, got_body, at = arrived[mid]
            got_key = got_key if isinstance(got_key, bytes) else got_key.encode()
            same = (got_key == key and got_body == body
                    and same_entries(got.headers, envelope.for_pick_up(props).headers)
                and {k: v for k, v in got.values.items() if k not in ("headers", "timestamp")}
                == {k: v for k, v in envelope.for_pick_up(props).values.items() if k not in ("headers", "timestamp")})
            if same:
                exact += 1
            else:
                problems.append(("changed", mid, key, props.headers, got.headers))
            if outcome != "delivered":
                problems.append(("delivered though expected " + outcome, mid, props.headers))
        elif mid in parked:
            if not parked[mid]:
                problems.append(("parked without a reason", mid))
            if outcome != "parked":
                problems.append(("parked though expected " + outcome, mid, props.headers, parked[mid]))
        elif outcome != "waiting":
            problems.append(("missing", mid, outcome, props.headers))
    for oid, (sent_at, delay) in ordinary.items():
        if oid not in arrived:
            problems.append(("ordinary missing", oid))
        elif arrived[oid][3] < sent_at + delay:
            early.append(oid)
    duplicated = [mid for mid, n in copies.items() if n > 1]
    failures = [e for e in gateway.lines if e.get("level") in ("warning", "error")
                and e.get("event") not in ("parked", *START_NOTICES)]
    tally.update({"delivered exactly": exact, "parked with a reason": sum(1 for r in parked.values() if r),
                  "still waiting (due later)": sum(1 for v in expected.values() if v[4] == "waiting"),
                  "ordinary alongside": len(ordinary), "wire types seen": len(kinds)})
    del tally["kinds of header value"]
    fault_report(Figures("hostile-input", len(expected) + len(ordinary), 0, len(problems), len(early),
                         len(duplicated), {k.replace(" ", "_"): v for k, v in sorted(tally.items())}))
    assert alive and connections == 1, "the gateway crashed or reconnected"
    assert sentinel, "the sentinel never came: nothing says that all that was coming came"
    assert not failures, failures[:3]
    assert not problems, problems[:3]
    assert not early and not duplicated
    assert kinds >= {bytes([c]) for c in b"tbBsuIilfdDSxTVAF"}, kinds  # every type was tried
