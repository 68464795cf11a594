"""`python -m bench SCENARIO...`: options, checks, and the run of the chosen scenarios."""

import argparse
import datetime
import os
import platform
import shlex
import sys
import time
from typing import List, Optional, Sequence
from urllib.parse import urlsplit

import pika

from . import report
from .broker import Broker, split_command
from .clients import blocking
from .context import Context
from .scenarios import GROUPS, SCENARIOS
from .systems import HEADERS, unique_prefix
from tests.launcher import GatewayProcess

DEFAULT_URL = "amqp://guest:guest@127.0.0.1:5672/%2F"  # the gateway's default (docs/operating.md)
SCENARIO_HELP = (f"{', '.join(SCENARIOS)}; or a group: "
                 + "; ".join(f"{g} ({' '.join(s)})" for g, s in GROUPS.items()))


class Parser(argparse.ArgumentParser):
    """Errors are one line and exit 2 (argparse would print the usage first)."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message}\n")


def _positive(kind):
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if value <= 0:
            raise argparse.ArgumentTypeError(f"{text!r} must be above 0")
        return value
    parse.__name__ = kind.__name__
    return parse


def _choices(allowed: Sequence[str]):
    def parse(text: str) -> List[str]:
        values = [x.strip() for x in text.split(",") if x.strip()]
        wrong = [v for v in values if v not in allowed]
        if wrong or not values:
            raise argparse.ArgumentTypeError(f"{text!r}: choose from {', '.join(allowed)} (comma-separated)")
        return values
    parse.__name__ = "list"
    return parse


def _rates(text: str) -> List[int]:
    return [_positive(int)(x) for x in text.split(",") if x.strip()]


def parser(environ) -> argparse.ArgumentParser:
    p = Parser(prog="python -m bench", description=(
        "Measure the delay gateway from the outside, as its users do: publish with x-delay (or "
        "x-deliver-at) and confirms, receive in a separate process, lateness = arrival - (publish "
        "time + delay) on one clock. With --compare-plugin, the same loads through the "
        "rabbitmq-delayed-message-exchange plugin, alternating; with --compare-kombu, through Celery's "
        "native delayed delivery (kombu's chain)."))
    p.add_argument("scenarios", nargs="+", metavar="SCENARIO", help=SCENARIO_HELP)
    p.add_argument("--url", default=environ.get("DELAY_GATEWAY_URL", DEFAULT_URL),
                   help="AMQP URL of the broker under test (first of a comma-separated list) [DELAY_GATEWAY_URL]")
    p.add_argument("--rabbitmqctl", default="rabbitmqctl",
                   help="the command that reaches that broker's node, for its write counters and memory "
                        "(e.g. 'rabbitmqctl -n bench@localhost'); 'none' to go without")
    p.add_argument("--out", default="bench-results", help="output directory (JSON, markdown, PNG)")
    p.add_argument("--compare-plugin", action="store_true",
                   help="also run each load through the delayed-message-exchange plugin, alternating with "
                        "the gateway (where the broker has it; otherwise says so and measures the gateway)")
    p.add_argument("--compare-kombu", action="store_true",
                   help="also run each load through Celery 5.5+'s native delayed delivery, declared with kombu's "
                        "own function (28 quorum levels of whole seconds; delays rounded up), alternating")
    p.add_argument("--rounds", type=_positive(int), default=1, help="alternating rounds of every target")
    p.add_argument("--headers", type=_choices(HEADERS), default=list(HEADERS),
                   help="the gateway's delay headers to measure, comma-separated (default both)")
    p.add_argument("--queue-types", type=_choices(("quorum", "classic")), default=["quorum"])
    p.add_argument("--zero-bits", type=_choices(("queue", "exchange")), default=["queue"])
    p.add_argument("--messages", type=_positive(int), help="messages per run (overrides each scenario's size)")
    p.add_argument("--rate", type=_positive(float), help="paced: msg/s (default 1000)")
    p.add_argument("--rates", type=_rates, default=[1000, 2000, 4000, 6000, 8000], help="steady ladder, msg/s")
    p.add_argument("--duration", type=_positive(float), default=20.0, help="steady: seconds of publishing per step")
    p.add_argument("--min-delay", type=_positive(int), metavar="MS", help="override the scenario's shortest delay")
    p.add_argument("--max-delay", type=_positive(int), metavar="MS", help="override the scenario's longest delay")
    p.add_argument("--at-once-ms", type=_positive(int), default=60_000,
                   help="at-once: the common due time, this long after publishing starts (default 60000)")
    p.add_argument("--size", type=_positive(int), default=1024, help="message body bytes")
    p.add_argument("--max-level", type=_positive(int), default=20)
    p.add_argument("--resolution-ms", type=_positive(int), default=1000)
    p.add_argument("--gateway-args", default="", help="extra options for every `run` process, quoted")
    p.add_argument("--gateway-python", metavar="PYTHON",
                   help="run every gateway process with this interpreter (e.g. pypy3, with the gateway's "
                        "dependencies), from this clone; default: the benchmark's own")
    p.add_argument("--replicas", type=_positive(int), default=1,
                   help="gateway processes side by side (of each role with --split-roles), competing for its queues")
    p.add_argument("--profile", action="store_true",
                   help="roles: sample each role with py-spy while it drains, and give each step's CPU time per "
                        "message (py-spy slows it a little: its rate is then not its own)")
    p.add_argument("--split-roles", action="store_true",
                   help="run check-in and distributor as two processes (default: one `run`, both roles)")
    p.add_argument("--receiver-queue-type", choices=("quorum", "classic"), default="quorum",
                   help="the type of the receiving user's durable queue (default quorum)")
    p.add_argument("--ceiling-rates", type=_rates, default=[1000, 2000, 3000, 4500, 6000],
                   help="ceiling: the rising paced rates, msg/s (default 1000,2000,3000,4500,6000)")
    p.add_argument("--ceiling-seconds", type=_positive(float), default=10.0,
                   help="ceiling: seconds of publishing at each rate (default 10)")
    p.add_argument("--idle-window", type=_positive(float), default=60.0,
                   help="idle: seconds over which the idle gateway's CPU is measured (default 60)")
    p.add_argument("--vhosts-count", type=_positive(int), default=100,
                   help="vhosts: how many virtual hosts one gateway serves (default 100)")
    p.add_argument("--footprint-prefixes", type=_positive(int), default=5,
                   help="footprint: how many prefixes to declare and measure the broker with (default 5)")
    p.add_argument("--idle-seconds", type=_positive(float), default=2.0,
                   help="how long to measure the idle broker's CPU before each run (default 2)")
    p.add_argument("--max-in-memory-length", type=int,
                   help="pending: apply this quorum max-in-memory-length as a policy on the bench chain")
    p.add_argument("--compare-index", action="store_true",
                   help="also run each gateway load with the index of what waits off (--no-pending-index), "
                        "alternating: what keeping it costs")
    p.add_argument("--flow-seconds", type=_positive(float), default=3600.0,
                   help="waiting, soak: how long the paced flow (--rate) lasts (default 3600)")
    p.add_argument("--window-seconds", type=_positive(float), default=300.0,
                   help="soak: how long each interpreter's gateway is fed before the other's (default 300)")
    p.add_argument("--holding-sizes", type=_rates, default=[1024, 10240],
                   help="holding: the body sizes, bytes, comma-separated (default 1024,10240)")
    p.add_argument("--outage-seconds", type=_positive(float), default=60.0,
                   help="catch-up: how long the distributors are down while --messages (20,000) fall due "
                        "(default 60)")
    p.add_argument("--catch-up-rate", type=_positive(float), default=2000.0,
                   help="catch-up: the gateway's --catch-up-rate, measured beside a release at once (default 2000)")
    p.add_argument("--to-url", help="move: the new cluster's URL (the old one is --url)")
    p.add_argument("--wait-seconds", type=_positive(float), default=600.0,
                   help="move: when the far messages start falling due, from the first publish (default 600): "
                        "after the move ends")
    p.add_argument("--spread-seconds", type=_positive(float), default=900.0,
                   help="move: over how long the far messages fall due (default 900)")
    p.add_argument("--check-every", type=_positive(float), default=300.0,
                   help="waiting: time `pending count` and `pending list` this often during the flow (default 300)")
    return p


def machine() -> str:
    try:
        import psutil
        ram = f"{psutil.virtual_memory().total / 2**30:.0f} GiB"
    except ImportError:
        ram = "?"
    cpu = "?"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return (f"{os.cpu_count()} cpus ({cpu}), {ram} RAM, {platform.system()} {platform.release()}, "
            f"Python {platform.python_version()}, pika {pika.__version__}")


def busiest_processes(count: int = 6, over_s: float = 1.0) -> List[str]:
    """What else the machine is running: the processes that used most CPU over `over_s`."""
    try:
        import psutil
    except ImportError:
        return []
    procs = list(psutil.process_iter(["pid", "cmdline", "name"]))
    for p in procs:
        try:
            p.cpu_percent(None)
        except psutil.Error:
            pass
    time.sleep(over_s)
    seen = []
    for p in procs:
        try:
            seen.append((p.cpu_percent(None), " ".join(p.info["cmdline"] or [p.info["name"] or "?"])))
        except psutil.Error:
            pass
    seen.sort(key=lambda x: -x[0])
    return [f"{cpu:5.1f}% {cmd[:150]}" for cpu, cmd in seen[:count]]


def _kombu_version() -> str:
    import kombu
    return f"compared (kombu {kombu.__version__})"


def expand(names: Sequence[str]) -> List[str]:
    out: List[str] = []
    for name in names:
        for s in GROUPS.get(name, [name]):
            if s not in SCENARIOS:
                raise ValueError(f"unknown scenario {s!r}: choose from {SCENARIO_HELP}")
            if s not in out:
                out.append(s)
    return out


def main(argv: Optional[Sequence[str]] = None, environ=None) -> int:
    environ = os.environ if environ is None else environ
    try:
        args = parser(environ).parse_args(argv)
    except SystemExit as exc:
        return int(exc.code or 0)
    try:
        names = expand(args.scenarios)
        gateway_args = shlex.split(args.gateway_args)
    except ValueError as exc:
        print(f"python -m bench: error: {exc}", file=sys.stderr)
        return 2
    if args.compare_kombu:
        try:
            import kombu.transport.native_delayed_delivery  # noqa: F401
        except ImportError:
            print("python -m bench: --compare-kombu needs kombu 5.5 or later (scripts/bootstrap test installs it)",
                  file=sys.stderr)
            return 2
    if args.gateway_python:
        GatewayProcess.python = args.gateway_python
    url = args.url.split(",")[0]
    where = f"{urlsplit(url).hostname}:{urlsplit(url).port or 5672}"
    log = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    broker = Broker(url, split_command(args.rabbitmqctl))
    try:
        blocking(url, "delay-gateway bench probe").close()
        plugin = broker.has_plugin(unique_prefix("probe")) if args.compare_plugin else False
    except pika.exceptions.AMQPError as exc:
        print(f"python -m bench: no broker at {where} ({exc.__class__.__name__}: {exc}); "
              "start one (scripts/ensure-rabbitmq) or give --url", file=sys.stderr)
        return 1
    if args.compare_plugin and not plugin:
        print(f"python -m bench: --compare-plugin: the broker at {where} has no rabbitmq_delayed_message_exchange "
              "plugin (it refuses the exchange type x-delayed-message); measuring the gateway only",
              file=sys.stderr)
    os.makedirs(args.out, exist_ok=True)
    ctx = Context(url=url, out_dir=args.out, broker=broker, messages=args.messages, rounds=args.rounds,
                  plugin=plugin, kombu=args.compare_kombu, headers=args.headers, queue_types=args.queue_types,
                  zero_bits=args.zero_bits,
                  rate=args.rate, rates=args.rates, duration_s=args.duration, min_delay_ms=args.min_delay,
                  max_delay_ms=args.max_delay, at_once_ms=args.at_once_ms, size=args.size,
                  gateway_args=gateway_args, split_roles=args.split_roles, replicas=args.replicas,
                  receiver_queue_type=args.receiver_queue_type, max_level=args.max_level,
                  resolution_ms=args.resolution_ms, idle_s=args.idle_seconds,
                  max_in_memory_length=args.max_in_memory_length, index_off=args.compare_index, log=log,
                  extra={"flow_seconds": args.flow_seconds, "check_every": args.check_every,
                         "window_seconds": args.window_seconds, "gateway_python": args.gateway_python,
                         "ceiling_rates": args.ceiling_rates, "ceiling_seconds": args.ceiling_seconds,
                         "idle_window": args.idle_window, "holding_sizes": args.holding_sizes,
                         "footprint_prefixes": args.footprint_prefixes, "vhosts_count": args.vhosts_count,
                         "profile": args.profile, "outage_seconds": args.outage_seconds,
                         "catch_up_rate": args.catch_up_rate, "to_url": args.to_url,
                         "wait_seconds": args.wait_seconds, "spread_seconds": args.spread_seconds})
    meta = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "machine": machine(), "rabbitmq": broker.version(), "url": where,
            "command": "python -m bench " + shlex.join(sys.argv[1:] if argv is None else argv),
            "plugin": "compared" if plugin else ("absent" if args.compare_plugin else "not asked"),
            "kombu": _kombu_version() if args.compare_kombu else "not asked",
            "receiver_queue_type": args.receiver_queue_type,
            "counters": "rabbitmqctl eval (node-wide)" if broker.rabbitmqctl else "none",
            "load_average_start": os.getloadavg(), "busiest_processes_start": busiest_processes()}
    results: dict = {}
    for name in names:
        log(f"scenario {name}")
        results[name] = SCENARIOS[name](ctx)
        report.write(args.out, results, dict(meta, load_average_end=os.getloadavg()))
    meta.update(load_average_end=os.getloadavg(), busiest_processes_end=busiest_processes())
    files = report.write(args.out, results, meta)
    print(report.markdown(results, meta))
    log("wrote " + ", ".join(files))
    return 0
