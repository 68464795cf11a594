"""A gateway that runs all day, under two interpreters: warm-up and cost window by window.

A short run measures an interpreter that is still warming up (PyPy compiles what it runs
often as it goes). `soak` keeps one gateway process per interpreter running for the whole
flow, each on its own chain: the benchmark's own Python and, when given, `--gateway-python`.
One paced publisher feeds them in turn, a window at a time (`--window-seconds`), so each
sees the full rate in its windows and both see the same machine across the run. Per
window: what the fed gateway's process spent per message (its CPU over its window and, with
two, the quiet one after it, where the releases of its last messages and its idle work
fall), the broker's, each process's RSS, and the lateness of what was published in it.
"""

import random
import subprocess
import sys
import threading
import time
from typing import List, Optional

import pika

from .broker import cpu_seconds
from .clients import Publisher, Receiver, body, declare_receiver_queue, delete_queue, now_ms
from .context import Context
from .costs import psutil_process
from .stats import lateness_stats
from .systems import Gateway


def _rss_mib(process) -> Optional[float]:
    try:
        return round(process.memory_info().rss / 2**20, 1)
    except Exception:  # gone
        return None


def _name(python: str) -> str:
    """"CPython 3.11.7", "PyPy 7.3.19 (3.11.11)": what the interpreter says it is."""
    said = subprocess.run([python, "-c", _WHO], capture_output=True, text=True, timeout=60)
    return said.stdout.strip() or python


_WHO = ("import platform, sys; i = sys.implementation; v = i.version; "
        "print(platform.python_implementation(), platform.python_version() if i.name == 'cpython' else "
        "f'{v.major}.{v.minor}.{v.micro} ({platform.python_version()})')")


def soak(ctx: Context) -> List[dict]:
    rate = ctx.rate or 1000.0
    flow_s = float(ctx.extra.get("flow_seconds", 3600.0))
    window_s = float(ctx.extra.get("window_seconds", 300.0))
    own = sys.executable
    other = ctx.extra.get("gateway_python")
    pythons = [own] + ([str(other)] if other and other != own else [])
    names = [_name(p) for p in pythons]
    lo, hi = ctx.delays(2_000, 10_000)
    systems: List[Gateway] = []
    queues: List[str] = []
    try:
        for k, python in enumerate(pythons):
            systems.append(Gateway(ctx.url, ctx.chain(f"soak{k}", "quorum", "queue"), ctx.gateway_args,
                                   python=python))
            queues.append(f"{systems[-1].prefix}.receiver")
            declare_receiver_queue(ctx.url, queues[-1], ctx.receiver_queue_type, systems[-1].deliver_exchange)
        gateways = [psutil_process(s.processes[0].proc.pid) for s in systems]
        broker = ctx.broker.process()
        n = int(rate * flow_s)
        receivers = [Receiver(ctx.url, q, ctx.out_dir, n) for q in queues]
        rnd = random.Random(21)
        t0 = time.monotonic()
        sent = [0] * len(pythons)

        def fed(at: float) -> int:
            return int((at - t0) // window_s) % len(pythons)

        def make(i: int):
            published = now_ms()
            k = fed(time.monotonic())
            sent[k] += 1
            delay = rnd.randint(lo, hi)
            props = pika.BasicProperties(delivery_mode=2, headers={"x-delay": delay})
            return (systems[k].publish_exchange, "soak", props, body(i, published + delay, ctx.size),
                    published + delay)

        windows: List[dict] = []
        marks: List[dict] = []  # at each window's start: every process's CPU and the counts sent

        def mark() -> None:
            marks.append({"t": time.monotonic() - t0, "wall_ms": now_ms(), "sent": list(sent),
                          "broker": cpu_seconds(broker), "gateways": [cpu_seconds(g) for g in gateways],
                          "rss": [_rss_mib(g) for g in gateways]})

        publisher = Publisher(ctx.url, n, make, rate=rate)
        runner = threading.Thread(target=publisher.run, daemon=True)
        mark()
        runner.start()
        ctx.log(f"  soak: {rate:.0f} msg/s for {flow_s:.0f} s, windows of {window_s:.0f} s, taking turns: "
                + ", ".join(names))
        while runner.is_alive():
            runner.join(max(0.0, window_s - (time.monotonic() - t0) % window_s))
            mark()
            m0, m1 = marks[-2], marks[-1]
            k = fed(t0 + m0["t"] + 1)
            ctx.log(f"    window {len(marks) - 2} ({names[k]}): {m1['sent'][k] - m0['sent'][k]} published; "
                    f"RSS {m1['rss']}")
        deadline = time.monotonic() + hi / 1000 + 30
        while time.monotonic() < deadline and any(r.count.value < sent[k] for k, r in enumerate(receivers)):
            time.sleep(0.2)
        mark()
        data = [r.stop() for r in receivers]
        # A window's cost: the fed gateway's CPU from its start to the next window's end (its
        # messages' releases and one quiet window), over the messages fed in it.
        for w in range(len(marks) - 2):
            m0, m1 = marks[w], marks[w + 1]
            k = fed(t0 + m0["t"] + 1)
            m_end = marks[min(w + len(pythons), len(marks) - 1)]
            count = m1["sent"][k] - m0["sent"][k]
            if m1["t"] - m0["t"] < window_s / 2:
                continue  # the publisher's last few, after the last whole window
            g0, g1 = m0["gateways"][k], m_end["gateways"][k]
            b0, b1 = m0["broker"], m1["broker"]
            # lateness of what was published in the window: due from its start to its end plus
            # the longest delay when turns alternate (the gateway's previous turn fell due long
            # before), to its end alone when one gateway has every window
            d = data[k]
            until = m1["wall_ms"] + (hi if len(pythons) > 1 else 0)
            picked = [i for i, due in enumerate(d["due"]) if m0["wall_ms"] <= due < until]
            stats = lateness_stats({key: [d[key][i] for i in picked] for key in ("id", "due", "recv")}, len(picked))
            windows.append({
                "window": w, "gateway": k, "python": names[k], "start_s": round(m0["t"]), "messages": count,
                "gateway_cpu_us_per_message": (round((g1 - g0) * 1e6 / count) if None not in (g0, g1) else None),
                "broker_cpu_us_per_message": (round((b1 - b0) * 1e6 / count) if None not in (b0, b1) else None),
                "gateway_rss_mib": m1["rss"][k], "p50_ms": stats.get("p50_ms"), "p99_ms": stats.get("p99_ms"),
                "max_ms": stats.get("max_ms"), "early": stats["early"]})
        totals = []
        for k, python in enumerate(pythons):
            stats = lateness_stats(data[k], sent[k])
            totals.append({"python": names[k], "path": python, "published": sent[k], "lost": stats["lost"],
                           "early": stats["early"], "duplicates": stats["duplicates"], "p99_ms": stats.get("p99_ms"),
                           "rss_mib_end": marks[-1]["rss"][k], "errors": systems[k].errors()[:5]})
        for t in totals:
            ctx.log(f"    {t['python']}: {t['published']} published, lost {t['lost']}, early {t['early']}, "
                    f"duplicates {t['duplicates']}, p99 {t['p99_ms']} ms, RSS {t['rss_mib_end']} MiB")
        return [{"scenario": "soak", "label": "soak", "rate": rate, "flow_seconds": flow_s, "window_seconds": window_s,
                 "delay_ms": [lo, hi], "size": ctx.size, "pythons": names, "windows": windows, "totals": totals}]
    finally:
        for s in systems:
            s.close()
        for q in queues:
            delete_queue(ctx.url, q)

