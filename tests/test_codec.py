"""The pika internals the codec relies on (gateway/broker/codec.py), and that it changes
nothing in pika for anyone else in the process. When a pika release changes one of them,
these fail and say which, before a broker test fails somewhere less clear."""

import inspect
import struct

import pika
import pytest
from pika import data, frame, spec
from pika.adapters.blocking_connection import BlockingConnection
from pika.connection import Connection

from gateway.broker import codec
from gateway.core.wire import Properties, Table

PINNED = "pika>=1.3,<1.5"


def header_frame(props_raw: bytes) -> bytes:
    payload = struct.pack(">HHQ", 60, 0, 5) + props_raw
    return struct.pack(">BHI", spec.FRAME_HEADER, 1, len(payload)) + payload + bytes([spec.FRAME_END])


def test_pika_still_decodes_frames_where_the_codec_steps_in():
    source = inspect.getsource(Connection._read_frame)
    assert "frame.decode_frame(self._frame_buffer)" in source, (
        f"pika {pika.__version__}: Connection._read_frame no longer decodes with "
        "frame.decode_frame(self._frame_buffer); codec.WireConnection overrides it. Check the new "
        f"frame reading before widening the pin ({PINNED} in pyproject.toml).")
    assert callable(getattr(codec.WireConnection, "_read_frame", None))


def test_pika_still_builds_header_frames_as_the_codec_does():
    params = list(inspect.signature(frame.Header.__init__).parameters)
    assert params[:4] == ["self", "channel_number", "body_size", "props"], (
        f"pika {pika.__version__}: frame.Header({', '.join(params[1:])}) is not what codec.decode_frame "
        f"builds (channel_number, body_size, props); pinned {PINNED}.")
    assert (spec.FRAME_HEADER, spec.FRAME_END) == (2, 206), f"pika {pika.__version__}: frame constants moved"


def test_blocking_connection_still_takes_the_select_connection_class_to_drive():
    assert "_impl_class" in inspect.signature(BlockingConnection.__init__).parameters, (
        f"pika {pika.__version__}: BlockingConnection no longer takes _impl_class, which codec.blocking "
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
    _, mine = codec.decode_frame(header_frame(hostile.raw))
    _, pikas = frame.decode_frame(header_frame(hostile.raw))
    assert mine.properties.wire.raw == hostile.raw and mine.properties.headers == {"f": 2.5}
    assert type(pikas.properties) is spec.BasicProperties and not hasattr(pikas.properties, "wire")
    assert pikas.properties.headers == {"f": 2}  # pika's own decoder truncates doubles: not ours to change
    with pytest.raises(pika.exceptions.UnsupportedAMQPFieldException):  # and pika alone cannot encode a float
        spec.BasicProperties(headers={"f": 1.5}).encode()


def test_the_cli_publisher_sends_a_float_header_as_a_double():
    from gateway.broker.publish import Publisher
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
        f"pika {pika.__version__}: Connection._on_data_available no longer reads frames; codec.WireConnection "
        f"corks around it; pinned {PINNED}.")
    assert "self._transport.write(data)" in inspect.getsource(BaseConnection._adapter_emit_data), (
        f"pika {pika.__version__}: BaseConnection._adapter_emit_data no longer hands data to its transport; "
        f"codec.WireConnection takes it there while corked; pinned {PINNED}.")
    source = inspect.getsource(io._AsyncPlaintextTransport) + inspect.getsource(io._AsyncTransportBase)
    for name in ("self._sock", "def get_write_buffer_size", "_STATE_ACTIVE", "self._state"):
        assert name in source, f"pika {pika.__version__}: the plaintext transport has no {name}; pinned {PINNED}."


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
    connection = codec.WireConnection.__new__(codec.WireConnection)  # no connecting: only its writing
    connection.cork = codec.Cork(connection)
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
