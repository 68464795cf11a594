"""What a run cost: the CPU time of the broker and the gateway processes (psutil), how often
the gateway's event loop woke, and the broker's own write counters, between a start and a stop."""

import time
from typing import Dict, Optional

from .broker import cpu_seconds, delta, system_seconds
from .context import Context
from .stats import per_message


def psutil_process(pid: int):
    """The psutil view of a process, or None without psutil (then no CPU figures)."""
    try:
        import psutil
    except ImportError:  # the bench dependency group is not installed: no CPU figures
        return None
    return psutil.Process(pid)


def wakeups(process) -> Optional[int]:
    """How often the process's main thread (the gateway's event loop) went to sleep and woke:
    its voluntary context switches (/proc/PID/status counts the main thread's)."""
    if process is None:
        return None
    try:
        return int(process.num_ctx_switches().voluntary)
    except Exception:  # gone, or no such figure on this system
        return None


def psutil_processes(ctx: Context, system) -> Dict[str, object]:
    """The broker's process and each gateway process of `system`, by name: broker, gateway0, ..."""
    procs: Dict[str, object] = {"broker": ctx.broker.process()}
    for i, p in enumerate(system.processes):
        procs[f"gateway{i}"] = psutil_process(p.proc.pid)
    return procs


class Costs:
    """CPU time of the broker and the gateway processes, and the broker's write counters,
    between `start()` and `stop()`."""

    def __init__(self, ctx: Context, procs: Dict[str, object]) -> None:
        self.ctx, self.procs = ctx, procs

    def start(self) -> None:
        idle_s = self.ctx.idle_s
        self.counters0 = self.ctx.broker.counters()
        # What the idle broker burns (quorum queue ticks, timers), measured after the
        # rabbitmqctl call settled: part of every per-message CPU figure below.
        b0 = cpu_seconds(self.procs.get("broker"))
        time.sleep(idle_s)
        b1 = cpu_seconds(self.procs.get("broker"))
        self.idle_pct = round((b1 - b0) * 100 / idle_s, 1) if b0 is not None and b1 is not None else None
        self.cpu0 = {k: cpu_seconds(p) for k, p in self.procs.items()}
        self.wakeups0 = {k: wakeups(p) for k, p in self.procs.items() if k.startswith("gateway")}
        self.system0 = {k: system_seconds(p) for k, p in self.procs.items() if k.startswith("gateway")}
        self.t0 = time.monotonic()

    def stop(self) -> None:
        self.seconds = time.monotonic() - self.t0
        self.cpu1 = {k: cpu_seconds(p) for k, p in self.procs.items()}
        self.wakeups1 = {k: wakeups(p) for k, p in self.procs.items() if k.startswith("gateway")}
        self.system1 = {k: system_seconds(p) for k, p in self.procs.items() if k.startswith("gateway")}
        self.counters1 = self.ctx.broker.counters()

    def gateway_system_share(self) -> Optional[float]:
        """The kernel's share of the gateway processes' CPU time."""
        spent = [self.system1[k] - self.system0[k] for k in self.system0
                 if self.system0[k] is not None and self.system1.get(k) is not None]
        total = self.cpu("gateway")
        return round(sum(spent) / total, 2) if spent and total else None

    def gateway_wakeups(self) -> Optional[int]:
        spent = [self.wakeups1[k] - self.wakeups0[k] for k in self.wakeups0
                 if self.wakeups0[k] is not None and self.wakeups1.get(k) is not None]
        return sum(spent) if spent else None

    def cpu(self, prefix: str) -> Optional[float]:
        spent = [self.cpu1[k] - self.cpu0[k] for k in self.procs
                 if k.startswith(prefix) and self.cpu0.get(k) is not None and self.cpu1.get(k) is not None]
        return sum(spent) if spent else None

    def figures(self, messages: int) -> dict:
        d = delta(self.counters1, self.counters0)
        broker_cpu, gateway_cpu = self.cpu("broker"), self.cpu("gateway")
        out = {"window_seconds": round(self.seconds, 2), "broker_idle_cpu_pct": self.idle_pct,
               "broker_cpu_seconds": None if broker_cpu is None else round(broker_cpu, 2),
               "broker_cpu_us_per_message": per_message(broker_cpu, messages, 1e6, 1),
               "gateway_cpu_seconds": None if gateway_cpu is None else round(gateway_cpu, 2),
               "gateway_cpu_us_per_message": per_message(gateway_cpu, messages, 1e6, 1),
               "gateway_wakeups_per_message": per_message(self.gateway_wakeups(), messages, digits=2),
               "gateway_cpu_system_share": self.gateway_system_share(),
               "gateway_cpu_pct": None if gateway_cpu is None else round(gateway_cpu * 100 / self.seconds, 2),
               "broker_counters": d}
        if d:
            out["queue_writes_per_message"] = per_message(d.get("routed", 0) + d.get("dead_lettered", 0), messages)
            if "wal_writes" in d:
                out["wal_writes_per_message"] = per_message(d["wal_writes"], messages)
                out["wal_batches_per_message"] = per_message(d["wal_batches"], messages, digits=3)
            if "mnesia_log_writes" in d:
                out["mnesia_log_writes_per_message"] = per_message(d["mnesia_log_writes"], messages)
        return out
