"""The `delay-gateway` command: one table of subcommands, each a function of parsed args."""

import argparse
import importlib
import json
import os
import sys
import uuid
from dataclasses import dataclass
from typing import Callable, Mapping, Optional, Sequence, Tuple

from pika.exceptions import NackError, UnroutableError

from topology import build
from topology.broker.declare import TopologyConflict, declare, delete
from topology.broker.inventory import read_registry
from topology.registry import ChainKey, fold
from topology.render import DESCRIPTIONS, FORMATS, render
from topology.retirement import DeleteExchange, DeleteQueue, MarkRetired, SealQueues, Unused

from gateway.broker import cancelling, upkeep
from gateway import logs
from gateway.commands import cancel, explain, move, parked, pending, selftest
from gateway.commands.status import reads as status_reads, watch as status_watch
from gateway.commands.status.render import clock_text
from gateway.commands.status.report import Report
from gateway.exits import EXIT_NO_BROKER, EXIT_REFUSED
from gateway.broker.amqp import BrokerError, Trouble, blocking_channel
from gateway.clock import wall_ms
from gateway.core import limits
from gateway.broker.publish import Publisher, parse_headers
from gateway.settings import (OPTIONS, Option, UsageError, add_options, argument, chain_from, integer, number,
                              per_vhost, settings_from, tls_from, urls_from)


@dataclass(frozen=True)
class Command:
    help: str
    groups: Tuple[str, ...]  # option groups of the settings table it takes
    run: Callable[[argparse.Namespace], int]
    arguments: Optional[Callable[[argparse.ArgumentParser], None]] = None
    only: Optional[Tuple[str, ...]] = None  # just these options of its groups: the others it ignores
    # verbs of its own (`parked list`), each with its help and its arguments, in `args.action`
    actions: Optional[Mapping[str, Tuple[str, Callable[[argparse.ArgumentParser], None]]]] = None

    def takes(self, option: Option) -> bool:
        return option.group in self.groups and (self.only is None or option.name in self.only)


# argparse's own complaints about a command line (not a value our parsers checked, whose
# message says what is allowed): the fix is the command's --help.
_STRUCTURE = ("unrecognized arguments", "the following arguments are required", "invalid choice", "expected ",
              "ambiguous option", "not allowed with", "invalid ")


class Parser(argparse.ArgumentParser):
    """Errors are one line and exit 2 (argparse would print the usage first):
    `delay-gateway COMMAND: error: what: the fix`."""

    def error(self, message: str) -> None:  # type: ignore[override]
        fix = f": see `{self.prog} --help`" if any(s in message for s in _STRUCTURE) else ""
        self.exit(2, f"{self.prog}: error: {message}{fix}\n")


def version() -> str:
    """The installed distribution's version: pyproject.toml is its one source."""
    from importlib.metadata import PackageNotFoundError, version as installed
    try:
        return installed("rabbitmq-delay-gateway")
    except PackageNotFoundError:  # run from a checkout that was never installed
        return "unknown (not installed)"


