"""`delay-gateway publish`: delayed messages published to check-in, with confirms, one JSON line each."""

import argparse
import json
import sys
import uuid
from typing import List, Optional

from pika.exceptions import NackError, UnroutableError

from gateway.broker.plumbing.amqp import BrokerError, Trouble, blocking_channel
from gateway.broker.tools.publish import Publisher, parse_headers
from gateway.clock import wall_ms
from gateway.core import limits
from gateway.settings import Settings, UsageError, argument, integer


def add_arguments(p: argparse.ArgumentParser) -> None:
    when = p.add_mutually_exclusive_group()
    when.add_argument("--delay", type=int, metavar="MS", help="delay in ms (header x-delay)")
    when.add_argument("--at", type=int, metavar="EPOCH_MS", help="due time, epoch ms (header x-deliver-at)")
    p.add_argument("--routing-key", default="", help="the key the message arrives with at pick-up")
    p.add_argument("--body", default="", help="message body; - reads standard input")
    p.add_argument("--header", action="append", default=[], metavar="NAME=VALUE",
                   help="extra header (VALUE parsed as JSON when it can be)")
    p.add_argument("--message-id", help="default: a new UUID per message")
    p.add_argument("--count", type=argument(integer(1)), default=1, metavar="N",
                   help="publish this many copies (default 1)")


def main(settings: Settings, delay: Optional[int], at: Optional[int], routing_key: str, body: str,
         header: List[str], message_id: Optional[str], count: int) -> int:
    chain = settings.chain
    try:
        headers = parse_headers(header)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    check(routing_key, message_id, headers, delay, at, wall_ms())
    if delay is not None and delay <= 0:
        print(f"delay-gateway publish: note: --delay {delay} is 0 or less: the message is due now",
              file=sys.stderr)
    payload = sys.stdin.buffer.read() if body == "-" else body.encode()
    with blocking_channel(settings.one_vhost_urls, "delay-gateway publish",
                          settings.tls) as channel:
        publisher = Publisher(channel, chain)
        for _ in range(count):
            mid = message_id or str(uuid.uuid4())
            try:
                publisher.send(payload, routing_key, delay_ms=delay, deliver_at_ms=at,
                               headers=headers, message_id=mid)
            except UnroutableError:
                raise BrokerError(Trouble(False, f"{chain.names.check_in} routed the message to no queue: the "
                                                 "topology is not fully declared under this --prefix; run "
                                                 "`delay-gateway declare` with the gateways' settings")) from None
            except NackError:
                raise BrokerError(Trouble(True, "the broker refused the message (a negative confirm): is "
                                                f"{chain.names.check_in} full or without a leader? Try again")) \
                    from None
            print(json.dumps({"published": mid, "exchange": chain.names.check_in,
                              "routing_key": routing_key, "delay_ms": delay,
                              "deliver_at": at, "confirmed_at": wall_ms()}))
    return 0


def check(routing_key: str, message_id: Optional[str], headers: dict, delay: Optional[int], at: Optional[int],
          now_ms: int) -> None:
    """What the broker or check-in would refuse, refused before connecting (exit 2)."""
    try:
        limits.message(routing_key, message_id, headers, delay, at, now_ms,
                       names=("--routing-key", "--message-id", "--delay", "--at"))
    except limits.Refused as exc:
        raise UsageError(str(exc)) from None
