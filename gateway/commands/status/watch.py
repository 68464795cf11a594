"""The `status` verb: the report printed once, or with --watch every --interval until Ctrl-C."""

import argparse
import signal
import sys
import threading
from typing import Callable, Optional

from topology.registry import ChainKey

from gateway import stopping
from gateway.broker.plumbing.amqp import blocking_channel
from gateway.clock import wall_ms
from gateway.commands.status.reads import arrival_stamp, read_report
from gateway.commands.status.render import as_json, text
from gateway.commands.status.report import Report
from gateway.settings import Settings, argument, number


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--watch", action="store_true", help="refresh every --interval seconds, in place, until Ctrl-C")
    p.add_argument("--interval", type=argument(number(0.0, above=True)), default=2.0, metavar="SECONDS",
                   help="with --watch: seconds between refreshes (default 2)")
    p.add_argument("--json", action="store_true", help="print JSON (one document per refresh)")
    p.add_argument("--index", action=argparse.BooleanOptionalAction, default=True,
                   help="count the messages that wait one by one, from the index of what waits (default; reading "
                        "it takes a few seconds with millions waiting): --no-index counts queues only")
    p.add_argument("--metrics-url", metavar="URL[,URL...]",
                   help="the gateways' metrics endpoints (http://host:port), to count the messages the "
                        "distributor holds: AMQP cannot see them")


def main(settings: Settings, watch: bool, interval: float, json: bool, index: bool,
         metrics_url: Optional[str]) -> int:
    own = ChainKey.of(settings.chain)
    metrics_urls = [u.strip() for u in (metrics_url or "").split(",") if u.strip()]

    def report_now(connection, stamping) -> Report:
        return read_report(connection, settings, own, wall_ms(), stamping, metrics_urls, index)
    try:
        return command(settings, report_now, watch, interval, json)
    except KeyboardInterrupt:
        return 0


def command(settings: Settings, report_now: Callable[..., Report], watch: bool, interval: float,
            in_json: bool) -> int:
    """Print the report once, or every --interval seconds with --watch (redrawn in place
    on a terminal) until interrupted. Exit 3 when the topology is not declared (once)."""
    stop = threading.Event()
    if watch:
        # Ctrl-C ends the watch between two reports: raised inside pika instead, it can leave
        # the connection unable to close.
        previous = signal.signal(signal.SIGINT, stopping.setter(stop))
    try:
        return _reports(settings, report_now, watch, interval, in_json, stop)
    finally:
        if watch:
            signal.signal(signal.SIGINT, previous)


def _reports(settings: Settings, report_now: Callable[..., Report], watch: bool, interval: float, in_json: bool,
             stop: threading.Event) -> int:
    with blocking_channel(settings.one_vhost_urls, "delay-gateway status",
                          settings.tls) as channel:
        connection = channel.connection
        stamping = arrival_stamp(connection, settings.chain.prefix)
        while not stop.is_set():
            r = report_now(connection, stamping)
            if r.missing and not watch and not in_json:
                # Nothing under this prefix: the one useful line, not a table of "missing".
                print(f"delay-gateway status: {r.problems[0]}", file=sys.stderr)
                return 3
            # --watch --json: one document per line, for a reader that follows the stream
            out = as_json(r, None if watch else 2) if in_json else text(r)
            if watch and sys.stdout.isatty():
                out = "\x1b[H\x1b[2J" + out  # home and clear: redraw in place
            sys.stdout.write(out)
            sys.stdout.flush()
            if not watch:
                return 3 if r.missing else 0
            stop.wait(interval)
    return 0
