import struct

import pytest
from pika import BasicProperties, data

from gateway import codec


def roundtrip(headers):
    decoded = BasicProperties()
    decoded.decode(b"".join(BasicProperties(headers=headers).encode()))
    return decoded.headers


@pytest.mark.parametrize("value", [1.5, -0.0, 1e300, float("inf"), [2.25, {"x": -3.5}]])
def test_floats_survive_a_round_trip(value):
    codec.install()
    assert roundtrip({"v": value}) == {"v": value}


def test_single_precision_floats_decode_as_floats():
    codec.install()
    pieces = [b"\x01v", struct.pack(">cf", b"f", 0.5)]
    body = b"".join(pieces)
    table, _ = data.decode_table(struct.pack(">I", len(body)) + body, 0)
    assert table == {"v": 0.5}
