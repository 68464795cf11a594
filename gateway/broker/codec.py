"""pika, made to carry every message exactly and to survive any message.

pika decodes content properties into Python values: it truncates floats and doubles to
integers, forgets the wire type of every header (a short int comes back as a long one),
and raises inside the connection on values it cannot represent (an AMQP timestamp past the
year 9999), which closes the connection and redelivers everything the gateway holds. Here
pika's decoder is replaced by one that keeps the exact bytes (`properties.wire`, a
`wire.Properties`) and decodes the Python attributes only when something reads them, with
values it cannot represent left as `wire.Opaque` instead of failing. `RawProperties` sends
bytes exactly as given. On the way out, a Python float encodes as an AMQP double (pika
cannot encode floats at all). Installed once by main() and by the tests; not at import.
"""

import struct

from pika import data, spec

from gateway.core import wire

_encode_value = data.encode_value


def encode_value(pieces, value):
    if isinstance(value, float):
        pieces.append(struct.pack(">cd", b"d", value))
        return 9
    return _encode_value(pieces, value)


def _decode(self, encoded, offset=0):
    """BasicProperties.decode: keep the bytes; decode the attributes later, on demand."""
    self.__dict__.clear()
    self.__dict__["wire"] = wire.Properties.parse(bytes(encoded[offset:]))
    return self


def _attributes(self, name):
    """BasicProperties.__getattr__: only reached for attributes not decoded yet."""
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


class WireProperties(spec.BasicProperties):
    """What the consumer's callbacks receive: `wire` holds the exact bytes."""

    wire: wire.Properties


class RawProperties(spec.BasicProperties):
    """Properties sent as exactly these bytes (a `wire.Properties`)."""

    def __init__(self, props: wire.Properties) -> None:  # pylint: disable=super-init-not-called
        self.__dict__["wire"] = props  # the attributes decode from it when read

    def encode(self):
        return [self.wire.raw]


def install() -> None:
    data.encode_value = encode_value
    spec.BasicProperties.decode = _decode
    spec.BasicProperties.__getattr__ = _attributes
