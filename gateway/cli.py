"""The `delay-gateway` command."""

import argparse
import json
import os
import signal
import sys
import threading
import uuid
from typing import Optional, Sequence

import structlog

from topology import Enter, Meditate, build, plan
from topology.declare import TopologyConflict, declare, delete
from topology.definitions import render
from topology.routing import trace

from . import codec, logs, parked, worker
from .amqp import BrokerUnreachable, blocking_channel
from .metrics import Metrics
from .consumer import wall_ms
from .publish import Publisher, parse_headers
from .settings import (add_broker_options, add_chain_options, add_run_options, chain_from,
                       redact, settings_from, tls_from, urls_from)


def parser(environ) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="delay-gateway", description=(
        "Per-message delays for RabbitMQ from TTLs and dead-lettering alone. "
        "Every option also reads an environment variable, shown in brackets."))
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(name: str, help: str, broker: bool = True) -> argparse.ArgumentParser:
        c = sub.add_parser(name, help=help, description=help)
        if broker:
            add_broker_options(c, environ)
        add_chain_options(c, environ)
        return c

    run = command("run", "run the consumers (check-in, distributor, or both)")
    add_run_options(run, environ)

    command("declare", "declare the topology (idempotent)")
    d = command("delete", "delete the topology and every message it holds")
    d.add_argument("--yes", action="store_true", help="really delete")

    defs = command("definitions", "print the topology as definitions JSON for rabbitmqctl import_definitions",
                   broker=False)
    defs.add_argument("--vhost", default="/")

    pub = command("publish", "publish a delayed message to check-in")
    when = pub.add_mutually_exclusive_group()
    when.add_argument("--delay", type=int, metavar="MS", help="delay in ms (header x-delay)")
    when.add_argument("--at", type=int, metavar="EPOCH_MS", help="due time, epoch ms (header x-deliver-at)")
    pub.add_argument("--routing-key", default="", help="the key the message arrives with at pick-up")
    pub.add_argument("--body", default="", help="message body; - reads standard input")
    pub.add_argument("--header", action="append", default=[], metavar="NAME=VALUE",
                     help="extra header (VALUE parsed as JSON when it can be)")
    pub.add_argument("--message-id")
    pub.add_argument("--count", type=int, default=1, help="publish this many copies")

    ex = command("explain", "show the route a delay takes through the chain", broker=False)
    ex.add_argument("delay_ms", type=int, metavar="DELAY_MS")
    ex.add_argument("--lead-ms", type=int, default=50)

    parked.add_options(command("parked", "list parked messages, or replay them into check-in"))

    demo = command("demo", "start the gateway, publish a few delayed messages and watch them arrive")
    demo.add_argument("--delays", default="3000,0,1500,4500,750,2250",
                      help="comma-separated delays in ms")

    bench = sub.add_parser("bench", help="measure lateness, throughput and memory against a real broker",
                           description="Run benchmark scenarios against a real broker (see BENCHMARKS.md).")
    add_broker_options(bench, environ)
    from .bench.cli import add_arguments
    add_arguments(bench)
    return p


def main(argv: Optional[Sequence[str]] = None, environ=None) -> int:
    environ = os.environ if environ is None else environ
    args = parser(environ).parse_args(argv)
    codec.install()
    logs.configure(getattr(args, "log_level", "info"), getattr(args, "log_format", "auto"))
    log = structlog.get_logger("gateway")
    try:
        return COMMANDS[args.command](args)
    except (ValueError, TopologyConflict, BrokerUnreachable) as exc:
        log.error(f"{args.command} failed", error=str(exc))
        print(f"delay-gateway {args.command}: {exc}", file=sys.stderr)
        return 2


def cmd_run(args) -> int:
    settings = settings_from(args)
    metrics = Metrics()
    if settings.metrics_port:
        metrics.serve(settings.metrics_port)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    structlog.get_logger("gateway").info(
        "starting", role=settings.role, brokers=[redact(u) for u in settings.urls],
        prefix=settings.chain.prefix, max_level=settings.chain.max_level,
        resolution_ms=settings.chain.resolution_ms, queue_type=settings.chain.queue_type,
        zero_bits=settings.chain.zero_bits)
    try:
        return worker.run(settings, stop, metrics)
    except TopologyConflict as exc:
        structlog.get_logger("gateway").error("cannot declare topology", error=str(exc))
        return 2


def cmd_declare(args) -> int:
    topology = build(chain_from(args))
    with blocking_channel(urls_from(args)[0], tls=tls_from(args)) as channel:
        declare(channel, topology)
    print(f"declared {len(topology.exchanges)} exchanges, {len(topology.queues)} queues, "
          f"{len(topology.bindings)} bindings with prefix {topology.settings.prefix!r}")
    return 0


def cmd_delete(args) -> int:
    if not args.yes:
        print("delete removes every queue of the chain and the messages in them; add --yes", file=sys.stderr)
        return 2
    with blocking_channel(urls_from(args)[0], tls=tls_from(args)) as channel:
        delete(channel, build(chain_from(args)))
    print(f"deleted the topology with prefix {args.prefix!r}")
    return 0


def cmd_definitions(args) -> int:
    sys.stdout.write(render(build(chain_from(args)), args.vhost))
    return 0


def cmd_publish(args) -> int:
    body = sys.stdin.buffer.read() if args.body == "-" else args.body.encode()
    chain = chain_from(args)
    headers = parse_headers(args.header)
    with blocking_channel(urls_from(args)[0], "delay-gateway publish", tls_from(args)) as channel:
        publisher = Publisher(channel, chain)
        for i in range(args.count):
            message_id = args.message_id or str(uuid.uuid4())
            publisher.send(body, args.routing_key, delay_ms=args.delay, deliver_at_ms=args.at,
                           headers=headers, message_id=message_id)
            print(json.dumps({"published": message_id, "exchange": chain.names.check_in,
                              "routing_key": args.routing_key, "delay_ms": args.delay,
                              "deliver_at": args.at, "confirmed_at": wall_ms()}))
    return 0


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
        print(f"  {names.meditation:<32} wait {chain.meditation_ms} ms, then check in again")
        remaining -= chain.meditation_ms
        total += chain.meditation_ms
    if isinstance(route, Enter):
        print(f"  publish to {names.level(route.level)} with key {route.key!r}")
        for hop in trace(topology, names.level(route.level), route.key, names.distributor):
            print(f"  {hop.queue:<32} wait {hop.wait_ms} ms")
            total += hop.wait_ms
    print(f"  {names.distributor:<32} hold {args.delay_ms - total} ms, then publish to {names.pick_up}")
    return 0


def cmd_parked(args) -> int:
    return parked.command(args, lambda: blocking_channel(urls_from(args)[0], "delay-gateway parked", tls_from(args)),
                          chain_from(args))


def cmd_demo(args) -> int:
    from .demo import demo
    return demo(args)


def cmd_bench(args) -> int:
    from .bench.cli import run
    return run(args)


COMMANDS = {"run": cmd_run, "declare": cmd_declare, "delete": cmd_delete, "definitions": cmd_definitions,
            "publish": cmd_publish, "explain": cmd_explain, "demo": cmd_demo, "parked": cmd_parked,
            "bench": cmd_bench}