def parser(environ, only: Optional[str] = None) -> argparse.ArgumentParser:
    """The whole command line; with `only` (`command_in`), that command's settings alone are
    read from the environment (a variable another command reads cannot break this one)."""
    named = (only or "").split()
    p = Parser(prog=" ".join(["delay-gateway", *named]) if named and named[0] in COMMANDS else "delay-gateway",
               description=(
        "Per-message delays of any length for RabbitMQ, from TTLs and dead-lettering alone. "
        "Publishers send to <prefix>.check-in with an x-delay (ms) or x-deliver-at (epoch ms) "
        "header; consumers bind to <prefix>.pick-up. Every setting (the options `COMMAND --help` "
        "shows with a variable in brackets) also reads that environment variable."))
    p.add_argument("--version", action="version", version=f"delay-gateway {version()}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=Parser)
    for name, command in COMMANDS.items():
        c = sub.add_parser(name, help=command.help, description=command.help, prog=f"delay-gateway {name}")
        if named and named[0] != name:
            continue
        if command.actions:
            verbs = c.add_subparsers(dest="action", required=True, metavar="ACTION", parser_class=Parser)
            for verb, (help, arguments) in command.actions.items():
                v = verbs.add_parser(verb, help=help, description=help, prog=f"delay-gateway {name} {verb}")
                add_options(v, command.groups, environ, command.only)
                arguments(v)
            continue
        add_options(c, command.groups, environ, command.only)
        if command.arguments:
            command.arguments(c)
    return p


def command_in(argv: Sequence[str]) -> Optional[str]:
    """The command a command line names (its first word that is not an option, and its verb
    for a command that has verbs: `parked list`), if any."""
    words = [word for word in argv if not word.startswith("-")]
    if not words:
        return None
    command = COMMANDS.get(words[0])
    if command is not None and command.actions and len(words) > 1 and words[1] in command.actions:
        return " ".join(words[:2])
    return words[0]


def main(argv: Optional[Sequence[str]] = None, environ=None) -> int:
    environ = os.environ if environ is None else environ
    argv = list(sys.argv[1:] if argv is None else argv)
    named = command_in(argv)
    try:
        args = parser(environ, named).parse_args(argv)
    except UsageError as exc:  # a bad value in the environment
        print(f"delay-gateway {named}: error: {exc}", file=sys.stderr)
        return 2
    except SystemExit as exc:  # --help (0), or a bad flag or value, already said in one line (2)
        return int(exc.code or 0)
    logs.configure(getattr(args, "log_level", "info"), getattr(args, "log_format", "auto"))
    try:
        return COMMANDS[args.command].run(args)
    except UsageError as exc:
        logs.last_line(f"delay-gateway {args.command}: error: {exc}")
        return 2
    except TopologyConflict as exc:
        logs.last_line(f"delay-gateway {args.command}: {exc}")
        return EXIT_REFUSED
    except BrokerError as exc:
        logs.last_line(f"delay-gateway {args.command}: {exc}")
        return EXIT_NO_BROKER if exc.trouble.heals else EXIT_REFUSED
    except BrokenPipeError:  # `... | head` stopped reading: what it read is what was wanted
        # Python flushes stdout once more at exit; point it at nothing so that flush cannot fail.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


# -- run ------------------------------------------------------------------------------------
def cmd_run(args) -> int:
    settings = settings_from(args)
    if settings.vhosts:
        from gateway.broker.vhosts import serve
        return serve(settings)
    from gateway.broker.worker import main as run_worker
    return run_worker(settings)


# -- topology -------------------------------------------------------------------------------
def cmd_declare(args) -> int:
    chain = chain_from(args)
    topology = build(chain, cancelling.retention_ms(chain, args.cancel_retention))
    # --vhosts: the same topology in each, one line each (unset: the URL's own, said as before)
    for vhost, where in per_vhost(urls_from(args, many=True), args.vhosts):
        with blocking_channel(where, tls=tls_from(args)) as channel:
            declare(channel, topology)
            records = read_registry(channel.connection, chain.names)
            upkeep.record_chain(channel.connection, chain.prefix, ChainKey.of(chain),
                                None if records is None else fold(records))
        print(f"declared {len(topology.exchanges)} exchanges, {len(topology.queues)} queues, "
              f"{len(topology.bindings)} bindings with prefix {topology.settings.prefix!r} "
              f"(chain {chain.generation}, {chain.max_level} levels)"
              + ("" if vhost is None else f" in virtual host {vhost!r}"), flush=True)
    return 0


def delete_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--yes", action="store_true", help="really delete")


def cmd_delete(args) -> int:
    if not args.yes:
        raise UsageError("delete removes every queue of the topology and the messages in them; add --yes")
    chain = chain_from(args)
    with blocking_channel(urls_from(args), tls=tls_from(args)) as channel:
        # Every chain the registry knows of under the prefix, then the fixed objects and
        # the registry itself (with the chain of the given settings).
        records = read_registry(channel.connection, chain.names) or []
        others = {r.chain for r in records if r.chain is not None} - {ChainKey.of(chain)}
        for key in sorted(others):
            delete(channel, build(key.settings(chain.prefix)))
        delete(channel, build(chain))
    print(f"deleted the topology with prefix {args.prefix!r} ({len(others) + 1} chain(s))")
    return 0


def render_arguments(p: argparse.ArgumentParser) -> None:
    described = "; ".join(f"{name}: {DESCRIPTIONS.get(name, name)}" for name in sorted(FORMATS))
    p.add_argument("--format", choices=sorted(FORMATS), default="definitions",
                   help=f"{described} (default: definitions)")
    p.add_argument("--vhost", default="/", help="the virtual host the objects belong to (default /)")
    operator = p.add_argument_group("operator format: the RabbitmqCluster the resources belong to")
    operator.add_argument("--cluster-name", help="name of the RabbitmqCluster object")
    operator.add_argument("--cluster-namespace", help="its namespace (default: the resources' own)")
    operator.add_argument("--connection-secret", metavar="SECRET",
                          help="instead of --cluster-name: a Secret with the HTTP API's uri, username, password")


def cmd_render(args) -> int:
    chain = chain_from(args)
    topology = build(chain, cancelling.retention_ms(chain, args.cancel_retention))
    try:
        text = render(args.format, topology, args)
    except ValueError as exc:  # options the format cannot work with
        raise UsageError(str(exc)) from None
    sys.stdout.write(text)
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
    p.add_argument("--count", type=argument(integer(1)), default=1, metavar="N",
                   help="publish this many copies (default 1)")


def cmd_publish(args) -> int:
    chain = chain_from(args)
    try:
        headers = parse_headers(args.header)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    check_publish(args, headers, wall_ms())
    if args.delay is not None and args.delay <= 0:
        print(f"delay-gateway publish: note: --delay {args.delay} is 0 or less: the message is due now",
              file=sys.stderr)
    body = sys.stdin.buffer.read() if args.body == "-" else args.body.encode()
    with blocking_channel(urls_from(args), "delay-gateway publish", tls_from(args)) as channel:
        publisher = Publisher(channel, chain)
        for _ in range(args.count):
            message_id = args.message_id or str(uuid.uuid4())
            try:
                publisher.send(body, args.routing_key, delay_ms=args.delay, deliver_at_ms=args.at,
                               headers=headers, message_id=message_id)
            except UnroutableError:
                raise BrokerError(Trouble(False, f"{chain.names.check_in} routed the message to no queue: the "
                                                 "topology is not fully declared under this --prefix; run "
                                                 "`delay-gateway declare` with the gateways' settings")) from None
            except NackError:
                raise BrokerError(Trouble(True, "the broker refused the message (a negative confirm): is "
                                                f"{chain.names.check_in} full or without a leader? Try again")) \
                    from None
            print(json.dumps({"published": message_id, "exchange": chain.names.check_in,
                              "routing_key": args.routing_key, "delay_ms": args.delay,
                              "deliver_at": args.at, "confirmed_at": wall_ms()}))
    return 0


def check_publish(args, headers: dict, now_ms: int) -> None:
    """What the broker or check-in would refuse, refused before connecting (exit 2)."""
    try:
        limits.message(args.routing_key, args.message_id, headers, args.delay, args.at, now_ms,
                       names=("--routing-key", "--message-id", "--delay", "--at"))
    except limits.Refused as exc:
        raise UsageError(str(exc)) from None


def explain_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("delay_ms", type=int, metavar="DELAY_MS", help="the delay to explain, in ms")


def cmd_explain(args) -> int:
    try:
        delay_ms = limits.delay_ms(args.delay_ms, "DELAY_MS")
    except limits.Refused as exc:
        raise UsageError(str(exc)) from None
    print("\n".join(explain.lines(delay_ms, chain_from(args), args.lead_ms)))
    return 0


def status_arguments(p: argparse.ArgumentParser) -> None:
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


def cmd_status(args) -> int:
    chain = chain_from(args)
    try:
        return status_watch.command(args, lambda: blocking_channel(urls_from(args), "delay-gateway status",
                                                             tls_from(args)), ChainKey.of(chain), wall_ms)
    except KeyboardInterrupt:
        return 0


def migrate_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--wait", action="store_true",
                   help="keep going until every other chain is retired (queues are deleted as their time comes)")
    p.add_argument("--dry-run", action="store_true", help="say what would be done, change nothing")


