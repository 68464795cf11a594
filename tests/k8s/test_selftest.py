"""`delay-gateway selftest`, the chart's `helm test`: 1 when no gateway delivered its message
in time (the passing case runs in test_upgrade.py, as the chart's test pod; no gateway at all
is test_cli_errors.py's). About 2 s."""

import json

from ..support import chain_args, connect
from ..test_cli import cli


def test_selftest_fails_when_nothing_delivers(make_chain):
    chain = make_chain(max_level=3, resolution_ms=100)
    # A stuck gateway: check-in and the distributor are consumed, but nothing is ever sent on.
    with connect() as connection:
        channel = connection.channel()
        channel.basic_qos(prefetch_count=1)
        for queue in (chain.names.check_in, chain.names.distributor):
            channel.basic_consume(queue, lambda *_: None)
        r = cli("selftest", *chain_args(chain), "--delay-ms", "100", "--timeout", "0.5")
    assert r.returncode == 1
    assert json.loads(r.stdout.splitlines()[-1])["delivered"] is False
    assert '"event": "selftest_timeout"' in r.stderr
