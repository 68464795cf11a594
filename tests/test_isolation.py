"""Messages that once crashed the gateway, made it reconnect in a loop, lost their key or
let a publisher steer it, sent beside ordinary traffic. Each
must arrive at pick-up exactly as sent, or be parked with a reason, without touching any
other message: no crash, no reconnect, no copy, nothing late."""

import json
import struct
import subprocess
import sys
import time

import pika
import pytest

from gateway.broker.plumbing import lazy_properties
from gateway.core.wire import Properties, Table

from .support import (ROOT, START_NOTICES, Receiver, broker_url, chain_args, connect, now_ms, publish_sentinel,
                      same_entries)

ORDINARY = 25


def raw_table(*entries) -> Table:
    """A header table written byte by byte: values pika cannot encode, names that are not UTF-8."""
    return Table.parse(b"".join(bytes([len(n)]) + n + kind + value for n, kind, value in entries))


def long_int(n: int) -> bytes:
    return struct.pack(">i", n)


def text(s: bytes) -> bytes:
    return struct.pack(">I", len(s)) + s


POISON = {
    # 1: crashed the process (pika asserted the expiration was a str)
    "int-expiration": (b"p.1", Properties.build(headers=raw_table(
        (b"x-delay", b"I", long_int(600)), (b"x-gateway-expiration", b"I", long_int(5000))))),
    # 2: made the broker close the channel at pick-up (406), again and again
    "text-expiration": (b"p.2", Properties.build(headers=raw_table(
        (b"x-delay", b"I", long_int(300)), (b"x-gateway-expiration", b"S", text(b"abc"))))),
    # 2: pika could not decode it, inside the connection
    "year-10000": (b"p.3", Properties.build(headers=raw_table(
        (b"x-delay", b"I", long_int(300)), (b"when", b"T", struct.pack(">Q", 2**62))))),
    # 4: a routing key in the header longer than AMQP allows sat in the distributor forever
    "long-key-header": (b"p.4", Properties.build(headers=raw_table(
        (b"x-delay", b"I", long_int(300)), (b"x-gateway-routing-key", b"S", text(b"k" * 300))))),
    # 4: a routing key that is not UTF-8 was parked under the bit key
    "binary-key": (b"p.\xff\xfe", Properties.build(headers=raw_table((b"x-delay", b"I", long_int(300))))),
    # 4: a header name that is not UTF-8 failed the handler; the delay was never applied
    "binary-name": (b"p.6", Properties.build(headers=raw_table(
        (b"x-delay", b"I", long_int(700)), (b"\xffname", b"b", b"\x01")))),
    # 5: a forged due time came out 4 s early; forged key and expiration rewrote the message
    "forged": (b"p.7", Properties.build(expiration=b"60000", headers=raw_table(
        (b"x-delay", b"I", long_int(1500)), (b"x-gateway-due-at", b"l", struct.pack(">q", 1)),
        (b"x-gateway-routing-key", b"S", text(b"elsewhere")), (b"x-gateway-expiration", b"S", text(b"1"))))),
}
DELAYS = {"int-expiration": 600, "text-expiration": 300, "year-10000": 300, "long-key-header": 300,
          "binary-key": 300, "binary-name": 700, "forged": 1500}


def same_as_sent(got: Properties, sent: Properties) -> bool:
    """Exactly as sent, but for what the broker itself may add on arrival (RabbitMQ 3.12+
    interceptor: a timestamp_in_ms header, and the timestamp property when there was none)."""
    fields = {k: v for k, v in got.values.items() if k != "headers"}
    if sent.get("timestamp") is None:
        fields.pop("timestamp", None)
    return same_entries(got.headers, sent.headers) and \
        fields == {k: v for k, v in sent.values.items() if k != "headers"}