def cmd_migrate(args) -> int:
    chain = chain_from(args)
    own = ChainKey.of(chain)
    margin_ms = int(args.retire_after * 1000)
    unused = Unused()

    def report(event: str, **fields) -> None:
        print(json.dumps({"event": event, **fields}, default=str), flush=True)

    with blocking_channel(urls_from(args), "delay-gateway migrate", tls_from(args)) as channel:
        connection = channel.connection
        while True:
            records = read_registry(connection, chain.names)
            if records is None:
                raise UsageError(f"no chain registry {chain.names.registry!r} under prefix {chain.prefix!r}: "
                                 "run `delay-gateway declare` with this version first")
            if args.dry_run:
                sequences = upkeep.plan_once(connection, chain.prefix, own, unused, 0, margin_ms, wall_ms,
                                             fold(records), report)
                steps = [step for steps in sequences for step in steps]
                for step in steps:
                    report("would_" + _step_event(step), **_step_fields(step))
                others = _remaining(report, status_reads.one(connection, args, own, wall_ms()))
                report("dry_run", chain=own.describe(), steps=len(steps), other_chains=len(others),
                       summary=_dry_run_summary(own, len(steps), others))
                return 0
            upkeep.retire_once(connection, chain.prefix, own, unused, 0, margin_ms, report,
                               registry=fold(records))
            others = _remaining(report, status_reads.one(connection, args, own, wall_ms()))
            if not args.wait or not others:
                if not others:
                    report("migrated", chain=own.describe())
                return 0
            connection.sleep(upkeep.tick_s(args.retire_after))


