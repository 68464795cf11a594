"""pika, made to carry every message exactly and to survive any message: on the gateway's
own connections only.

pika decodes content properties into Python values: it truncates floats and doubles to
integers, forgets the wire type of every header (a short int comes back as a long one),
and raises inside the connection on values it cannot represent (an AMQP timestamp past the
year 9999), which closes the connection and redelivers everything the gateway holds. A
connection made here (`WireConnection`, or `blocking()` for a BlockingConnection) decodes
content headers itself instead: its messages arrive with `WireProperties`, which keep the
exact bytes (`properties.wire`, a `wire.Properties`) and decode the Python attributes only
when something reads them, with values pika cannot represent left as `wire.Opaque` instead
of failing. Sent, `WireProperties` are these bytes exactly; `encoded()` turns pika properties
with Python values into them, a Python float as an AMQP double (pika cannot encode floats).
Nothing in pika is changed: other connections in the same process keep pika's behaviour.

A `WireConnection` also writes less often: pika hands the transport each frame on its own
and sends one buffer per system call, on the poll after the one that made it (a publish is
three sends, an ack one, each a TCP segment the broker reads on its own). Inside its `cork`
(every batch of frames read, and each of the gateway's own events) the frames wait, and
go out at the end in one `send` at once, the way the broker's own writer batches.

This leans on pika internals, pinned in pyproject.toml and checked by tests/test_codec.py:
`Connection._read_frame` (where a connection decodes a frame), `frame.decode_frame` and
`frame.Header` (the frame it builds), BlockingConnection's `_impl_class` (the
SelectConnection class it drives), `_on_data_available` and `_adapter_emit_data` (frames in
and out) and the plaintext transport's socket and buffer (`_sock`, `get_write_buffer_size`).
"""

import contextlib
import socket
import struct
from typing import Any, Dict, List, Optional, Tuple, Union

import pika
from pika import data, frame, spec
from pika.exceptions import InvalidFrameError

from gateway.core import wire
from gateway.core.wire import Properties


class WireProperties(spec.BasicProperties):
    """Properties as exact bytes (`wire`); the pika attributes decode from them when read.
    Sent as they are (`encode` returns the bytes)."""

    wire: Properties

    def __init__(self, props: Properties) -> None:  # pylint: disable=super-init-not-called
        self.__dict__["wire"] = props

    def __getattr__(self, name: str) -> Any:
        """Only reached for attributes not decoded yet."""
        props = self.__dict__.get("wire")
        if props is None or name.startswith("__") or name not in wire.FIELDS:
            raise AttributeError(name)
        values = props.values
        for field in wire.FIELDS:
            value = values.get(field)
            if field == "headers":
                value = value.to_dict() if value is not None else None
            elif isinstance(value, bytes):
                try:
                    value = value.decode("utf-8")
                except UnicodeDecodeError:
                    pass
            self.__dict__.setdefault(field, value)
        return self.__dict__[name]

    def encode(self) -> List[bytes]:
        return [self.wire.raw]

    def decode(self, encoded: bytes, offset: int = 0) -> "WireProperties":
        self.__dict__.clear()
        self.__dict__["wire"] = wire.Properties.parse(bytes(encoded[offset:]))
        return self


# -- receiving -------------------------------------------------------------------------------
_FRAME_HEAD = struct.Struct(">BHL")  # frame type, channel, payload size
_CONTENT_HEAD = struct.Struct(">HHQ")  # class id, weight, body size


def decode_frame(buffer: bytes) -> Tuple[int, Any]:
    """pika's frame.decode_frame, except that a content header keeps its bytes."""
    if len(buffer) < _FRAME_HEAD.size or buffer[0] != spec.FRAME_HEADER:
        return frame.decode_frame(buffer)
    _, channel, size = _FRAME_HEAD.unpack_from(buffer)
    end = _FRAME_HEAD.size + size + 1
    if end > len(buffer):
        return 0, None
    if buffer[end - 1] != spec.FRAME_END:
        raise InvalidFrameError("Invalid FRAME_END marker")
    _, _, body_size = _CONTENT_HEAD.unpack_from(buffer, _FRAME_HEAD.size)
    props = wire.Properties.parse(bytes(buffer[_FRAME_HEAD.size + _CONTENT_HEAD.size:end - 1]))
    return end, frame.Header(channel, body_size, WireProperties(props))


