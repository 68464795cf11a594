"""Reading the broker's version from its server properties (pure; the probe itself runs
against real brokers in tests/faults/test_stamp_notice.py and tests/test_arrival_stamp.py)."""

import pytest

from gateway.broker.run.stamp import FIRST_WITH_STAMP, version_of


@pytest.mark.parametrize("properties, version", [
    ({"version": b"3.10.8"}, (3, 10)),
    ({"version": "4.3.6"}, (4, 3)),
    ({"version": b"4.0.5+1.g1234"}, (4, 0)),
    ({"version": b"unknown"}, None),
    ({}, None),
    (None, None),
])
def test_version_of(properties, version):
    assert version_of(properties) == version


def test_the_stamp_exists_from_3_12():
    assert (3, 11) < FIRST_WITH_STAMP <= (3, 12) < (4, 0)