def _remaining(report: Callable[..., None], r: Report) -> list:
    """Report the chains other than the one of these settings; returns them."""
    others = [c for c in r.chains if not c.yours]
    for c in others:
        report("chain_remaining", chain=c.key.describe(), gateways=c.gateways,
               empty_by=None if c.empty_by_ms is None else clock_text(c.empty_by_ms))
    return others


def _dry_run_summary(own: ChainKey, steps: int, others: list) -> str:
    if not others:
        return f"nothing to do: the chain of these settings ({own.describe()}) is the only one; nothing changed"
    used = sum(1 for c in others if c.gateways)
    return (f"{steps} step(s) would be taken now; {len(others)} other chain(s), {used} in use by gateways (kept "
            "until unused for --retire-after); nothing changed (--dry-run)")


def _step_event(step) -> str:
    return {SealQueues: "seal", DeleteExchange: "delete_exchange", DeleteQueue: "delete_queue",
            MarkRetired: "mark_retired"}[type(step)]


def _step_fields(step) -> dict:
    if isinstance(step, SealQueues):
        return {"queues": dict(step.empty_by)}
    if isinstance(step, MarkRetired):
        return {"chain": step.chain.describe()}
    return {"name": step.name}


def cmd_cancel(args) -> int:
    return cancel.command(args, lambda: blocking_channel(urls_from(args), "delay-gateway cancel",
                                                         tls_from(args)))


def cmd_parked(args) -> int:
    return parked.command(args, lambda: blocking_channel(urls_from(args), "delay-gateway parked",
                                                         tls_from(args)), chain_from(args))


def cmd_pending(args) -> int:
    return pending.command(args, lambda: blocking_channel(urls_from(args), f"delay-gateway pending {args.action}",
                                                          tls_from(args)))


def cmd_selftest(args) -> int:
    # (--vhosts: each in turn, as `helm test` checks a release that serves several)
    for _, urls in per_vhost(urls_from(args, many=True), args.vhosts):
        code = selftest.run(args, lambda urls=urls: blocking_channel(urls, "delay-gateway selftest", tls_from(args)),
                            chain_from(args))
        if code:
            return code
    return 0


def demo_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--delays", type=argument(_delays), default="3000,0,1500,4500,750,2250",
                   help="comma-separated delays in ms (default 3000,0,1500,4500,750,2250)")


def _delays(text: str) -> str:
    for part in text.split(","):
        try:
            int(part)
        except ValueError:
            raise ValueError(f"{part!r} in {text!r} is not a delay in ms (comma-separated integers)") from None
    return text


def cmd_move(args) -> int:
    return move.command(args, urls_from(args), tls_from(args), chain_from(args))