class Cork:
    """While entered (nested: the outermost), a WireConnection's frames wait; on leaving they
    go out together. Reentered for every event, so a plain class: no generator per use."""

    __slots__ = ("_connection", "_depth", "frames")

    def __init__(self, connection: "WireConnection") -> None:
        self._connection, self._depth = connection, 0
        self.frames: List[bytes] = []

    def __enter__(self) -> None:
        self._depth += 1

    def __exit__(self, *exc: object) -> None:
        self._depth -= 1
        if self._depth == 0 and self.frames:
            frames, self.frames = self.frames, []
            self._connection._write_now(frames[0] if len(frames) == 1 else b"".join(frames))

    @property
    def on(self) -> bool:
        return self._depth > 0


WAIT_FOR_WHOLE_DELIVERY = 262_144  # bytes: a delivery up to this size is read whole
_METHOD_HEAD = struct.Struct(">HH")  # class id, method id
_TAG_AND_BITS = struct.Struct(">QB")  # delivery tag, then a bit field (redelivered; multiple)
_BODY_SIZE = struct.Struct(">Q")
_FRAME_END = spec.FRAME_END


def _short_string(buffer: bytes, at: int) -> Tuple[Union[str, bytes], int]:
    """pika's data.decode_short_string: str where it is UTF-8, else the bytes."""
    end = at + 1 + buffer[at]
    value = buffer[at + 1:end]
    try:
        return value.decode("utf-8"), end
    except UnicodeDecodeError:
        return value, end


