"""Options and entry point of `python -m bench`."""

import argparse
import datetime
import os
import platform
import shlex
import subprocess
import sys

SCENARIO_HELP = ("burst, steady, accuracy, at-once, pending, ceiling, naive, roles; or 'all' "
                 "(everything but pending)")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", default=os.environ.get("DELAY_GATEWAY_URL", "amqp://guest:guest@127.0.0.1:5672/%2F"),
                   help="AMQP URL of the broker under test [DELAY_GATEWAY_URL]")
    p.add_argument("scenarios", nargs="+", metavar="SCENARIO", help=SCENARIO_HELP)
    p.add_argument("--out", default="bench-results", help="output directory (JSON, markdown, PNG)")
    p.add_argument("--messages", type=int, help="messages per run (overrides each scenario's size)")
    p.add_argument("--duration", type=float, default=20.0, help="seconds of publishing per steady step")
    p.add_argument("--rates", default="1000,2000,4000,6000,8000", help="steady ladder, msg/s")
    p.add_argument("--queue-types", default="quorum,classic")
    p.add_argument("--zero-bits", default="queue,exchange")
    p.add_argument("--min-delay", type=int, metavar="MS", help="override the scenario's shortest delay")
    p.add_argument("--max-delay", type=int, metavar="MS", help="override the scenario's longest delay")
    p.add_argument("--size", type=int, default=1024, help="message body bytes")
    p.add_argument("--max-level", type=int, default=20)
    p.add_argument("--resolution-ms", type=int, default=1000)
    p.add_argument("--gateway-args", default="", help="extra options for both `run` processes, quoted")
    p.add_argument("--rabbitmqctl", default="rabbitmqctl", help="rabbitmqctl command (e.g. 'rabbitmqctl -n bench@host')")
    p.add_argument("--max-in-memory-length", type=int,
                   help="pending: apply this quorum max-in-memory-length as a policy on the bench chain")


def _split(s: str):
    return [x.strip() for x in s.split(",") if x.strip()]


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
    return f"{os.cpu_count()} cpus ({cpu}), {ram} RAM, {platform.system()} {platform.release()}, Python {platform.python_version()}"


def run(args) -> int:
    from . import report
    from .scenarios import SCENARIOS, Context

    names = []
    for s in args.scenarios:
        names += [n for n in SCENARIOS if n != "pending"] if s == "all" else [s]
    unknown = [n for n in names if n not in SCENARIOS]
    if unknown:
        raise ValueError(f"unknown scenario(s) {', '.join(unknown)}: choose from {SCENARIO_HELP}")
    os.makedirs(args.out, exist_ok=True)
    url = args.url.split(",")[0]
    ctx = Context(url=url, out_dir=args.out, messages=args.messages, duration_s=args.duration,
                  rates=[int(r) for r in _split(args.rates)], queue_types=_split(args.queue_types),
                  zero_bits=_split(args.zero_bits), size=args.size, gateway_args=shlex.split(args.gateway_args),
                  max_level=args.max_level, resolution_ms=args.resolution_ms, min_delay_ms=args.min_delay,
                  max_delay_ms=args.max_delay, rabbitmqctl=shlex.split(args.rabbitmqctl),
                  max_in_memory_length=args.max_in_memory_length,
                  log=lambda m: print(m, file=sys.stderr, flush=True))
    try:
        version = subprocess.run([*ctx.rabbitmqctl, "version"], capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        version = "?"
    meta = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "machine": machine(), "rabbitmq": version, "command": "python -m bench " + shlex.join(sys.argv[1:]),
            "load_average_start": os.getloadavg()}
    results = {}
    for name in names:
        ctx.log(f"scenario {name}")
        results[name] = SCENARIOS[name](ctx)
        report.write(args.out, results, dict(meta, load_average_end=os.getloadavg()))
    files = report.write(args.out, results, dict(meta, load_average_end=os.getloadavg()))
    print(report.markdown(results, meta))
    ctx.log("wrote " + ", ".join(files))
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench", description="Measure the delay gateway from the outside")
    add_arguments(p)
    return run(p.parse_args(argv))
