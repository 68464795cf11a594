"""The `waiting` scenario: the index of what waits at scale. Millions of messages wait (due in
1 to 400 days, ten tenants of a thousand routing keys each: `t3.orders.42.reminder`), then a
paced flow of short delays passes beside them; before and every few minutes during the flow,
`delay-gateway pending count` and `pending list --key ...` are timed as a user runs them
(their own processes: wall time and peak memory), with the gateway's memory. After the flow,
one tenant's messages (a tenth) are cancelled with one rule (`pending cancel --key 't3.#'`):
how long until the rule is recorded, and a count of them afterwards. At the end, the broker's
memory against its high watermark and the disk the waiting streams take on it."""

import os
import random
import subprocess
import sys
import tempfile
import threading
import time
from typing import Dict, List, Optional

import pika

from topology import ChainSettings

from tests.launcher import ROOT, chain_args

from .clients import Publisher, Receiver, body, declare_receiver_queue, delete_queue, now_ms
from .context import Context
from .costs import psutil_process
from .stats import lateness_stats
from .systems import Gateway

DAY_MS = 86_400_000
KEYS = 1000  # t0.orders.0.reminder ... t9.orders.999.reminder
TENANTS = 10


def waiting(ctx: Context) -> List[dict]:
    n = ctx.n(1_000_000)
    rate = ctx.rate or 1000.0
    flow_s = float(ctx.extra.get("flow_seconds", 3600.0))
    every_s = float(ctx.extra.get("check_every", 300.0))
    chain = ctx.chain("waiting", "quorum", "queue")
    system = Gateway(ctx.url, chain, ctx.gateway_args)
    flow_queue = f"{chain.prefix}.receiver"
    try:
        gateway = psutil_process(system.processes[0].proc.pid)
        rss0 = _rss(gateway)
        rnd = random.Random(11)
        start = now_ms()

        def make(i: int):
            due = start + rnd.randint(DAY_MS, 400 * DAY_MS)
            return (chain.names.check_in, f"t{i % TENANTS}.orders.{i % KEYS}.reminder", pika.BasicProperties(
                delivery_mode=2, message_id=f"w-{i}", headers={"x-deliver-at": due}), body(i, due, ctx.size), due)

        ctx.log(f"  waiting: publishing {n} messages due in 1-400 days")
        pub = Publisher(ctx.url, n, make).run()
        deadline = time.monotonic() + max(1800, n / 1000)
        while system.forwarded(chain.names.check_in) < pub.acked and time.monotonic() < deadline:
            time.sleep(1)
        ctx.log(f"    published {pub.acked} in {pub.seconds:.0f} s; checked in")
        checks = [_check(ctx, chain, gateway, "before the flow", 0.0)]
        declare_receiver_queue(ctx.url, flow_queue, ctx.receiver_queue_type, chain.names.pick_up, "flow.#")
        flow_n = int(rate * flow_s)
        receiver = Receiver(ctx.url, flow_queue, ctx.out_dir, flow_n)
        flow_rnd = random.Random(12)

        def flow_message(i: int):
            published = now_ms()
            delay = flow_rnd.randint(2000, 10_000)
            return (chain.names.check_in, f"flow.{i % 10}", pika.BasicProperties(
                delivery_mode=2, message_id=f"f-{i}", headers={"x-delay": delay}),
                body(i, published + delay, ctx.size), published + delay)

        flow = Publisher(ctx.url, flow_n, flow_message, rate=rate)
        runner = threading.Thread(target=flow.run, daemon=True)
        t0 = time.monotonic()
        runner.start()
        ctx.log(f"    a flow of {rate:.0f} msg/s (2-10 s delays) for {flow_s:.0f} s")
        while runner.is_alive():
            runner.join(max(0.0, every_s - (time.monotonic() - t0) % every_s))
            if runner.is_alive():
                checks.append(_check(ctx, chain, gateway, "during the flow", time.monotonic() - t0))
        receiver.wait(30)
        data = receiver.stop()
        checks.append(_check(ctx, chain, gateway, "after the flow", time.monotonic() - t0))
        cancelled = _cancel_a_tenant(ctx, chain, gateway)
        disk = _streams_disk(ctx, chain)
        memory = ctx.broker.erlang_memory_mb() or {}
        r = {"scenario": "waiting", "messages": n, "size": ctx.size, "publish_rate": round(pub.rate_achieved, 1),
             "flow_rate": rate, "flow_seconds": flow_s, "flow_published": flow.acked,
             "flow": lateness_stats(data, flow.acked), "gateway_rss_mb_start": rss0,
             "checks": checks, "cancel_a_tenant": cancelled, "streams_disk_mb": disk,
             "broker_memory_mb": memory.get("total"), "broker_watermark_mb": ctx.broker.memory_limit_mb()}
        ctx.log(f"    streams on disk: {disk}; broker memory {r['broker_memory_mb']} MB of a watermark of "
                f"{r['broker_watermark_mb']} MB")
        return [r]
    finally:
        system.close()
        delete_queue(ctx.url, flow_queue)