class WireConnection(pika.SelectConnection):
    """A SelectConnection whose messages arrive with WireProperties, and whose frames go out
    together (`cork`).

    Its two busiest frames skip pika's dispatch: a whole basic.deliver (one up to
    WAIT_FOR_WHOLE_DELIVERY bytes waits for the read that completes it) goes straight to
    the channel's consumer callback, and a basic.ack or
    basic.nack to the callback `confirm_delivery` (below) registered; each with exactly the
    arguments pika would pass. pika's own path (callback manager, content assembler, one
    slice of the read buffer per frame) cost the gateway about a quarter of its CPU. Every
    other frame, and these when anything is unusual (a closing channel, a cancelled
    consumer, a larger message split across reads), takes pika's path."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.cork = Cork(self)  # (before pika's __init__, which may already write)
        self.confirm_callbacks: Dict[int, Tuple[Any, Any]] = {}  # channel number -> (channel, callback)
        super().__init__(*args, **kwargs)

    def _read_frame(self) -> Tuple[int, Any]:
        return decode_frame(self._frame_buffer)

    def _on_data_available(self, data_in: bytes) -> None:
        with self.cork:  # what the frames read make us send: one write
            self._frame_buffer += data_in
            while self._frame_buffer:
                taken, wait = self._fast_frames(self._frame_buffer)
                if taken:
                    self._trim_frame_buffer(taken)
                if wait:  # a small delivery not all read yet: the next read completes it
                    return
                if taken:
                    continue
                consumed, frame_value = self._read_frame()  # pika's way, one frame
                if not frame_value:
                    return
                self._trim_frame_buffer(consumed)
                self._process_frame(frame_value)

    def _fast_frames(self, buffer: bytes) -> Tuple[int, bool]:
        """Handle the deliveries and confirms at the start of `buffer`: how many bytes, and
        whether to wait for the next read to complete a delivery."""
        at, size, handled, wait = 0, len(buffer), 0, False
        while at + 11 <= size and buffer[at] == spec.FRAME_METHOD and self.is_open:
            channel_number, frame_size = _FRAME_HEAD.unpack_from(buffer, at)[1:]
            end = at + 7 + frame_size
            if end >= size or buffer[end] != _FRAME_END:
                break
            class_id, method_id = _METHOD_HEAD.unpack_from(buffer, at + 7)
            if class_id != 60:
                break
            if method_id == 60:
                after = self._deliver(buffer, at + 11, end + 1, channel_number, size)
                if after <= 0:
                    # (a large one goes to pika frame by frame: held here, the buffer would
                    # be copied on every read until it is whole)
                    wait = after < 0 and size - at <= WAIT_FOR_WHOLE_DELIVERY
                    break
                at, handled = after, handled + 1
                continue
            if method_id not in (80, 120):  # basic.ack, basic.nack
                break
            registered = self.confirm_callbacks.get(channel_number)
            channel = self._channels.get(channel_number)
            if registered is None or registered[0] is not channel or not channel.is_open:
                break
            tag, bits = _TAG_AND_BITS.unpack_from(buffer, at + 11)
            method = spec.Basic.Ack(tag, bool(bits & 1)) if method_id == 80 else \
                spec.Basic.Nack(tag, bool(bits & 1), bool(bits & 2))
            at, handled = end + 1, handled + 1
            registered[1](frame.Method(channel_number, method))
        self.frames_received += handled
        return at, wait

    def _deliver(self, buffer: bytes, args: int, header: int, channel_number: int, size: int) -> int:
        """A whole basic.deliver (method, header, body frames) from `buffer` to its consumer:
        where it ends; -1 when the buffer ends before it does, 0 when pika must take it."""
        channel = self._channels.get(channel_number)
        if channel is None or not channel.is_open:
            return 0
        consumer_tag, at = _short_string(buffer, args)
        callback = channel._consumers.get(consumer_tag)
        if callback is None or consumer_tag in channel._cancelled:
            return 0
        delivery_tag, bits = _TAG_AND_BITS.unpack_from(buffer, at)
        exchange, at = _short_string(buffer, at + 9)
        routing_key, _ = _short_string(buffer, at)
        if header + 7 > size:
            return -1
        if buffer[header] != spec.FRAME_HEADER:
            return 0
        ch, frame_size = _FRAME_HEAD.unpack_from(buffer, header)[1:]
        end = header + 7 + frame_size
        if end >= size:
            return -1
        if ch != channel_number or buffer[end] != _FRAME_END:
            return 0
        body_size = _BODY_SIZE.unpack_from(buffer, header + 11)[0]
        props = wire.Properties.parse(buffer[header + 7 + _CONTENT_HEAD.size:end])
        at, parts, seen, frames = end + 1, [], 0, 2
        while seen < body_size:
            if at + 7 > size:
                return -1
            if buffer[at] != spec.FRAME_BODY:
                return 0
            ch, frame_size = _FRAME_HEAD.unpack_from(buffer, at)[1:]
            end = at + 7 + frame_size
            if end >= size:
                return -1
            if ch != channel_number or buffer[end] != _FRAME_END or seen + frame_size > body_size:
                return 0
            parts.append(buffer[at + 7:end])
            seen, at, frames = seen + frame_size, end + 1, frames + 1
        self.frames_received += frames - 1  # (the caller counts one)
        method = spec.Basic.Deliver(consumer_tag, delivery_tag, bool(bits & 1), exchange, routing_key)
        callback(channel, method, WireProperties(props), parts[0] if len(parts) == 1 else b"".join(parts))
        return at

    def _adapter_emit_data(self, data_out: bytes) -> None:
        if self.cork.on:
            self.cork.frames.append(data_out)
        else:
            super()._adapter_emit_data(data_out)

    def _write_now(self, data_out: bytes) -> None:
        """Send at once what the socket takes; the transport keeps the rest for when it can
        write. Only when nothing waits before it, and on a plain socket (TLS: the transport)."""
        transport = self._transport
        sock = getattr(transport, "_sock", None)
        if transport is None or type(sock) is not socket.socket or transport.get_write_buffer_size() \
                or getattr(transport, "_state", None) != getattr(transport, "_STATE_ACTIVE", object()):
            if transport is not None:
                super()._adapter_emit_data(data_out)
            return
        try:
            sent = sock.send(data_out)
        except OSError:  # would block, or an error the transport meets too and reports its way
            sent = 0
        if sent < len(data_out):
            super()._adapter_emit_data(data_out[sent:])


_PUBLISH_HEAD = struct.Struct(">BHLHHH")  # method frame head; basic.publish; ticket 0
_CONTENT_FRAME_HEAD = struct.Struct(">BHLHHQ")  # header frame head; class 60, weight 0, body size


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
        pieces += [_FRAME_HEAD.pack(spec.FRAME_BODY, number, len(body)), body, b"\xce"]
        frames = 3
    data_out = b"".join(pieces)
    connection.bytes_sent += len(data_out)
    connection.frames_sent += frames
    connection._adapter_emit_data(data_out)


def confirm_delivery(channel: Any, on_confirm: Any, callback: Any = None) -> None:
    """channel.confirm_delivery, with the confirms taken on the fast path where the channel
    is a WireConnection's."""
    channel.confirm_delivery(on_confirm, callback=callback)
    connection = channel.connection
    if isinstance(connection, WireConnection):
        connection.confirm_callbacks[channel.channel_number] = (channel, on_confirm)


