"""basic.publish written as frames by hand: the gateway's busiest send, in one piece (and
the publishes of one event, all in one piece).

It leans on pika's channel and connection internals (`_raise_if_not_open`,
`_body_max_length`, `_adapter_emit_data`, the `bytes_sent` and `frames_sent` counters),
pinned in pyproject.toml and checked by tests/test_codec.py against pika's own frames.
"""

import struct
from typing import Any, Dict, Iterable, List, Tuple

from pika import spec

from gateway.broker.plumbing.lazy_properties import WireProperties
from gateway.broker.plumbing.wire_connection import WireConnection
from gateway.core.wire import Properties

_PUBLISH_HEAD = struct.Struct(">BHLHHH")  # method frame head; basic.publish; ticket 0
_CONTENT_FRAME_HEAD = struct.Struct(">BHLHHQ")  # header frame head; class 60, weight 0, body size
_BODY_FRAME_HEAD = struct.Struct(">BHL")  # frame type, channel, payload size



Message = Tuple[str, bytes, bytes, Properties, bool]  # exchange, routing key, body, properties, mandatory


def publish_all(channel: Any, messages: Iterable[Message]) -> None:
    """channel.basic_publish(exchange, routing_key, body, WireProperties(properties),
    mandatory) of each message in order: the same frames, written here in one piece on a
    WireConnection's open channel (pika builds three frame objects per message), the channel
    checked once and each exchange name encoded once (a release of many messages)."""
    connection = channel.connection
    if not isinstance(connection, WireConnection) or connection.is_closed:
        for exchange, routing_key, body, properties, mandatory in messages:
            channel.basic_publish(exchange, routing_key, body, WireProperties(properties), mandatory=mandatory)
        return
    channel._raise_if_not_open()
    number, body_max = channel.channel_number, connection._body_max_length
    names: Dict[str, bytes] = {}
    pieces: List[bytes] = []
    frames = 0
    for exchange, routing_key, body, properties, mandatory in messages:
        exchange_bytes = names.get(exchange)
        if exchange_bytes is None:
            exchange_bytes = names[exchange] = exchange.encode("utf-8")
        if len(exchange_bytes) > 255 or len(routing_key) > 255 or len(body) > body_max:
            _emit(connection, pieces, frames)  # (what came before it goes first)
            pieces, frames = [], 0
            channel.basic_publish(exchange, routing_key, body, WireProperties(properties), mandatory=mandatory)
            continue
        raw = properties.raw
        pieces += [_PUBLISH_HEAD.pack(spec.FRAME_METHOD, number, 9 + len(exchange_bytes) + len(routing_key),
                                      60, 40, 0),
                   bytes((len(exchange_bytes),)), exchange_bytes, bytes((len(routing_key),)), routing_key,
                   b"\x01\xce" if mandatory else b"\x00\xce",
                   _CONTENT_FRAME_HEAD.pack(spec.FRAME_HEADER, number, 12 + len(raw), 60, 0, len(body)), raw,
                   b"\xce"]
        frames += 2
        if body:
            pieces += [_BODY_FRAME_HEAD.pack(spec.FRAME_BODY, number, len(body)), body, b"\xce"]
            frames += 1
    _emit(connection, pieces, frames)


def _emit(connection: WireConnection, pieces: List[bytes], frames: int) -> None:
    if pieces:
        data_out = b"".join(pieces)
        connection.bytes_sent += len(data_out)
        connection.frames_sent += frames
        connection._adapter_emit_data(data_out)

