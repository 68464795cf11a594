"""`delay-gateway selftest`: publish one delayed message through the running gateway and wait
for it at pick-up. The Helm chart's `helm test` runs it; it is as useful after any change.

It binds a queue of its own (named under the prefix, so a user limited to `^<prefix>\\.`
may run it; exclusive, so it goes away with the connection) to pick-up with a routing key
no one else uses, publishes with confirms and waits. Exit 0 when the message arrived, not
early; 1 when it did not arrive within --timeout or arrived early.
"""

import argparse
import json
import time
import uuid

import structlog

from topology import ChainSettings

from gateway.clock import wall_ms
from gateway.broker.publish import Publisher

POLL_S = 0.05


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--delay-ms", type=int, default=2000, metavar="MS", help="the test message's delay (x-delay)")
    p.add_argument("--timeout", type=float, default=60.0, metavar="SECONDS",
                   help="how long to wait for it after its due time")


def run(args, channel_factory, chain: ChainSettings) -> int:
    log = structlog.get_logger("gateway")
    token = uuid.uuid4().hex
    key, queue = f"selftest.{token}", f"{chain.prefix}.selftest.{token}"
    with channel_factory() as channel:
        channel.queue_declare(queue, exclusive=True, arguments={"x-queue-type": "classic"})
        channel.queue_bind(queue, chain.names.pick_up, key)
        sent = wall_ms()
        Publisher(channel, chain).send(token.encode(), key, delay_ms=args.delay_ms, message_id=token)
        due = sent + args.delay_ms
        log.info("selftest_published", routing_key=key, delay_ms=args.delay_ms)
        deadline = time.monotonic() + args.delay_ms / 1000 + args.timeout
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
            result = {"delivered": not early, "routing_key": key, "delay_ms": args.delay_ms,
                      "after_ms": arrived - sent, "late_ms": arrived - due}
            print(json.dumps(result))
            log.info("selftest_arrived", early=early, late_ms=arrived - due)
            return 1 if early else 0
    print(json.dumps({"delivered": False, "routing_key": key, "delay_ms": args.delay_ms,
                      "error": f"not at pick-up within {args.timeout:g} s after its due time"}))
    log.error("selftest_timeout", routing_key=key, timeout_s=args.timeout)
    return 1

