"""The pika internals the gateway's own frame handling relies on (gateway/broker/
lazy_properties.py, wire_connection.py and publish_frames.py), and that it changes nothing
in pika for anyone else in the process. When a pika release changes one of them, these
fail and say which, before a broker test fails somewhere less clear."""

import inspect
import struct

import pika
import pytest
from pika import data, frame, spec
from pika.adapters.blocking_connection import BlockingConnection
from pika.connection import Connection

from gateway.broker.plumbing import lazy_properties, publish_frames, wire_connection
from gateway.core.wire import Properties, Table

PINNED = "pika>=1.3,<1.5"


def header_frame(props_raw: bytes) -> bytes:
    payload = struct.pack(">HHQ", 60, 0, 5) + props_raw
    return struct.pack(">BHI", spec.FRAME_HEADER, 1, len(payload)) + payload + bytes([spec.FRAME_END])


def test_pika_still_decodes_frames_where_the_codec_steps_in():
    source = inspect.getsource(Connection._read_frame)
    assert "frame.decode_frame(self._frame_buffer)" in source, (
        f"pika {pika.__version__}: Connection._read_frame no longer decodes with "
        "frame.decode_frame(self._frame_buffer); wire_connection.WireConnection overrides it. Check the new "
        f"frame reading before widening the pin ({PINNED} in pyproject.toml).")
    assert callable(getattr(wire_connection.WireConnection, "_read_frame", None))


def test_pika_still_builds_header_frames_as_the_codec_does():
    params = list(inspect.signature(frame.Header.__init__).parameters)
    assert params[:4] == ["self", "channel_number", "body_size", "props"], (
        f"pika {pika.__version__}: frame.Header({', '.join(params[1:])}) is not what wire_connection.decode_frame "
        f"builds (channel_number, body_size, props); pinned {PINNED}.")
    assert (spec.FRAME_HEADER, spec.FRAME_END) == (2, 206), f"pika {pika.__version__}: frame constants moved"


def test_blocking_connection_still_takes_the_select_connection_class_to_drive():
    assert "_impl_class" in inspect.signature(BlockingConnection.__init__).parameters, (
        f"pika {pika.__version__}: BlockingConnection no longer takes _impl_class, which wire_connection.blocking "
        f"uses to read with WireConnection; pinned {PINNED}.")


def test_pika_still_encodes_field_values_as_the_codec_expects():
    for name in ("encode_value", "encode_short_string", "encode_table"):
        assert callable(getattr(data, name, None)), f"pika {pika.__version__}: pika.data.{name} is gone"
    pieces: list = []
    assert data.encode_value(pieces, 7) == 5 and b"".join(pieces) == b"I\x00\x00\x00\x07", (
        f"pika {pika.__version__}: pika.data.encode_value(pieces, value) no longer appends the typed value "
        "and returns its size")


def test_the_codec_decodes_exactly_and_leaves_pika_as_it_was():
    hostile = Properties.build(headers=Table.parse(struct.pack(">B", 1) + b"f" + b"d" + struct.pack(">d", 2.5)))
    _, mine = wire_connection.decode_frame(header_frame(hostile.raw))
    _, pikas = frame.decode_frame(header_frame(hostile.raw))
    assert mine.properties.wire.raw == hostile.raw and mine.properties.headers == {"f": 2.5}
    assert type(pikas.properties) is spec.BasicProperties and not hasattr(pikas.properties, "wire")
    assert pikas.properties.headers == {"f": 2}  # pika's own decoder truncates doubles: not ours to change
    with pytest.raises(pika.exceptions.UnsupportedAMQPFieldException):  # and pika alone cannot encode a float
        spec.BasicProperties(headers={"f": 1.5}).encode()


def test_the_cli_publisher_sends_a_float_header_as_a_double():
    from gateway.broker.tools.publish import Publisher
    from topology import ChainSettings

    class Channel:
        def confirm_delivery(self):
            pass

        def basic_publish(self, exchange, routing_key, body, properties, mandatory):
            self.sent = b"".join(properties.encode())

    channel = Channel()
    Publisher(channel, ChainSettings(prefix="t")).send(b"x", "k", delay_ms=5, headers={"f": 1.5})
    assert Properties.parse(channel.sent).headers.find("f").kind == b"d"
    assert Properties.parse(channel.sent).headers.get("f") == 1.5


