"""The `delay-gateway` command: one table of subcommands, each a function of parsed args."""

import argparse
import json
import os
import sys
import uuid
from dataclasses import dataclass
from typing import Callable, Optional, Sequence, Tuple

import structlog

from topology import Enter, Meditate, build, plan
from topology.declare import TopologyConflict, declare, delete
from topology.render import FORMATS, render
from topology.routing import trace

from . import codec, logs, parked
from .amqp import BrokerError, blocking_channel
from .clock import wall_ms
from .publish import Publisher, parse_headers
from .settings import UsageError, add_options, chain_from, settings_from, tls_from, urls_from


@dataclass(frozen=True)
class Command:
    help: str
    groups: Tuple[str, ...]  # option groups of the settings table it takes
    run: Callable[[argparse.Namespace], int]
    arguments: Optional[Callable[[argparse.ArgumentParser], None]] = None


class Parser(argparse.ArgumentParser):
    """Errors are one line and exit 2 (argparse would print the usage first)."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message}\n")


def parser(environ) -> argparse.ArgumentParser:
    p = Parser(prog="delay-gateway", description=(
        "Per-message delays of any length for RabbitMQ, from TTLs and dead-lettering alone. "
        "Publishers send to <prefix>.check-in with an x-delay (ms) or x-deliver-at (epoch ms) "
        "header; consumers bind to <prefix>.pick-up. Every option also reads an environment "
        "variable, shown in brackets."))
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=Parser)
    for name, command in COMMANDS.items():
        c = sub.add_parser(name, help=command.help, description=command.help)
        add_options(c, command.groups, environ)
        if command.arguments:
            command.arguments(c)
    return p


def main(argv: Optional[Sequence[str]] = None, environ=None) -> int:
    environ = os.environ if environ is None else environ
    try:
        args = parser(environ).parse_args(argv)
    except UsageError as exc:  # a bad boolean in the environment
        print(f"delay-gateway: error: {exc}", file=sys.stderr)
        return 2
    codec.install()
    logs.configure(getattr(args, "log_level", "info"), getattr(args, "log_format", "auto"))
    try:
        return COMMANDS[args.command].run(args)
    except UsageError as exc:
        print(f"delay-gateway {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except (TopologyConflict, BrokerError) as exc:
        structlog.get_logger("gateway").error("command_failed", command=args.command, error=str(exc))
        print(f"delay-gateway {args.command}: {exc}", file=sys.stderr)
        return 1


# -- run ------------------------------------------------------------------------------------
def cmd_run(args) -> int:
    from .worker import main as run_worker
    return run_worker(settings_from(args))


# -- topology -------------------------------------------------------------------------------
def cmd_declare(args) -> int:
    topology = build(chain_from(args))
    with blocking_channel(urls_from(args)[0], tls=tls_from(args)) as channel:
        declare(channel, topology)
    print(f"declared {len(topology.exchanges)} exchanges, {len(topology.queues)} queues, "
          f"{len(topology.bindings)} bindings with prefix {topology.settings.prefix!r}")
    return 0


def delete_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--yes", action="store_true", help="really delete")


def cmd_delete(args) -> int:
    if not args.yes:
        raise UsageError("delete removes every queue of the topology and the messages in them; add --yes")
    with blocking_channel(urls_from(args)[0], tls=tls_from(args)) as channel:
        delete(channel, build(chain_from(args)))
    print(f"deleted the topology with prefix {args.prefix!r}")
    return 0


def render_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--format", choices=sorted(FORMATS), default="definitions",
                   help="definitions: JSON for rabbitmqctl import_definitions or the management UI")
    p.add_argument("--vhost", default="/", help="the virtual host the objects belong to")


def cmd_render(args) -> int:
    sys.stdout.write(render(args.format, build(chain_from(args)), args))
    return 0


# -- messages -------------------------------------------------------------------------------
def publish_arguments(p: argparse.ArgumentParser) -> None:
    when = p.add_mutually_exclusive_group()
    when.add_argument("--delay", type=int, metavar="MS", help="delay in ms (header x-delay)")
    when.add_argument("--at", type=int, metavar="EPOCH_MS", help="due time, epoch ms (header x-deliver-at)")
    p.add_argument("--routing-key", default="", help="the key the message arrives with at pick-up")
    p.add_argument("--body", default="", help="message body; - reads standard input")
    p.add_argument("--header", action="append", default=[], metavar="NAME=VALUE",
                   help="extra header (VALUE parsed as JSON when it can be)")
    p.add_argument("--message-id", help="default: a new UUID per message")
    p.add_argument("--count", type=int, default=1, help="publish this many copies")


def cmd_publish(args) -> int:
    body = sys.stdin.buffer.read() if args.body == "-" else args.body.encode()
    chain = chain_from(args)
    headers = parse_headers(args.header)
    with blocking_channel(urls_from(args)[0], "delay-gateway publish", tls_from(args)) as channel:
        publisher = Publisher(channel, chain)
        for _ in range(args.count):
            message_id = args.message_id or str(uuid.uuid4())
            publisher.send(body, args.routing_key, delay_ms=args.delay, deliver_at_ms=args.at,
                           headers=headers, message_id=message_id)
            print(json.dumps({"published": message_id, "exchange": chain.names.check_in,
                              "routing_key": args.routing_key, "delay_ms": args.delay,
                              "deliver_at": args.at, "confirmed_at": wall_ms()}))
    return 0


def explain_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("delay_ms", type=int, metavar="DELAY_MS")


def cmd_explain(args) -> int:
    chain = chain_from(args)
    topology, names = build(chain), chain.names
    remaining, total = args.delay_ms, 0
    print(f"delay {args.delay_ms} ms; chain of {chain.max_level} levels x {chain.resolution_ms} ms "
          f"(up to {chain.meditation_ms} ms), lead {args.lead_ms} ms")
    while True:
        route = plan(remaining, chain, args.lead_ms)
        if not isinstance(route, Meditate):
            break
        print(f"  {chain.meditation:<44} wait {chain.meditation_ms} ms, then check in again")
        remaining -= chain.meditation_ms
        total += chain.meditation_ms
    if isinstance(route, Enter):
        print(f"  publish to {names.level(route.level)} with key {route.key!r}")
        for hop in trace(topology, names.level(route.level), route.key, names.distributor):
            print(f"  {hop.queue:<44} wait {hop.wait_ms} ms")
            total += hop.wait_ms
    print(f"  {names.distributor:<44} hold {args.delay_ms - total} ms, then publish to {names.pick_up}")
    return 0


def cmd_parked(args) -> int:
    return parked.command(args, lambda: blocking_channel(urls_from(args)[0], "delay-gateway parked",
                                                         tls_from(args)), chain_from(args))


def demo_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--delays", default="3000,0,1500,4500,750,2250", help="comma-separated delays in ms")


def cmd_demo(args) -> int:
    from .demo import demo
    return demo(args)


def cmd_bench(args) -> int:
    from .bench.cli import run
    return run(args)


def bench_arguments(p: argparse.ArgumentParser) -> None:
    from .bench.cli import add_arguments
    add_arguments(p)


def cmd_schedule(args) -> int:
    from .spark.schedule import run
    return run(args)


def schedule_arguments(p: argparse.ArgumentParser) -> None:
    from .spark.schedule import add_arguments
    add_arguments(p)


def cmd_record(args) -> int:
    from .spark.record import run
    return run(args)


def record_arguments(p: argparse.ArgumentParser) -> None:
    from .spark.record import add_arguments
    add_arguments(p)


def cmd_report(args) -> int:
    from .spark.report import run
    return run(args)


def report_arguments(p: argparse.ArgumentParser) -> None:
    from .spark.report import add_arguments
    add_arguments(p)


def cmd_example(args) -> int:
    from .spark.example import run
    return run(args)


def example_arguments(p: argparse.ArgumentParser) -> None:
    from .spark.example import add_arguments
    add_arguments(p)


BROKER = ("broker", "log")
COMMANDS = {
    "run": Command("run the consumers (check-in, distributor, or both) until SIGTERM",
                   BROKER + ("chain", "run", "lead"), cmd_run),
    "declare": Command("declare the topology (idempotent)", BROKER + ("chain",), cmd_declare),
    "delete": Command("delete the topology and every message it holds", BROKER + ("chain",), cmd_delete,
                      delete_arguments),
    "render": Command("print the topology as code: a definitions document, ...", ("chain", "log"), cmd_render,
                      render_arguments),
    "publish": Command("publish delayed messages to check-in, with confirms", BROKER + ("chain",), cmd_publish,
                       publish_arguments),
    "explain": Command("show the route a delay takes through the chain", ("chain", "lead", "log"), cmd_explain,
                       explain_arguments),
    "parked": Command("list parked messages, or replay them once their cause is fixed", BROKER + ("chain",),
                      cmd_parked, parked.add_options),
    "demo": Command("start the gateway, publish a few delayed messages and watch them arrive",
                    BROKER + ("chain",), cmd_demo, demo_arguments),
    "bench": Command("measure lateness, throughput and memory against a real broker", BROKER, cmd_bench,
                     bench_arguments),
    "schedule": Command("publish every row of a table (CSV, JSON lines, Parquet) as a delayed message, on Spark",
                        BROKER + ("chain",), cmd_schedule, schedule_arguments),
    "record": Command("record deliveries at pick-up as JSON lines (for `report`)", BROKER + ("chain",),
                      cmd_record, record_arguments),
    "report": Command("delivery analytics from `record`'s output, on Spark: lateness, duplicates, throughput",
                      ("log",), cmd_report, report_arguments),
    "example-orders": Command("write an example orders table to try `schedule` with (review reminders)",
                              ("log",), cmd_example, example_arguments),
}
