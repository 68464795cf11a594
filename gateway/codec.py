"""Make pika carry floating-point header values faithfully, both ways.

pika decodes AMQP floats ('f') and doubles ('d') by truncating them to integers (1.5 -> 1)
and cannot encode a Python float at all. A gateway must hand every header back exactly as
it came, and any Java or Go client can send a double, so both directions are corrected
here: doubles decode to floats and floats encode as doubles (RabbitMQ's field tables carry
'd' natively). pika's table codec looks these functions up as module globals, so replacing
them covers nested tables and arrays too. Installed once by main(); not at import time.
"""

import struct

from pika import data

_encode_value, _decode_value = data.encode_value, data.decode_value


def encode_value(pieces, value):
    if isinstance(value, float):
        pieces.append(struct.pack(">cd", b"d", value))
        return 9
    return _encode_value(pieces, value)


def decode_value(encoded, offset):
    kind = encoded[offset:offset + 1]
    if kind == b"d":
        return struct.unpack_from(">d", encoded, offset + 1)[0], offset + 9
    if kind == b"f":
        return struct.unpack_from(">f", encoded, offset + 1)[0], offset + 5
    return _decode_value(encoded, offset)


def install() -> None:
    data.encode_value, data.decode_value = encode_value, decode_value