def test_pika_still_reads_and_writes_where_the_cork_steps_in():
    from pika.adapters.base_connection import BaseConnection
    from pika.adapters.utils import io_services_utils as io

    assert "self._read_frame()" in inspect.getsource(Connection._on_data_available), (
        f"pika {pika.__version__}: Connection._on_data_available no longer reads frames; "
        f"wire_connection.WireConnection corks around it; pinned {PINNED}.")
    assert "self._transport.write(data)" in inspect.getsource(BaseConnection._adapter_emit_data), (
        f"pika {pika.__version__}: BaseConnection._adapter_emit_data no longer hands data to its transport; "
        f"wire_connection.WireConnection takes it there while corked; pinned {PINNED}.")
    source = inspect.getsource(io._AsyncPlaintextTransport) + inspect.getsource(io._AsyncTransportBase)
    for name in ("self._sock", "def get_write_buffer_size", "_STATE_ACTIVE", "self._state",
                 "recv(self._sock, self._MAX_RECV_BYTES)"):
        assert name in source, f"pika {pika.__version__}: the plaintext transport has no {name}; pinned {PINNED}."
    assert "self._transport = transport" in inspect.getsource(BaseConnection._proto_connection_made), (
        f"pika {pika.__version__}: BaseConnection._proto_connection_made no longer takes the transport; "
        f"wire_connection.WireConnection sets its read size there; pinned {PINNED}.")


def test_a_wire_connection_reads_what_its_socket_holds_at_once_and_other_connections_as_before():
    from pika.adapters.utils import io_services_utils as io

    transport = io._AsyncPlaintextTransport.__new__(io._AsyncPlaintextTransport)
    connection = wire_connection.WireConnection.__new__(wire_connection.WireConnection)
    connection._on_stream_connected = lambda: None  # (no connecting: only meeting its transport)
    connection._proto_connection_made(transport)
    assert connection._transport is transport and transport._MAX_RECV_BYTES == wire_connection.READ_BYTES
    assert io._AsyncPlaintextTransport._MAX_RECV_BYTES == 4096  # pika's own, for every other connection


class Transport:
    """Where pika's plaintext transport keeps what the codec reads: a socket, a buffer, a state."""

    _STATE_ACTIVE = 1

    def __init__(self, sock):
        self._sock, self._state, self.buffered = sock, 1, []

    def get_write_buffer_size(self):
        return sum(map(len, self.buffered))

    def write(self, data_out):
        self.buffered.append(data_out)


def corked_connection(sock):
    # no connecting: only its writing
    connection = wire_connection.WireConnection.__new__(wire_connection.WireConnection)
    connection.cork = wire_connection.Cork(connection)
    connection._transport = Transport(sock)
    return connection


def test_frames_emitted_while_corked_go_out_in_one_send_at_the_end():
    import socket

    ours, theirs = socket.socketpair()
    with ours, theirs:
        ours.setblocking(False)
        connection = corked_connection(ours)
        with connection.cork:
            connection._adapter_emit_data(b"method")
            with connection.cork:  # nested: still the outer one's
                connection._adapter_emit_data(b"header")
            connection._adapter_emit_data(b"body")
            theirs.setblocking(False)
            with pytest.raises(BlockingIOError):
                theirs.recv(100)  # nothing sent yet
        assert theirs.recv(100) == b"methodheaderbody"
        assert connection._transport.buffered == []


def test_the_cork_leaves_to_the_transport_what_the_socket_does_not_take_and_keeps_order():
    import socket

    ours, theirs = socket.socketpair()
    with ours, theirs:
        ours.setblocking(False)
        connection = corked_connection(ours)
        big = bytes(range(256)) * 40_000  # more than a socket pair's buffers
        with connection.cork:
            connection._adapter_emit_data(big)
        rest = b"".join(connection._transport.buffered)
        assert 0 < len(rest) < len(big) and big.endswith(rest)
        with connection.cork:  # data waits in the transport: later frames queue behind it
            connection._adapter_emit_data(b"after")
        assert connection._transport.buffered[-1] == b"after"
    connection = corked_connection(None)  # not a plain socket (TLS): the transport writes it all
    connection._adapter_emit_data(b"plain")
    with connection.cork:
        connection._adapter_emit_data(b"a")
        connection._adapter_emit_data(b"b")
    assert connection._transport.buffered == [b"plain", b"ab"]


