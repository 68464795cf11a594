"""Once a second during a run: CPU % and RSS of the broker and each gateway process, the
machine's load average, and how many messages the gateway's check-in has forwarded."""

import os
import threading
import time
from typing import Callable, Dict, List, Optional


class Sampler(threading.Thread):
    def __init__(self, processes: Dict[str, object], checked_in: Optional[Callable[[], float]] = None,
                 interval: float = 1.0) -> None:
        super().__init__(daemon=True)
        self.procs = {name: p for name, p in processes.items() if p is not None}
        self.checked_in = checked_in
        self.interval = interval
        self.series: List[dict] = []
        self._halt = threading.Event()
        self.t0 = time.monotonic()

    def run(self) -> None:
        for p in self.procs.values():
            try:
                p.cpu_percent(None)
            except Exception:  # the process is gone
                pass
        while not self._halt.wait(self.interval):
            self.sample()

    def sample(self) -> dict:
        row: dict = {"t": round(time.monotonic() - self.t0, 2), "load1": os.getloadavg()[0]}
        for name, p in self.procs.items():
            try:
                row[f"{name}_cpu"] = p.cpu_percent(None)
                row[f"{name}_rss_mb"] = round(p.memory_info().rss / 2**20, 1)
            except Exception:  # the process is gone
                pass
        if self.checked_in is not None:
            row["checked_in"] = self.checked_in()
        self.series.append(row)
        return row

    def stop(self) -> List[dict]:
        self._halt.set()
        self.join(5)
        return self.series

    def summary(self) -> dict:
        out: dict = {}
        for name in self.procs:
            cpu = [r[f"{name}_cpu"] for r in self.series if f"{name}_cpu" in r]
            rss = [r[f"{name}_rss_mb"] for r in self.series if f"{name}_rss_mb" in r]
            if rss:
                out[name] = {"rss_mb_start": rss[0], "rss_mb_max": max(rss), "rss_mb_end": rss[-1],
                             "cpu_pct_mean": round(sum(cpu) / len(cpu), 1), "cpu_pct_max": max(cpu)}
        loads = [r["load1"] for r in self.series]
        if loads:
            out["load_average"] = {"mean": round(sum(loads) / len(loads), 2), "max": round(max(loads), 2)}
        return out