def cmd_demo(args) -> int:
    from gateway.commands.demo import demo
    return demo(args)


def spark(module: str) -> Tuple[Callable[[argparse.Namespace], int], Callable[[argparse.ArgumentParser], None]]:
    """`run` and `add_arguments` of gateway.spark.<module>, imported only when called: the
    Spark commands' modules need PySpark (an optional extra) or matplotlib."""
    def run(args: argparse.Namespace) -> int:
        return importlib.import_module(f"gateway.spark.{module}").run(args)

    def add_arguments(p: argparse.ArgumentParser) -> None:
        importlib.import_module(f"gateway.spark.{module}").add_arguments(p)
    return run, add_arguments


BROKER = ("broker", "log")
# Commands that only publish to check-in or read from pick-up: of the chain, only the prefix matters.
BROKER_AND_PREFIX = tuple(o.name for o in OPTIONS if o.group in BROKER) + ("prefix",)
COMMANDS = {
    "run": Command("run the consumers (check-in, distributor, or both) until SIGTERM",
                   BROKER + ("chain", "run", "lead", "retire", "cancel", "retry"), cmd_run),
    "declare": Command("declare the topology (idempotent)", BROKER + ("chain", "cancel"), cmd_declare),
    "delete": Command("delete the topology and every message it holds", BROKER + ("chain",), cmd_delete,
                      delete_arguments),
    "render": Command("print the topology as code (a definitions document, a Terraform module) for your "
                      "infrastructure's own tools", ("chain", "cancel", "log"), cmd_render, render_arguments),
    "status": Command("show how many messages wait where, and when they fall due (plain AMQP, any number "
                      "of messages)", BROKER + ("chain", "lead", "cancel"), cmd_status, status_arguments),
    "migrate": Command("retire chains of other settings that no gateway uses, once they are empty "
                       "(`run` does this by itself unless --no-retire)", BROKER + ("chain", "retire"),
                       cmd_migrate, migrate_arguments),
    "publish": Command("publish delayed messages to check-in, with confirms", BROKER + ("chain",), cmd_publish,
                       publish_arguments),
    "explain": Command("show the route a delay takes through the chain", ("chain", "lead", "log"), cmd_explain,
                       explain_arguments),
    "cancel": Command("cancel scheduled messages by message id (docs/cancelling.md)", BROKER + ("chain", "cancel"),
                      cmd_cancel, cancel.add_arguments),
    "parked": Command("list parked messages, or replay them once their cause is fixed", BROKER + ("chain",),
                      cmd_parked, actions=parked.ACTIONS),
    "pending": Command("list, count, cancel or export the messages that wait, by id, routing key, due time or "
                       "header (docs/operating.md: Seeing what waits)", BROKER + ("chain", "cancel"), cmd_pending,
                       actions=pending.ACTIONS),
    "selftest": Command("publish one delayed message through the running gateway and wait for it at pick-up",
                        BROKER + ("chain",), cmd_selftest, selftest.add_arguments),
    "move-from-plugin": Command("move the delayed-message plugin's waiting messages into the gateway, due "
                                "times kept (docs/migrating-from-the-plugin.md)", BROKER + ("chain",), cmd_move,
                                move.add_arguments, BROKER_AND_PREFIX),
    "demo": Command("start the gateway, publish a few delayed messages and watch them arrive",
                    BROKER + ("chain",), cmd_demo, demo_arguments),
    "schedule": Command("publish every row of a table (CSV, JSON lines, Parquet) as a delayed message, on Spark",
                        BROKER + ("chain",), *spark("schedule"), BROKER_AND_PREFIX),
    "cancel-table": Command("cancel the message of every id in a table (CSV, JSON lines, Parquet), on Spark: "
                            "the counterpart of schedule", BROKER + ("chain",), *spark("cancel")),
    "record": Command("record deliveries at pick-up as JSON lines (for `report`)", BROKER + ("chain",),
                      *spark("record"), BROKER_AND_PREFIX),
    "report": Command("delivery analytics from `record`'s output, on Spark: lateness, duplicates, throughput",
                      ("log",), *spark("report")),
    "example-orders": Command("write an example orders table to try `schedule` with (review reminders)",
                              ("log",), *spark("example")),
}