# -- the fast path: deliveries and confirms read, publishes written, past pika's dispatch ------
def open_connection():
    """A WireConnection in the open state with channel 1 open, fed bytes by the test."""
    from pika.callback import CallbackManager
    from pika.channel import Channel

    c = wire_connection.WireConnection.__new__(wire_connection.WireConnection)  # no socket: the test feeds it
    c.cork, c.confirm_callbacks, c.delivery_callbacks = wire_connection.Cork(c), {}, {}
    c.callbacks, c.params, c._blocked_conn_timer = CallbackManager(), pika.ConnectionParameters(), None
    c.connection_state = c.CONNECTION_CLOSED
    c._init_connection_state()
    c._set_connection_state(c.CONNECTION_OPEN)
    c._body_max_length = 131_072 - 8
    c.sent = []
    c._adapter_emit_data = c.sent.append
    channel = Channel(c, 1, lambda _: None)
    channel._set_state(channel.OPEN)
    c._channels[1] = channel
    return c, channel


def deliver(tag: int, body: bytes, routing_key: bytes = b"a.b", redelivered: bool = False, consumer: str = "ct",
            channel: int = 1) -> bytes:
    props = spec.BasicProperties(headers={"x-delay": 5}, message_id="m", delivery_mode=2)
    out = [frame.Method(channel, spec.Basic.Deliver(consumer, tag, redelivered, "ex", routing_key)).marshal(),
           frame.Header(channel, len(body), props).marshal()]
    out += [frame.Body(channel, body[i:i + 131_064]).marshal() for i in range(0, len(body), 131_064)]
    return b"".join(out)


def confirm(method) -> bytes:
    return frame.Method(1, method).marshal()


def received(feed, data: bytes, chunk: int, cancelled: bool = False):
    c, channel = open_connection()
    got = []
    channel._consumers["ct"] = lambda ch, m, p, b: got.append(
        ("deliver", m.consumer_tag, m.delivery_tag, m.redelivered, m.exchange, m.routing_key, p.wire.raw, b))
    if cancelled:
        channel._cancelled.add("ct")
    on_confirm = lambda f: got.append((type(f.method).__name__, f.method.delivery_tag, f.method.multiple,  # noqa: E731
                                       getattr(f.method, "requeue", None)))
    c.confirm_callbacks[1] = (channel, on_confirm)
    c.callbacks.add(1, spec.Basic.Ack, on_confirm, False)  # what channel.confirm_delivery registers
    c.callbacks.add(1, spec.Basic.Nack, on_confirm, False)
    for i in range(0, len(data), chunk):
        feed(c, data[i:i + chunk])
    return got, c.sent, c.frames_received, c.bytes_received, len(c._frame_buffer)


STREAM = b"".join([deliver(1, b"x" * 1000), confirm(spec.Basic.Ack(7, False)), deliver(2, b""),
                   deliver(3, b"\x00" * 300_000, routing_key=b"\xff.not-utf8", redelivered=True),
                   confirm(spec.Basic.Nack(9, True, False)), deliver(4, b"y"),
                   frame.Heartbeat().marshal(), deliver(5, b"z" * 200_000)])


@pytest.mark.parametrize("chunk", [1, 7, 100, 4096, 131_072, len(STREAM)])
@pytest.mark.parametrize("cancelled", [False, True])
def test_fast_path_hands_over_what_pikas_own_path_does(chunk, cancelled):
    """Deliveries (empty, small, over several body frames, larger than the wait limit, a
    routing key that is not UTF-8, redelivered), acks and nacks, a heartbeat, a cancelled
    consumer (pika rejects its deliveries), cut into reads of any size: the same callbacks
    with the same arguments, the same frames sent back and the same counters as pika's."""
    fast = received(lambda c, d: c._on_data_available(d), STREAM, chunk, cancelled)
    pikas = received(lambda c, d: Connection._on_data_available(c, d), STREAM, chunk, cancelled)
    assert fast == pikas
    assert len([g for g in fast[0] if g[0] == "deliver"]) == (0 if cancelled else 5)


