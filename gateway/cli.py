"""The `delay-gateway` command: the table of its verbs, and main(), which parses the command
line, builds the Settings once and hands them to the verb.

Each verb lives in a module of its own (gateway/commands/, gateway/spark/), named here by
"module:function" and imported only when that verb runs or shows its help: `--help` and
each verb start without importing the others.
"""

import argparse
import importlib
import os
import sys
from dataclasses import dataclass
from typing import Any, Dict, Optional, Sequence, Tuple

from gateway import logs
from gateway.exits import EXIT_REFUSED, ExitCodeError
from gateway.settings import BY_NAME, OPTIONS, Option, UsageError, add_options, settings_from


@dataclass(frozen=True)
class Command:
    help: str
    groups: Tuple[str, ...]  # option groups of the settings table it takes
    # "module:function": called with the Settings and the command's own arguments as keywords
    run: str
    arguments: Optional[str] = None  # "module:function" that adds its own arguments to its parser
    only: Optional[Tuple[str, ...]] = None  # just these options of its groups: the others it ignores
    # verbs of its own (`parked list`), in `action`: "module:NAME" of a {verb: (help, add arguments)}
    actions: Optional[str] = None

    def takes(self, option: Option) -> bool:
        return option.group in self.groups and (self.only is None or option.name in self.only)


def load(reference: str) -> Any:
    """What a "module:name" reference names, its module imported now."""
    module, _, name = reference.partition(":")
    return getattr(importlib.import_module(module), name)


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


def parser(environ, only: Optional[str] = None, own_arguments: bool = True) -> argparse.ArgumentParser:
    """The whole command line; with `only` (`command_in`), that command's settings alone are
    read from the environment (a variable another command reads cannot break this one), and
    its module alone is imported. Without `own_arguments`, no command's own arguments (nor
    its module): for a command line that names no command."""
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
        if not own_arguments:
            # No command named: none is parsed, but every one's settings are read from the
            # environment, so a bad value is refused as it always was.
            add_options(c, command.groups, environ, command.only)
            continue
        if command.actions:
            verbs = c.add_subparsers(dest="action", required=True, metavar="ACTION", parser_class=Parser)
            for verb, (help, arguments) in load(command.actions).items():
                v = verbs.add_parser(verb, help=help, description=help, prog=f"delay-gateway {name} {verb}")
                add_options(v, command.groups, environ, command.only)
                arguments(v)
            continue
        add_options(c, command.groups, environ, command.only)
        if command.arguments:
            load(command.arguments)(c)
    return p


def command_in(argv: Sequence[str]) -> Optional[str]:
    """The command a command line names (its first word that is not an option, and its verb
    for a command that has verbs: `parked list`), if any."""
    words = [word for word in argv if not word.startswith("-")]
    if not words:
        return None
    command = COMMANDS.get(words[0])
    if command is not None and command.actions and len(words) > 1 and words[1] in load(command.actions):
        return " ".join(words[:2])
    return words[0]


def main(argv: Optional[Sequence[str]] = None, environ=None) -> int:
    environ = os.environ if environ is None else environ
    argv = list(sys.argv[1:] if argv is None else argv)
    named = command_in(argv)
    try:
        args = parser(environ, named, own_arguments=named is not None).parse_args(argv)
    except UsageError as exc:  # a bad value in the environment
        print(f"delay-gateway {named}: error: {exc}", file=sys.stderr)
        return 2
    except SystemExit as exc:  # --help (0), or a bad flag or value, already said in one line (2)
        return int(exc.code or 0)
    logs.configure(getattr(args, "log_level", "info"), getattr(args, "log_format", "auto"))
    command = COMMANDS[args.command]
    try:
        return load(command.run)(settings_from(args), **own_arguments(args))
    except UsageError as exc:
        logs.last_line(f"delay-gateway {args.command}: error: {exc}")
        return 2
    except BrokenPipeError:  # `... | head` stopped reading: what it read is what was wanted
        # Python flushes stdout once more at exit; point it at nothing so that flush cannot fail.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except Exception as exc:
        code = refused(exc)
        if code is None:
            raise
        verb = named if named and named.split()[0] == args.command else args.command  # (`pending list`)
        logs.last_line(f"delay-gateway {verb}: {exc}")
        return code


def own_arguments(args: argparse.Namespace) -> Dict[str, Any]:
    """A command's own arguments (and its verb), handed beside the Settings built once."""
    return {k: v for k, v in vars(args).items() if k != "command" and k not in BY_NAME}


def refused(exc: Exception) -> Optional[int]:
    """The exit code of a topology conflict or a broker's refusal (said in one line), if it is one."""
    from topology.broker.declare import TopologyConflict
    if isinstance(exc, TopologyConflict):
        return EXIT_REFUSED
    if isinstance(exc, ExitCodeError):
        return exc.exit_code
    return None


