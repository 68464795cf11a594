"""Properties and field tables as exact bytes (pure), and pika made to keep them (broker.lazy_properties,
broker.wire_connection)."""

import datetime
import decimal
import struct

import pamqp.encode
import pytest
from hypothesis import given, settings, strategies as st
from pika import BasicProperties, spec

from gateway.broker.plumbing import lazy_properties, wire_connection
from gateway.core import wire
from gateway.core.wire import Opaque, Properties, Table

from .support import examples


def entry(name: bytes, kind: bytes, raw: bytes) -> bytes:
    return bytes([len(name)]) + name + kind + raw


def table_bytes(*entries: bytes) -> bytes:
    content = b"".join(entries)
    return struct.pack(">I", len(content)) + content


# Every AMQP 0-9-1 field type RabbitMQ knows, as the wire carries it.
EVERY_TYPE = [
    (b"t", b"\x01", True),
    (b"b", struct.pack(">b", -5), -5),
    (b"B", struct.pack(">B", 250), 250),
    (b"s", struct.pack(">h", -300), -300),
    (b"u", struct.pack(">H", 60000), 60000),
    (b"I", struct.pack(">i", -70000), -70000),
    (b"i", struct.pack(">I", 4_000_000_000), 4_000_000_000),
    (b"l", struct.pack(">q", -2**40), -2**40),
    (b"f", struct.pack(">f", 0.5), 0.5),
    (b"d", struct.pack(">d", 1.25), 1.25),
    (b"D", struct.pack(">Bi", 2, 12345), decimal.Decimal("123.45")),
    (b"S", struct.pack(">I", 3) + b"abc", "abc"),
    (b"S", struct.pack(">I", 2) + b"\xff\xfe", b"\xff\xfe"),  # a long string that is not UTF-8
    (b"x", struct.pack(">I", 2) + b"\x00\x01", b"\x00\x01"),
    (b"T", struct.pack(">Q", 1_700_000_000), datetime.datetime(2023, 11, 14, 22, 13, 20,
                                                                tzinfo=datetime.timezone.utc)),
    (b"V", b"", None),
    (b"A", struct.pack(">I", 4) + b"b\x01b\x02", [1, 2]),
    (b"F", table_bytes(entry(b"k", b"b", b"\x07")), {"k": 7}),
]


@pytest.mark.parametrize("kind,raw,value", EVERY_TYPE,
                         ids=[f"{k.decode()}-{i}" for i, (k, _, _) in enumerate(EVERY_TYPE)])
def test_every_type_reads_and_keeps_its_bytes(kind, raw, value):
    data = table_bytes(entry(b"h", kind, raw))
    table = Table.parse(data[4:])
    assert table.get("h") == value
    assert table.find("h").kind == kind
    assert table.encode() == data


def test_a_timestamp_past_9999_is_opaque_and_travels():
    data = table_bytes(entry(b"when", b"T", struct.pack(">Q", 2**62)), entry(b"x-delay", b"I", struct.pack(">i", 5)))
    table = Table.parse(data[4:])
    assert isinstance(table.get("when"), Opaque)
    assert table.get("x-delay") == 5 and table.encode() == data


def test_names_that_are_not_utf8_are_kept():
    data = table_bytes(entry(b"\xffname", b"b", b"\x01"), entry(b"ok", b"b", b"\x02"))
    table = Table.parse(data[4:])
    assert table.names() == [b"\xffname", "ok"] and table.get(b"\xffname") == 1
    assert table.without(lambda n: n == "ok").encode() == table_bytes(entry(b"\xffname", b"b", b"\x01"))


def test_an_unknown_type_keeps_the_rest_as_it_is():
    data = table_bytes(entry(b"a", b"b", b"\x01"), b"\x01bZjunk")
    table = Table.parse(data[4:])
    assert table.get("a") == 1 and table.tail == b"\x01bZjunk"
    assert table.encode() == data


@given(st.binary(max_size=300))
def test_no_bytes_make_the_parsers_fail(data):
    table = Table.parse(data)
    assert table.encode()[4:] == data  # whatever it understood, it gives back the same bytes
    props = Properties.parse(data)
    assert props.raw == data