def _rss(process) -> Optional[float]:
    try:
        return round(process.memory_info().rss / 2**20, 1) if process is not None else None
    except Exception:  # (gone)
        return None


# Runs a command as `python -m gateway` does and, at its exit, writes its own peak memory
# (VmHWM: since its exec, unlike ru_maxrss, which counts the benchmark's memory it was forked
# from) to the file the environment names.
_PEAK = ("import atexit, os, runpy, sys\n"
         "def peak():\n"
         "    with open('/proc/self/status') as f, open(os.environ['BENCH_PEAK_FILE'], 'w') as out:\n"
         "        out.write(next(l.split()[1] for l in f if l.startswith('VmHWM:')))\n"
         "atexit.register(peak)\n"
         "sys.argv[0] = 'delay-gateway'\n"
         "runpy.run_module('gateway', run_name='__main__')\n")


def _timed(args: List[str], every_line: bool = False) -> Dict[str, object]:
    """A command as a user runs it: wall time, its own peak memory, its first line (or, with
    `every_line`, the lines after its table: what it says of what it did)."""
    with tempfile.TemporaryFile("w+") as out, tempfile.NamedTemporaryFile("r") as peak:
        t = time.monotonic()
        proc = subprocess.run([sys.executable, "-c", _PEAK, *args], cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                              text=True, env=dict(os.environ, BENCH_PEAK_FILE=peak.name))
        seconds = time.monotonic() - t
        out.seek(0)
        lines = out.read().strip().splitlines()
        kb = peak.read().strip()
    said = " / ".join(line for line in lines if line.startswith(("rule ", "recorded", "removed", "queued"))) \
        if every_line else lines[0] if lines else ""
    return {"seconds": round(seconds, 2), "peak_rss_mb": round(int(kb) / 1024, 1) if kb.isdigit() else None,
            "exit": proc.returncode, "said": said}


def _check(ctx: Context, chain: ChainSettings, gateway, when: str, at_s: float) -> dict:
    base = [*chain_args(chain), "--url", ctx.url]
    count = _timed(["pending", "count", *base])
    listing = _timed(["pending", "list", "--key", "t2.orders.42.#", "--limit", "100", *base])
    found = {"when": when, "at_s": round(at_s), "gateway_rss_mb": _rss(gateway), "count": count, "list": listing}
    ctx.log(f"    {when} ({at_s:.0f} s): count {count['seconds']} s ({count['said']}), list --key "
            f"{listing['seconds']} s ({count['peak_rss_mb']} / {listing['peak_rss_mb']} MB at most); gateway RSS "
            f"{found['gateway_rss_mb']} MB")
    return found


def _cancel_a_tenant(ctx: Context, chain: ChainSettings, gateway) -> dict:
    """One rule for a tenth of what waits: the command's own times (the preview read, then how
    long after its publish a gateway recorded it), and a count of that tenant afterwards."""
    base = [*chain_args(chain), "--url", ctx.url]
    rss = _rss(gateway)
    cancel = _timed(["pending", "cancel", "--key", "t3.#", "--yes", "--wait", "60", *base], every_line=True)
    after = _timed(["pending", "count", "--key", "t3.#", *base])
    found = {"cancel": cancel, "count_after": after, "gateway_rss_mb_before": rss,
             "gateway_rss_mb_after": _rss(gateway)}
    ctx.log(f"    pending cancel --key 't3.#': {cancel['seconds']} s in all; {cancel['said']}; then a count of t3: "
            f"{after['said']} ({after['seconds']} s)")
    return found


def _streams_disk(ctx: Context, chain: ChainSettings) -> Optional[Dict[str, float]]:
    """MB on disk of each waiting stream (the node's stream directory, by queue name)."""
    out = ctx.broker.ctl("eval", "rabbit_mnesia:dir().")
    if not out:
        return None
    root = os.path.join(out.strip().strip('"'), "stream")
    sizes: Dict[str, float] = {}
    try:
        start = "__" + chain.names.waiting.replace(".", "_") + "_"  # (a stream's directory: __<name>_<time>)
        for entry in os.listdir(root):
            if entry.startswith(start):
                total = 0
                for folder, _, files in os.walk(os.path.join(root, entry)):
                    total += sum(os.path.getsize(os.path.join(folder, f)) for f in files)
                sizes[entry[len(start):].rsplit("_", 1)[0]] = round(total / 2**20, 1)
    except OSError:
        return None
    return sizes