@pytest.mark.parametrize("chunk", [1, 100, 131_072, len(STREAM)])
def test_a_consumer_of_consume_gets_what_pika_hands_over_with_the_routing_keys_bytes(chunk):
    """`consume`: the fast path's deliveries go to `on_deliveries`, those of one read together
    (routing key as bytes, the properties' bytes, no pika objects), those pika assembles
    (larger than the wait limit, cut over reads) to `on_message`: between them, every
    delivery and confirm pika's own path hands over, in the same order, with the same values."""
    def as_bytes(key):
        return key if isinstance(key, bytes) else key.encode()

    def feed(via_consume):
        c, channel = open_connection()
        got, reads = [], []
        on_message = lambda ch, m, p, b: got.append(  # noqa: E731
            ("pika", m.delivery_tag, m.redelivered, m.exchange, as_bytes(m.routing_key), p.wire.raw, b))
        channel._consumers["ct"] = on_message
        if via_consume:
            def on_deliveries(raw):
                reads.append(len(raw))
                got.extend(("fast", t, r, e, k, p.raw, b) for t, r, e, k, p, b in raw)
            c.delivery_callbacks[(1, "ct")] = (channel, on_deliveries)
        on_confirm = lambda f: got.append(("confirm", f.method.delivery_tag))  # noqa: E731
        c.confirm_callbacks[1] = (channel, on_confirm)
        c.callbacks.add(1, spec.Basic.Ack, on_confirm, False)
        c.callbacks.add(1, spec.Basic.Nack, on_confirm, False)
        for i in range(0, len(STREAM), chunk):
            c._on_data_available(STREAM[i:i + chunk])
        return got, reads

    (fast, reads), (pikas, _) = feed(True), feed(False)
    assert [g[1:] for g in fast] == [g[1:] for g in pikas] and len(fast) == 7
    kinds = [g[0] for g in fast if g[0] != "confirm"]
    # (the 300,000-byte one, over the wait limit, is pika's when small reads bring it)
    assert kinds[:2] + kinds[3:] == ["fast"] * 4 and (kinds[2] == "pika" or chunk > 100)
    assert (4, False, "ex", b"a.b") == [g for g in fast if g[0] != "confirm"][3][1:5]
    if chunk == len(STREAM):  # one read: the deliveries between two other frames handed over together
        assert reads == [1, 2, 1, 1]


def test_fast_path_takes_deliveries_and_confirms_and_nothing_else():
    c, channel = open_connection()
    channel._consumers["ct"] = lambda *_: None
    c.confirm_callbacks[1] = (channel, lambda _: None)
    seen = []
    c._process_frame = lambda value: seen.append(value.NAME)  # pika's path
    c._on_data_available(STREAM)
    assert seen == ["Heartbeat"]


def test_fast_path_leaves_a_closing_channel_to_pika():
    c, channel = open_connection()
    got = []
    channel._consumers["ct"] = lambda ch, m, p, b: got.append(m.delivery_tag)
    channel._set_state(channel.CLOSING)
    c._on_data_available(deliver(1, b"a"))
    pikas, pchannel = open_connection()
    pgot = []
    pchannel._consumers["ct"] = lambda ch, m, p, b: pgot.append(m.delivery_tag)
    pchannel._set_state(pchannel.CLOSING)
    Connection._on_data_available(pikas, deliver(1, b"a"))
    assert got == pgot and c.frames_received == pikas.frames_received == 3


@pytest.mark.parametrize("body, mandatory, routing_key", [
    (b"payload", False, b"a.b"), (b"", True, b"rk"), (b"\x00" * 131_064, True, b"\xff\xfe"),
    (b"big" * 100_000, False, b"k")])  # over a frame: pika writes it
def test_publish_writes_the_frames_pika_writes(body, mandatory, routing_key):
    props = lazy_properties.encoded(spec.BasicProperties(headers={"x-delay": 5, "f": 1.5}, message_id="m"))
    ours, channel = open_connection()
    publish_frames.publish_all(channel, [("exchange-é", routing_key, body, props.wire, mandatory)])
    pikas, pchannel = open_connection()
    pchannel.basic_publish("exchange-é", routing_key, body, lazy_properties.WireProperties(props.wire),
                           mandatory=mandatory)
    assert b"".join(ours.sent) == b"".join(pikas.sent)
    assert (ours.frames_sent, ours.bytes_sent) == (pikas.frames_sent, pikas.bytes_sent)


def test_publish_all_writes_what_each_publish_writes_in_order():
    """The publishes of one event in one piece: the same bytes and counters as pika's, one
    by one, a message over a frame (pika's) in its place between them."""
    props, other = Properties.build(message_id="m", delivery_mode=2), Properties.build(delivery_mode=1)
    messages = [("pick-up", b"a.b", b"one", props, True), ("", b"queue", b"", other, False),
                ("pick-up", b"k", b"big" * 100_000, props, False), ("exchange-é", b"c", b"two", other, True)]
    ours, channel = open_connection()
    publish_frames.publish_all(channel, messages)
    pikas, pchannel = open_connection()
    for exchange, routing_key, body, raw, mandatory in messages:
        pchannel.basic_publish(exchange, routing_key, body, lazy_properties.WireProperties(raw), mandatory=mandatory)
    assert b"".join(ours.sent) == b"".join(pikas.sent)
    assert (ours.frames_sent, ours.bytes_sent) == (pikas.frames_sent, pikas.bytes_sent)
    assert len(ours.sent) < len(pikas.sent)  # (in pieces: before the big one, pika's frames, after it)
