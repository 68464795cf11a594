"""Content properties kept as their exact bytes, decoded into pika's Python values only when read.

pika decodes content properties into Python values: it truncates floats and doubles to
integers, forgets the wire type of every header (a short int comes back as a long one),
and raises inside the connection on values it cannot represent (an AMQP timestamp past the
year 9999), which closes the connection and redelivers everything the gateway holds.
`WireProperties` keep the exact bytes instead (`properties.wire`, a `wire.Properties`) and
decode the Python attributes only when something reads them, with values pika cannot
represent left as `wire.Opaque` instead of failing. Sent, `WireProperties` are these bytes
exactly; `encoded()` turns pika properties with Python values into them, a Python float as
an AMQP double (pika cannot encode floats). The gateway's connections
(wire_connection.py) deliver their messages with them.
"""

import struct
from typing import Any, Dict, List, Optional, Union

from pika import data, spec

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



# -- sending properties with Python values ---------------------------------------------------
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
