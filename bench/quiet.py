"""The gateway at rest and at low rates: `idle` (nothing waits, nothing arrives: its CPU and
wake-ups) and `trickle` (10 and 100 msg/s side by side: what each pays per wake-up rather
than per message). With `ceiling`, the gateway's CPU from 0 to thousands of messages a second."""

import time
from typing import List

from .broker import cpu_seconds
from .context import Context, gateway_targets, open_system
from .costs import psutil_processes, wakeups
from .delayed import Load, compared
from .systems import DELAY


def idle(ctx: Context) -> List[dict]:
    """A gateway with nothing waiting and nothing arriving: its CPU (% of one core) and its
    event loop's wake-ups per second over `idle_window` seconds (60), after it is ready."""
    window = float(ctx.extra.get("idle_window") or 60.0)  # type: ignore[arg-type]
    out = []
    for target in gateway_targets(ctx, (DELAY,)):
        system = open_system(ctx, target, "idle")
        try:
            proc = psutil_processes(ctx, system)
            gateways = {k: p for k, p in proc.items() if k.startswith("gateway")}
            time.sleep(min(5.0, window))  # (its start-up settles: the first upkeep pass, the follower's catch-up)
            cpu0 = {k: cpu_seconds(p) for k, p in gateways.items()}
            wake0 = {k: wakeups(p) for k, p in gateways.items()}
            rss = [p.memory_info().rss for p in gateways.values() if p is not None]
            t0 = time.monotonic()
            time.sleep(window)
            seconds = time.monotonic() - t0
            cpu = sum(cpu_seconds(p) - cpu0[k] for k, p in gateways.items() if p is not None)
            woke = sum(wakeups(p) - wake0[k] for k, p in gateways.items() if p is not None)
        finally:
            system.close()
        r = {"scenario": "idle", "label": target.label, "seconds": round(seconds, 1),
             "gateway_cpu_pct": round(cpu * 100 / seconds, 2), "gateway_wakeups_per_s": round(woke / seconds, 1),
             "gateway_rss_mib": round(sum(rss) / 2**20, 1) if rss else None}
        ctx.log(f"  idle {target.label}: {r['gateway_cpu_pct']} % of a core, "
                f"{r['gateway_wakeups_per_s']} wake-ups/s")
        out.append(r)
    return out


def trickle(ctx: Context) -> List[dict]:
    """Low paced rates (10 and 100 msg/s, delays 2-10 s, 30 s each), side by side like the
    others: what each pays per wake-up rather than per message (with `idle` and `ceiling`,
    the gateway's CPU from 0 to thousands of messages a second)."""
    out = []
    for rate in (10, 100):
        out += compared(ctx, Load("trickle", ctx.n(rate * 30), ctx.delays(2_000, 10_000), rate=rate),
                        gateway_targets(ctx, (DELAY,)))
    return out
