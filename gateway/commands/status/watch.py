"""The `status` verb: the report printed once, or with --watch every --interval until Ctrl-C."""

import signal
import sys
import threading

from topology.registry import ChainKey

from gateway import stopping
from gateway.commands.status.reads import arrival_stamp, one
from gateway.commands.status.render import as_json, text


def command(args, open_channel, own: ChainKey, clock) -> int:
    """Print the report once, or every --interval seconds with --watch (redrawn in place
    on a terminal) until interrupted. Exit 3 when the topology is not declared (once)."""
    stop = threading.Event()
    if args.watch:
        # Ctrl-C ends the watch between two reports: raised inside pika instead, it can leave
        # the connection unable to close.
        previous = signal.signal(signal.SIGINT, stopping.setter(stop))
    try:
        return _reports(args, open_channel, own, clock, stop)
    finally:
        if args.watch:
            signal.signal(signal.SIGINT, previous)


def _reports(args, open_channel, own: ChainKey, clock, stop: threading.Event) -> int:
    with open_channel() as channel:
        connection = channel.connection
        stamping = arrival_stamp(connection, args.prefix)
        while not stop.is_set():
            r = one(connection, args, own, clock(), stamping)
            if r.missing and not args.watch and not args.json:
                # Nothing under this prefix: the one useful line, not a table of "missing".
                print(f"delay-gateway status: {r.problems[0]}", file=sys.stderr)
                return 3
            # --watch --json: one document per line, for a reader that follows the stream
            out = as_json(r, None if args.watch else 2) if args.json else text(r)
            if args.watch and sys.stdout.isatty():
                out = "\x1b[H\x1b[2J" + out  # home and clear: redraw in place
            sys.stdout.write(out)
            sys.stdout.flush()
            if not args.watch:
                return 3 if r.missing else 0
            stop.wait(args.interval)
    return 0
