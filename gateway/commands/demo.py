"""`delay-gateway demo`: start the gateway, publish a few delayed messages, show them arrive.

The demo prints only what concerns the demo: its table. The gateway it starts logs to a file
of its own, so what a gateway says at start about the broker (`arrival_stamp_off`,
`cancels_need_one_check_in_consumer`: advice for running gateways in production, about
replicas and cancels the demo has none of) stays out of the table. The file is removed
when the demo succeeds; otherwise the demo names it, with the gateway's last line.
"""

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from topology import build
from topology.broker.declare import declare

from gateway.broker.plumbing.amqp import blocking_channel
from gateway.clock import wall_ms
from gateway.broker.tools.publish import Publisher
from gateway.commands.selftest import unconsumed
from gateway.settings import Settings, argument


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--delays", type=argument(_delays), default="3000,0,1500,4500,750,2250",
                   help="comma-separated delays in ms (default 3000,0,1500,4500,750,2250)")


def _delays(text: str) -> str:
    for part in text.split(","):
        try:
            int(part)
        except ValueError:
            raise ValueError(f"{part!r} in {text!r} is not a delay in ms (comma-separated integers)") from None
    return text


def main(settings: Settings, delays: str) -> int:
    chain, urls = settings.chain, settings.one_vhost_urls
    url = ",".join(urls)  # the gateway it starts takes the whole list too
    delays_ms = [int(d) for d in delays.split(",")]
    with blocking_channel(urls, "delay-gateway demo", settings.tls) as channel:
        declare(channel, build(chain))
        queue = channel.queue_declare("", exclusive=True).method.queue
        channel.queue_bind(queue, chain.names.pick_up, "demo.#")
        with tempfile.NamedTemporaryFile(prefix="delay-gateway-demo-", suffix=".log", delete=False) as log:
            gateway = subprocess.Popen(
                [sys.executable, "-m", "gateway", "run", "--url", url, "--prefix", chain.prefix,
                 "--max-level", str(chain.max_level), "--resolution-ms", str(chain.resolution_ms),
                 "--queue-type", chain.queue_type, "--zero-bits", chain.zero_bits, "--log-level", settings.log_level],
                env=dict(os.environ, DELAY_GATEWAY_URL=url), stdout=log, stderr=subprocess.STDOUT)
        keep_log = False  # only when the demo names it
        try:
            # Publish once the gateway consumes: with the broker's arrival stamp x-delay counts
            # from the publish, and messages already due when it starts come out in any order.
            attach_by = time.monotonic() + 30
            while unconsumed(channel, chain) and time.monotonic() < attach_by and gateway.poll() is None:
                channel.connection.sleep(0.2)
            publisher = Publisher(channel, chain)
            print(f"publishing {len(delays_ms)} messages to {chain.names.check_in}; "
                  f"receiving from {chain.names.pick_up} (binding demo.#)\n")
            sent = {}
            for i, delay in enumerate(delays_ms):
                key = f"demo.{i}"
                sent[key] = (wall_ms(), delay)  # before the publish: the gateway's clock starts later
                publisher.send(f"message {i}".encode(), key, delay_ms=delay, message_id=key)
            print(f"{'routing key':<12} {'x-delay':>9} {'arrived after':>14} {'late by':>8}")
            late, order = [], []
            for method, _properties, _body in channel.consume(queue, auto_ack=True, inactivity_timeout=1):
                if method is None:
                    if gateway.poll() is not None:
                        keep_log = True
                        print(f"delay-gateway demo: the gateway exited early (exit {gateway.returncode}): "
                              f"{last_line(log.name)} (its log: {log.name})", file=sys.stderr)
                        return 1
                    if wall_ms() - max(t + d for t, d in sent.values()) > 30_000:
                        keep_log = True
                        print(f"delay-gateway demo: timed out waiting for messages; the gateway's log is {log.name}",
                              file=sys.stderr)
                        return 1
                    continue
                at, delay = sent[method.routing_key]
                waited = wall_ms() - at
                late.append(waited - delay)
                order.append(delay)
                print(f"{method.routing_key:<12} {delay:>7} ms {waited:>11} ms {waited - delay:>5} ms")
                if len(late) == len(sent):
                    break
            channel.cancel()
            in_order = order == sorted(order)
            early = sum(1 for x in late if x < 0)
            print(f"\n{len(late)} delivered, {'in' if in_order else 'NOT in'} due order, {early} early; "
                  f"lateness {min(late)} to {max(late)} ms (counted from just before each publish)")
            if in_order and not early:
                return 0
            keep_log = True
            print(f"delay-gateway demo: the gateway's log is {log.name}", file=sys.stderr)
            return 1
        finally:
            gateway.send_signal(signal.SIGTERM)
            gateway.wait(30)
            if not keep_log:
                os.unlink(log.name)


def last_line(path: str) -> str:
    """The last line the gateway wrote (its error, when it stopped on one), cut to one line's length."""
    lines = [line.strip() for line in Path(path).read_text(errors="replace").splitlines() if line.strip()]
    return lines[-1][:300] if lines else "it wrote nothing"