BROKER = ("broker", "log")
# Commands that only publish to check-in or read from pick-up: of the chain, only the prefix matters.
BROKER_AND_PREFIX = tuple(o.name for o in OPTIONS if o.group in BROKER) + ("prefix",)
COMMANDS = {
    "run": Command("run the consumers (check-in, distributor, or both) until SIGTERM",
                   BROKER + ("chain", "run", "lead", "retire", "cancel", "retry"), "gateway.commands.run:main"),
    "declare": Command("declare the topology (idempotent)", BROKER + ("chain", "cancel", "management"),
                       "gateway.commands.declare:main"),
    "delete": Command("delete the topology and every message it holds", BROKER + ("chain",),
                      "gateway.commands.delete:main", "gateway.commands.delete:add_arguments"),
    "render": Command("print the topology as code (a definitions document, a Terraform module) for your "
                      "infrastructure's own tools", ("chain", "cancel", "log"), "gateway.commands.render:main",
                      "gateway.commands.render:add_arguments"),
    "status": Command("show how many messages wait where, and when they fall due (plain AMQP, any number "
                      "of messages)", BROKER + ("chain", "lead", "cancel", "management"),
                      "gateway.commands.status.watch:main",
                      "gateway.commands.status.watch:add_arguments"),
    "migrate": Command("retire chains of other settings that no gateway uses, once they are empty "
                       "(`run` does this by itself unless --no-retire)", BROKER + ("chain", "retire"),
                       "gateway.commands.migrate:main", "gateway.commands.migrate:add_arguments"),
    "publish": Command("publish delayed messages to check-in, with confirms", BROKER + ("chain",),
                       "gateway.commands.publish:main", "gateway.commands.publish:add_arguments"),
    "explain": Command("show the route a delay takes through the chain", ("chain", "lead", "log"),
                       "gateway.commands.explain:main", "gateway.commands.explain:add_arguments"),
    "cancel": Command("cancel scheduled messages by message id (docs/cancelling.md)", BROKER + ("chain", "cancel"),
                      "gateway.commands.cancel:main", "gateway.commands.cancel:add_arguments"),
    "parked": Command("list parked messages, or replay them once their cause is fixed", BROKER + ("chain",),
                      "gateway.commands.parked:main", actions="gateway.commands.parked:ACTIONS"),
    "pending": Command("list, count, cancel or export the messages that wait, by id, routing key, due time or "
                       "header (docs/operating.md: Seeing what waits)", BROKER + ("chain", "cancel"),
                       "gateway.commands.pending:main", actions="gateway.commands.pending:ACTIONS"),
    "selftest": Command("publish one delayed message through the running gateway and wait for it at pick-up",
                        BROKER + ("chain",), "gateway.commands.selftest:main",
                        "gateway.commands.selftest:add_arguments"),
    "move-from-plugin": Command("move the delayed-message plugin's waiting messages into the gateway, due "
                                "times kept (docs/migrating-from-the-plugin.md)", BROKER + ("chain",),
                                "gateway.commands.move:main", "gateway.commands.move:add_arguments",
                                BROKER_AND_PREFIX),
    "move": Command("move every message that waits to another cluster's gateway, due times and cancels kept "
                    "(docs/upgrading.md: a new cluster)", BROKER + ("chain", "lead", "cancel"),
                    "gateway.commands.move_to:main", "gateway.commands.move_to:add_arguments"),
    "demo": Command("start the gateway, publish a few delayed messages and watch them arrive",
                    BROKER + ("chain",), "gateway.commands.demo:main", "gateway.commands.demo:add_arguments"),
    # The Spark commands' modules import PySpark (an optional extra) only when a job runs.
    "schedule": Command("publish every row of a table (CSV, JSON lines, Parquet) as a delayed message, on Spark",
                        BROKER + ("chain",), "gateway.spark.schedule:run", "gateway.spark.schedule:add_arguments",
                        BROKER_AND_PREFIX),
    "cancel-table": Command("cancel the message of every id in a table (CSV, JSON lines, Parquet), on Spark: "
                            "the counterpart of schedule", BROKER + ("chain",), "gateway.spark.cancel:run",
                            "gateway.spark.cancel:add_arguments"),
    "record": Command("record deliveries at pick-up as JSON lines (for `report`)", BROKER + ("chain",),
                      "gateway.spark.record:run", "gateway.spark.record:add_arguments", BROKER_AND_PREFIX),
    "report": Command("delivery analytics from `record`'s output, on Spark: lateness, duplicates, throughput",
                      ("log",), "gateway.spark.report:run", "gateway.spark.report:add_arguments"),
    "example-orders": Command("write an example orders table to try `schedule` with (review reminders)",
                              ("log",), "gateway.spark.example:run", "gateway.spark.example:add_arguments"),
}