def cork(connection: object) -> "contextlib.AbstractContextManager[None]":
    """The connection's `cork` where it has one (tests' fakes do not)."""
    found = getattr(connection, "cork", None)
    return found if isinstance(found, Cork) else contextlib.nullcontext()


def blocking(parameters: pika.ConnectionParameters) -> pika.BlockingConnection:
    """A BlockingConnection whose messages arrive with WireProperties."""
    return pika.BlockingConnection(parameters, _impl_class=WireConnection)


# -- sending properties with Python values -----------------------------------------------------
def encode_table(pieces: List[bytes], table: Optional[Dict[str, Any]]) -> int:
    """pika's data.encode_table, with floats (at any depth) as doubles."""
    at = len(pieces)
    pieces.append(b"")
    size = 0
    for key, value in (table or {}).items():
        size += data.encode_short_string(pieces, key)
        size += _encode_value(pieces, value)
    pieces[at] = struct.pack(">I", size)
    return size + 4


def _encode_value(pieces: List[bytes], value: Any) -> int:
    if isinstance(value, float):
        pieces.append(struct.pack(">cd", b"d", value))
        return 9
    if isinstance(value, dict):
        pieces.append(b"F")
        return 1 + encode_table(pieces, value)
    if isinstance(value, list):
        items: List[bytes] = []
        for item in value:
            _encode_value(items, item)
        piece = b"".join(items)
        pieces.append(struct.pack(">cI", b"A", len(piece)))
        pieces.append(piece)
        return 5 + len(piece)
    return int(data.encode_value(pieces, value))


def _has_float(value: Any) -> bool:
    if isinstance(value, float):
        return True
    if isinstance(value, dict):
        return any(_has_float(v) for v in value.values())
    return isinstance(value, list) and any(_has_float(v) for v in value)


def encoded(props: Union[spec.BasicProperties, wire.Properties, None]) -> spec.BasicProperties:
    """Properties to send: pika's with Python values (floats as doubles), or bytes as they are.
    (pika's own when it can encode them: most publishes, at no extra cost.)"""
    if isinstance(props, WireProperties):
        return props
    if isinstance(props, wire.Properties):
        return WireProperties(props)
    if props is None:
        return WireProperties(wire.Properties.build())
    if not _has_float(props.headers):
        return props
    plain = spec.BasicProperties(**{f: getattr(props, f) for f in wire.FIELDS if f != "headers"})
    values = wire.Properties.parse(b"".join(plain.encode()))
    if props.headers is None:
        return WireProperties(values)
    pieces: List[bytes] = []
    encode_table(pieces, props.headers)
    return WireProperties(values.replace(headers=wire.Table.parse(b"".join(pieces)[4:])))


def to_wire(props: Union[spec.BasicProperties, wire.Properties, None]) -> Properties:
    """The bytes `encoded(props)` sends, as a wire.Properties."""
    out = encoded(props)
    return out.wire if isinstance(out, WireProperties) else Properties.parse(b"".join(out.encode()))
