"""basic.publish written as frames by hand: the gateway's busiest send, in one piece.

It leans on pika's channel and connection internals (`_raise_if_not_open`,
`_body_max_length`, `_adapter_emit_data`, the `bytes_sent` and `frames_sent` counters),
pinned in pyproject.toml and checked by tests/test_codec.py against pika's own frames.
"""

import struct
from typing import Any

from pika import spec

from gateway.broker.plumbing.lazy_properties import WireProperties
from gateway.broker.plumbing.wire_connection import WireConnection
from gateway.core.wire import Properties

_PUBLISH_HEAD = struct.Struct(">BHLHHH")  # method frame head; basic.publish; ticket 0
_CONTENT_FRAME_HEAD = struct.Struct(">BHLHHQ")  # header frame head; class 60, weight 0, body size
_BODY_FRAME_HEAD = struct.Struct(">BHL")  # frame type, channel, payload size



def publish(channel: Any, exchange: str, routing_key: bytes, body: bytes, properties: Properties,
            mandatory: bool = False) -> None:
    """channel.basic_publish(exchange, routing_key, body, WireProperties(properties),
    mandatory): the same frames, written here in one piece on a WireConnection's open
    channel (pika builds three frame objects per message, the gateway's busiest send)."""
    connection = channel.connection
    exchange_bytes = exchange.encode("utf-8")
    if not isinstance(connection, WireConnection) or connection.is_closed or len(exchange_bytes) > 255 \
            or len(routing_key) > 255 or len(body) > connection._body_max_length:
        channel.basic_publish(exchange, routing_key, body, WireProperties(properties), mandatory=mandatory)
        return
    channel._raise_if_not_open()
    number, raw = channel.channel_number, properties.raw
    method_size = 9 + len(exchange_bytes) + len(routing_key)
    pieces = [_PUBLISH_HEAD.pack(spec.FRAME_METHOD, number, method_size, 60, 40, 0),
              bytes((len(exchange_bytes),)), exchange_bytes, bytes((len(routing_key),)), routing_key,
              b"\x01\xce" if mandatory else b"\x00\xce",
              _CONTENT_FRAME_HEAD.pack(spec.FRAME_HEADER, number, 12 + len(raw), 60, 0, len(body)), raw, b"\xce"]
    frames = 2
    if body:
        pieces += [_BODY_FRAME_HEAD.pack(spec.FRAME_BODY, number, len(body)), body, b"\xce"]
        frames = 3
    data_out = b"".join(pieces)
    connection.bytes_sent += len(data_out)
    connection.frames_sent += frames
    connection._adapter_emit_data(data_out)

