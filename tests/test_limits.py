"""What the broker or check-in would refuse is refused before sending (pure: the `publish`
runs below point at a port where no broker listens, so exit 2 proves nothing was sent)."""

import os
import socket
import subprocess
import sys

import pytest

from gateway.core import limits
from gateway.core.envelope import MAX_AHEAD_MS

from .support import ROOT

NOW = 1_800_000_000_000


@pytest.mark.parametrize("check,says", [
    (lambda: limits.short_string("the routing key", "k" * 256), "256 bytes; AMQP allows at most 255"),
    (lambda: limits.short_string("the message id", "é" * 128), "256 bytes"),
    (lambda: limits.delay_ms(10**20), "beyond the gateway's range"),
    (lambda: limits.delay_ms(MAX_AHEAD_MS + 1), "beyond the gateway's range"),
    (lambda: limits.delay_ms(-2**63 - 1), "64-bit"),
    (lambda: limits.deliver_at_ms(1_700_000_000, NOW), "looks like epoch seconds"),
    (lambda: limits.deliver_at_ms(5, NOW), "before 1973"),
    (lambda: limits.deliver_at_ms(NOW + MAX_AHEAD_MS + 1, NOW), "1000 years ahead"),
    (lambda: limits.header("n", 2**70), "does not fit a 64-bit integer"),
    (lambda: limits.header("n", [1, {"deep": -2**64}]), "n.deep: -18446744073709551616 does not fit"),
    (lambda: limits.header("n", float("inf")), "not a finite number"),
    (lambda: limits.header("h" * 256, 1), "header name"),
])
def test_refused_with_the_reason(check, says):
    with pytest.raises(limits.Refused, match=says):
        check()


def test_what_the_broker_and_check_in_take_passes():
    limits.message("k" * 255, "i" * 255, {"n": 2**63 - 1, "m": -2**63, "f": 1.5, "l": [1, "a", None]},
                   MAX_AHEAD_MS, None, NOW)
    limits.message("", None, None, None, NOW + MAX_AHEAD_MS, NOW)
    assert limits.delay_ms(-5) == -5  # the contract: 0 or less is due now
    assert limits.deliver_at_ms(100_000_000_000, NOW) == 100_000_000_000  # the past: due now


@pytest.fixture(scope="module")
def nowhere():
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))  # bound, never listening: a publish that got this far would exit 1
    yield f"amqp://guest:guest@127.0.0.1:{sock.getsockname()[1]}/%2F"
    sock.close()


def publish(url: str, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DELAY_GATEWAY_")}
    return subprocess.run([sys.executable, "-m", "gateway", "publish", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=60, env={**env, "DELAY_GATEWAY_URL": url})


@pytest.mark.parametrize("args,says", [
    (["--routing-key", "k" * 300], "--routing-key is 300 bytes; AMQP allows at most 255"),
    (["--message-id", "m" * 300], "--message-id is 300 bytes"),
    (["--delay", "99999999999999999999"], "--delay 99999999999999999999 ms is beyond the gateway's range"),
    (["--header", f"n={2**70}"], f"header n: {2**70} does not fit a 64-bit integer"),
    (["--at", "1700000000"], "--at 1700000000 looks like epoch seconds"),
])
def test_publish_refuses_before_sending_in_one_line(nowhere, args, says):
    r = publish(nowhere, *args)
    assert r.returncode == 2, r.stderr
    assert r.stderr.count("\n") == 1 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.startswith("delay-gateway publish: error: ") and says in r.stderr, r.stderr


def test_a_negative_delay_is_said_to_be_due_now(nowhere):
    r = publish(nowhere, "--delay", "-5")
    assert r.returncode == 1  # accepted (the contract: 0 or less is due now), then no broker
    assert r.stderr.splitlines()[0] == "delay-gateway publish: note: --delay -5 is 0 or less: the message is due now"
