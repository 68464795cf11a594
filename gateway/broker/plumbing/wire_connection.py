"""A fast SelectConnection: it parses its frames itself and writes them out corked.

A connection made here (`WireConnection`, or `blocking()` for a BlockingConnection) decodes
content headers itself: its messages arrive with `WireProperties`
(lazy_properties.py), which keep the exact bytes, where pika would decode them into
Python values it may truncate or fail on. Nothing in pika is changed: other connections in
the same process keep pika's behaviour.

A `WireConnection` also writes less often: pika hands the transport each frame on its own
and sends one buffer per system call, on the poll after the one that made it (a publish is
three sends, an ack one, each a TCP segment the broker reads on its own). Inside its `cork`
(every batch of frames read, and each of the gateway's own events) the frames wait, and
go out at the end in one `send` at once, the way the broker's own writer batches. And it
reads more at once: pika's transport takes 4 KiB a `recv` (three 1 KB deliveries, each
read a cork of its own); a WireConnection's takes up to READ_BYTES, what a busy socket
holds at a wake-up, so that one read and one write serve them all.

This leans on pika internals, pinned in pyproject.toml and checked by tests/test_codec.py:
`Connection._read_frame` (where a connection decodes a frame), `frame.decode_frame` and
`frame.Header` (the frame it builds), BlockingConnection's `_impl_class` (the
SelectConnection class it drives), `_on_data_available` and `_adapter_emit_data` (frames in
and out), `_proto_connection_made` (where it meets its transport) and the plaintext
transport's socket, buffer and read size (`_sock`, `get_write_buffer_size`,
`_MAX_RECV_BYTES`).
"""

import contextlib
import socket
import struct
from typing import Any, Callable, Dict, List, Optional, Tuple, Union

import pika
from pika import frame, spec
from pika.exceptions import InvalidFrameError

from gateway.broker.plumbing.lazy_properties import WireProperties
from gateway.core import wire

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
READ_BYTES = 131_072  # what one recv takes (pika reads at most 100 KiB a wake-up before its timers)
_METHOD_HEAD = struct.Struct(">HH")  # class id, method id
_TAG_AND_BITS = struct.Struct(">QB")  # delivery tag, then a bit field (redelivered; multiple)
_BODY_SIZE = struct.Struct(">Q")
_FRAME_END = spec.FRAME_END


def _short_string(buffer: bytes, at: int) -> Tuple[Union[str, bytes], int]:
    """pika's data.decode_short_string: str where it is UTF-8, else the bytes."""
    end = at + 1 + buffer[at]
    return _text(buffer[at + 1:end]), end


def _text(value: bytes) -> Union[str, bytes]:
    try:
        return value.decode("utf-8")
    except UnicodeDecodeError:
        return value


# A delivery as `consume` hands it over: delivery tag, redelivered, exchange (as pika gives it:
# str, or bytes where it is not UTF-8), routing key (its bytes), properties (their bytes),
# body; those of one read together, in order.
RawDelivery = Tuple[int, bool, Any, bytes, wire.Properties, bytes]
OnDeliveries = Callable[[List[RawDelivery]], None]