pika_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**63, 2**63 - 1) | st.text(max_size=20) | st.binary(max_size=20)
    | st.floats(allow_nan=False) | st.decimals(allow_nan=False, allow_infinity=False, places=2,
                                               min_value=-10**6, max_value=10**6)
    | st.datetimes(min_value=datetime.datetime(1970, 1, 2), max_value=datetime.datetime(9999, 1, 1)).map(
        lambda d: d.replace(microsecond=0, tzinfo=datetime.timezone.utc)),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(min_size=1, max_size=8), inner, max_size=3),
    max_leaves=8)
header_tables = st.dictionaries(st.text(min_size=1, max_size=12), pika_values, max_size=6)


@settings(max_examples=examples(200))
@given(header_tables)
def test_tables_from_pika_and_pamqp_round_trip_byte_for_byte(headers):
    pieces = []
    lazy_properties.encode_table(pieces, headers)  # pika's, with floats as doubles
    encoded = b"".join(pieces)
    assert Table.parse(encoded[4:]).encode() == encoded
    try:
        other = pamqp.encode.field_table({k: (bytearray(v) if isinstance(v, bytes) else v)
                                          for k, v in headers.items()})
    except (TypeError, OverflowError):  # pamqp refuses some (decimals it cannot scale, huge floats)
        return
    assert Table.parse(other[4:]).encode() == other


FULL = dict(content_type="application/json", content_encoding="gzip", priority=7, correlation_id="c-1",
            reply_to="replies", expiration="250", message_id="m-1", timestamp=1_700_000_000,
            type="order.created", user_id="guest", app_id="shop", cluster_id="c", delivery_mode=1,
            headers={"x-delay": 5000, "tenant": "acme", "nested": {"a": [1, "b"]}})


def test_properties_read_every_field_and_change_only_what_is_asked():
    raw = b"".join(BasicProperties(**FULL).encode())
    props = Properties.parse(raw)
    assert props.raw == raw
    assert props.get("message_id") == b"m-1" and props.get("priority") == 7
    assert props.get("timestamp") == 1_700_000_000 and props.headers.get("tenant") == "acme"
    without = props.replace(user_id=None)
    decoded = BasicProperties()
    decoded.decode(without.raw)
    assert decoded.user_id is None and decoded.message_id == "m-1" and decoded.headers == FULL["headers"]
    assert props.replace(user_id=None, expiration="9").get("expiration") == b"9"
    assert Properties.build(delivery_mode=2).raw == b"".join(BasicProperties(delivery_mode=2).encode())


def decode_frame(props_raw: bytes):
    """A content header frame as the broker sends it, through the codec's frame decoder."""
    payload = struct.pack(">HHQ", 60, 0, 5) + props_raw
    data = struct.pack(">BHI", spec.FRAME_HEADER, 1, len(payload)) + payload + bytes([spec.FRAME_END])
    _, header = wire_connection.decode_frame(data)
    return header.properties


def test_with_the_codec_pika_keeps_the_bytes_and_decodes_only_when_asked():
    hostile = Properties.build(message_id=b"\xffid", headers=Table.parse(table_bytes(
        entry(b"when", b"T", struct.pack(">Q", 2**62)), entry(b"f", b"f", struct.pack(">f", 1.5)),
        entry(b"d", b"d", struct.pack(">d", 2.5)))[4:]))
    properties = decode_frame(hostile.raw)  # pika's own decoder raised OverflowError here
    assert properties.wire.raw == hostile.raw
    assert properties.message_id == b"\xffid"
    assert properties.headers["f"] == 1.5 and properties.headers["d"] == 2.5  # pika truncated them
    assert isinstance(properties.headers["when"], Opaque)
    assert b"".join(lazy_properties.WireProperties(hostile).encode()) == hostile.raw


def test_python_floats_are_sent_as_doubles():
    props = decode_frame(lazy_properties.to_wire(BasicProperties(headers={"v": 1.5, "l": [2.25]})).raw)
    assert props.headers == {"v": 1.5, "l": [2.25]}
    assert props.wire.headers.find("v").kind == b"d"


def test_internal_encoders_write_what_rabbitmq_reads():
    assert wire.long("n", -1).encode() == entry(b"n", b"l", struct.pack(">q", -1))
    assert wire.longstr("s", "é").encode() == entry(b"s", b"S", struct.pack(">I", 2) + "é".encode())
    assert wire.binary("b", b"\x00").encode() == entry(b"b", b"x", struct.pack(">I", 1) + b"\x00")
