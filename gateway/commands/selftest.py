"""`delay-gateway selftest`: publish one delayed message through the running gateway and wait
for it at pick-up. The Helm chart's `helm test` runs it; it is as useful after any change.

It binds a queue of its own (named under the prefix, so a user limited to `^<prefix>\\.`
may run it; exclusive, so it goes away with the connection) to pick-up with a routing key
no one else uses, publishes with confirms and waits. Exit 0 when the message arrived, not
early; 1 when it did not arrive within --timeout or arrived early, or at once when no gateway
consumes check-in or the distributor (nothing would deliver it).
"""

import argparse
import json
import sys
import time
import uuid
from typing import List

import structlog

from topology import ChainSettings

from gateway.broker.plumbing.amqp import blocking_channel
from gateway.clock import wall_ms
from gateway.broker.tools.publish import Publisher
from gateway.settings import Settings
from gateway.urls import per_vhost

POLL_S = 0.05
CONSUMERS_WAIT_S = 5.0  # for gateways that are starting, before saying none consumes


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--delay-ms", type=int, default=2000, metavar="MS", help="the test message's delay (x-delay)")
    p.add_argument("--timeout", type=float, default=60.0, metavar="SECONDS",
                   help="how long to wait for it after its due time")


def unconsumed(channel, chain: ChainSettings) -> List[str]:
    """The gateway's queues a message must pass that no gateway consumes (a passive declare
    counts consumers; a queue that does not exist is the broker's 404: not declared)."""
    names = chain.names
    return [q for q in (names.check_in, names.distributor)
            if channel.queue_declare(q, passive=True).method.consumer_count == 0]


def main(settings: Settings, delay_ms: int, timeout: float) -> int:
    # (--vhosts: each in turn, as `helm test` checks a release that serves several)
    for _, urls in per_vhost(settings.urls, settings.vhosts):
        code = run(delay_ms, timeout, lambda urls=urls: blocking_channel(urls, "delay-gateway selftest", settings.tls),
                   settings.chain)
        if code:
            return code
    return 0


def run(delay_ms: int, timeout: float, channel_factory, chain: ChainSettings) -> int:
    log = structlog.get_logger("gateway")
    token = uuid.uuid4().hex
    key, queue = f"selftest.{token}", f"{chain.prefix}.selftest.{token}"
    with channel_factory() as channel:
        idle = unconsumed(channel, chain)
        waited_until = time.monotonic() + min(timeout, CONSUMERS_WAIT_S)
        while idle and time.monotonic() < waited_until:  # gateways that are starting
            channel.connection.sleep(POLL_S * 10)
            idle = unconsumed(channel, chain)
        if idle:
            # Waiting out --timeout would only say "not delivered" a minute later.
            print(f"delay-gateway selftest: nothing consumes {' or '.join(idle)}: no gateway runs with --prefix "
                  f"{chain.prefix!r} on this broker; start `delay-gateway run` (or check --prefix and --url). "
                  "Nothing was published", file=sys.stderr)
            return 1
        channel.queue_declare(queue, exclusive=True, arguments={"x-queue-type": "classic"})
        channel.queue_bind(queue, chain.names.pick_up, key)
        sent = wall_ms()
        Publisher(channel, chain).send(token.encode(), key, delay_ms=delay_ms, message_id=token)
        due = sent + delay_ms
        log.info("selftest_published", routing_key=key, delay_ms=delay_ms)
        deadline = time.monotonic() + delay_ms / 1000 + timeout
        while time.monotonic() < deadline:
            method, _, body = channel.basic_get(queue, auto_ack=True)
            if method is None:
                channel.connection.sleep(POLL_S)
                continue
            arrived = wall_ms()
            if body != token.encode():
                continue
            # judged from before the publish, as the contract's "never early" is
            early = arrived < due
            result = {"delivered": not early, "routing_key": key, "delay_ms": delay_ms,
                      "after_ms": arrived - sent, "late_ms": arrived - due}
            print(json.dumps(result))
            log.info("selftest_arrived", early=early, late_ms=arrived - due)
            return 1 if early else 0
    print(json.dumps({"delivered": False, "routing_key": key, "delay_ms": delay_ms,
                      "error": f"not at pick-up within {timeout:g} s after its due time"}))
    log.error("selftest_timeout", routing_key=key, timeout_s=timeout)
    return 1