def test_hostile_messages_beside_ordinary_traffic(make_chain, run_gateway):
    chain = make_chain(max_level=3, resolution_ms=100)
    gateway = run_gateway(chain)
    receiver = Receiver(chain, "#")
    sent_at = {}
    with connect() as c:
        ch = c.channel()
        ch.confirm_delivery()
        for i, (name, (key, props)) in enumerate(POISON.items()):
            sent_at[name] = now_ms()
            ch.basic_publish(chain.names.check_in, key, name.encode(), lazy_properties.WireProperties(props),
                             mandatory=True)
            for j in range(ORDINARY // len(POISON) + 1):
                n = i * 10 + j
                sent_at[f"o{n}"] = now_ms()
                ch.basic_publish(chain.names.check_in, f"ordinary.{n}", f"o{n}".encode(), pika.BasicProperties(
                    headers={"x-delay": 200 + 37 * n % 700}, message_id=f"o{n}"), mandatory=True)
    # nothing more may come: a sentinel behind them all, due after the longest delay
    publish_sentinel(chain, max(DELAYS.values()))
    got = receiver.until_sentinel(20)
    bodies = [m.body.decode() for m in got]
    assert sorted(bodies) == sorted(sent_at), "every message exactly once"
    for m in got:
        name = m.body.decode()
        if name in POISON:
            key, props = POISON[name]
            assert m.properties.wire.raw and same_as_sent(m.properties.wire, props), name
            assert (m.routing_key if isinstance(m.routing_key, bytes) else m.routing_key.encode()) == key, name
            assert m.at_ms >= sent_at[name] + DELAYS[name], f"{name} early"
        else:
            assert m.at_ms >= sent_at[name] + m.properties.headers["x-delay"], f"{name} early"
    assert gateway.proc.poll() is None
    assert gateway.metric("delay_gateway_connections_total") == 1, "the gateway reconnected"
    # (beside what the gateway says once at start about the broker it runs on)
    assert not [e for e in gateway.lines if e.get("level") in ("warning", "error")
                and e.get("event") not in START_NOTICES], gateway.raw[-5:]
    # and the parked list still reads (it once failed on the same values)
    r = subprocess.run([sys.executable, "-m", "gateway", "parked", "list", "--json", *chain_args(chain),
                        "--url", broker_url()], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and json.loads(r.stdout)["count"] == 0, r.stderr


def test_the_contract_exchanges_take_any_clients_plain_declare(make_chain):
    chain = make_chain(max_level=2)
    with connect() as c:
        ch = c.channel()
        for name in (chain.names.check_in, chain.names.pick_up):  # what kombu and others do
            ch.exchange_declare(name, "topic", durable=True)


def test_a_publisher_cannot_reach_the_returning_entrance(make_chain):
    chain = make_chain(max_level=2)
    with connect() as c:
        ch = c.channel()
        with pytest.raises(pika.exceptions.ChannelClosedByBroker) as refused:
            ch.basic_publish(chain.names.returning, "", b"forged", pika.BasicProperties(
                headers={"x-gateway-due-at": 1}))
            ch.basic_get(chain.names.returning)  # the refusal arrives on the next round trip
        assert refused.value.reply_code == 403


def test_a_missing_topology_is_one_line_and_an_exit_not_a_loop(broker):
    start = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "gateway", "run", "--no-declare", "--prefix", "nosuchprefix",
                        "--url", broker_url(), "--log-format", "json"],
                       cwd=ROOT, capture_output=True, text=True, timeout=60)
    took = time.monotonic() - start
    assert r.returncode == 3
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("delay-gateway run: ") and "nosuchprefix" in last and "delay-gateway declare" in last
    assert len(r.stderr.splitlines()) < 30 and took < 20, (took, r.stderr)


def test_run_without_declaring_names_a_missing_internal_exchange(make_chain):
    """A 3.10 definitions export leaves out internal exchanges: imported alone, the chain lacks
    its `returning` entrance, and messages longer than the chain would be dropped there."""
    chain = make_chain(max_level=2)
    with connect() as c:
        c.channel().exchange_delete(chain.names.returning)
    r = subprocess.run([sys.executable, "-m", "gateway", "run", "--no-declare", *chain_args(chain),
                        "--url", broker_url(), "--log-format", "json"],
                       cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 3, r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("delay-gateway run: ") and repr(chain.names.returning) in last, last
    assert "delay-gateway declare" in last