class WireConnection(pika.SelectConnection):
    """A SelectConnection whose messages arrive with WireProperties, and whose frames go out
    together (`cork`).

    Its two busiest frames skip pika's dispatch: a whole basic.deliver (one up to
    WAIT_FOR_WHOLE_DELIVERY bytes waits for the read that completes it) goes straight to
    the channel's consumer callback (or, for a consumer started with `consume`, with the
    other deliveries of its read to `on_deliveries`), and a basic.ack or
    basic.nack to the callback `confirm_delivery` (below) registered; each with exactly the
    arguments pika would pass. pika's own path (callback manager, content assembler, one
    slice of the read buffer per frame) cost the gateway about a quarter of its CPU. Every
    other frame, and these when anything is unusual (a closing channel, a cancelled
    consumer, a larger message split across reads), takes pika's path."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.cork = Cork(self)  # (before pika's __init__, which may already write)
        self.confirm_callbacks: Dict[int, Tuple[Any, Any]] = {}  # channel number -> (channel, callback)
        # (channel number, consumer tag) -> (channel, callback): `consume` below
        self.delivery_callbacks: Dict[Tuple[int, Union[str, bytes]], Tuple[Any, OnDeliveries]] = {}
        # the deliveries of one read for one of them, handed over as the read is done
        self._gathered: List[RawDelivery] = []
        self._gathered_for: Optional[OnDeliveries] = None
        super().__init__(*args, **kwargs)

    def _proto_connection_made(self, transport: Any) -> None:
        if getattr(transport, "_MAX_RECV_BYTES", None) is not None:
            transport._MAX_RECV_BYTES = READ_BYTES  # (this transport only: pika's others read as they did)
        super()._proto_connection_made(transport)

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
        self._gathered, self._gathered_for = [], None  # (what a read that raised left: never handed over)
        result = self._fast_frames_of(buffer)
        self._hand_over()
        return result

    def _hand_over(self) -> None:
        """The deliveries gathered for one consumer (`consume`) go to it, together."""
        on_deliveries, gathered = self._gathered_for, self._gathered
        if gathered and on_deliveries is not None:
            self._gathered, self._gathered_for = [], None
            on_deliveries(gathered)

    def _fast_frames_of(self, buffer: bytes) -> Tuple[int, bool]:
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
            self._hand_over()  # (what came before it, first)
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
        routing_key = buffer[at + 1:at + 1 + buffer[at]]
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
        body = parts[0] if len(parts) == 1 else b"".join(parts)
        registered = self.delivery_callbacks.get((channel_number, consumer_tag))
        if registered is not None and registered[0] is channel:
            if self._gathered_for is not registered[1]:
                self._hand_over()
                self._gathered_for = registered[1]
            self._gathered.append((delivery_tag, bool(bits & 1), exchange, routing_key, props, body))
            return at
        self._hand_over()
        method = spec.Basic.Deliver(consumer_tag, delivery_tag, bool(bits & 1), exchange, _text(routing_key))
        callback(channel, method, WireProperties(props), body)
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


def confirm_delivery(channel: Any, on_confirm: Any, callback: Any = None) -> None:
    """channel.confirm_delivery, with the confirms taken on the fast path where the channel
    is a WireConnection's."""
    channel.confirm_delivery(on_confirm, callback=callback)
    connection = channel.connection
    if isinstance(connection, WireConnection):
        connection.confirm_callbacks[channel.channel_number] = (channel, on_confirm)


def consume(channel: Any, queue: str, on_deliveries: OnDeliveries, on_message: Any, callback: Any,
            arguments: Dict[str, Any]) -> str:
    """channel.basic_consume(queue, on_message, ...); on a WireConnection's channel, whole
    deliveries on the fast path go to `on_deliveries` instead, those of one read together
    (before any other frame of it), with the routing key's bytes and no pika objects made
    for them (a delivery pika assembles still goes to `on_message`)."""
    tag: str = channel.basic_consume(queue, on_message, callback=callback, arguments=arguments)
    connection = channel.connection
    if isinstance(connection, WireConnection):
        connection.delivery_callbacks[(channel.channel_number, tag)] = (channel, on_deliveries)
    return tag


def cork(connection: object) -> "contextlib.AbstractContextManager[None]":
    """The connection's `cork` where it has one (tests' fakes do not)."""
    found = getattr(connection, "cork", None)
    return found if isinstance(found, Cork) else contextlib.nullcontext()


def blocking(parameters: pika.ConnectionParameters) -> pika.BlockingConnection:
    """A BlockingConnection whose messages arrive with WireProperties."""
    return pika.BlockingConnection(parameters, _impl_class=WireConnection)
