"""What each step of the gateway's hot loop costs: py-spy's samples of a gateway process
(`--profile`), each sample put in the step of the innermost gateway frame it was in (the
pika calls a step makes count as the step's), and the shares turned into CPU time per message.

py-spy attaches to the process (root, or ptrace allowed) and samples it from outside; it
slows the process a little while it does, so a profiled run's rate is not its own figure."""

import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections import Counter
from typing import Dict, List, Optional, Tuple

RATE_HZ = 200
# The steps, by the module of the innermost gateway frame (first match wins).
STEPS: List[Tuple[str, Tuple[str, ...]]] = [
    ("frames in: read, parse", ("gateway/broker/plumbing/wire_connection.py",
                                "gateway/broker/plumbing/lazy_properties.py", "gateway/core/wire.py")),
    ("frames out: build, write", ("gateway/broker/plumbing/publish_frames.py", "gateway/core/carrier.py")),
    ("index entries", ("gateway/core/index_records.py", "gateway/broker/run/index_streams.py")),
    ("confirms", ("gateway/core/confirms.py", "gateway/broker/tools/window.py")),
    ("decide (core)", ("gateway/core/",)),
    ("shell: consumers, sessions", ("gateway/broker/",)),
    ("other gateway code", ("gateway/",)),
]
POLL = "pika/adapters/select_connection.py"


def step_of(stack: List[str]) -> str:
    """The step of one sampled stack (frames root first, each `function (path:line)`)."""
    for frame in reversed(stack):
        path = frame.rpartition(" (")[2]
        if path.startswith("gateway/"):
            return next(name for name, prefixes in STEPS if path.startswith(prefixes))
    leaf = stack[-1] if stack else ""
    return "waiting (poll)" if f"poll ({POLL}" in leaf else "pika, outside any step"


def shares(raw: str) -> Dict[str, float]:
    """Each step's share of the samples, from py-spy's raw output (one `stack count` a line)."""
    counts: Counter = Counter()
    for line in raw.splitlines():
        stack, _, n = line.rstrip().rpartition(" ")
        if stack and n.isdigit():
            counts[step_of(stack.split(";"))] += int(n)
    total = sum(counts.values())
    return {step: round(n / total, 4) for step, n in counts.most_common()} if total else {}


class Profiler:
    """py-spy recording one process from `start` until `stop` (None where py-spy is missing)."""

    def __init__(self, pid: int) -> None:
        self.pid, self.proc = pid, None
        self.out = os.path.join(tempfile.mkdtemp(prefix="bench-profile-"), "samples.txt")

    @staticmethod
    def available() -> Optional[str]:
        """py-spy on PATH, or beside this interpreter (a venv's bin, not activated)."""
        beside = os.path.join(os.path.dirname(sys.executable), "py-spy")
        return shutil.which("py-spy") or (beside if os.access(beside, os.X_OK) else None)

    def start(self) -> "Profiler":
        spy = self.available()
        if spy:
            self.proc = subprocess.Popen([spy, "record", "--format", "raw", "--rate", str(RATE_HZ), "--nonblocking",
                                          "--output", self.out, "--pid", str(self.pid)],
                                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        return self

    def stop(self) -> Tuple[Dict[str, float], Optional[str]]:
        """(each step's share, or {}; why there is none)."""
        if self.proc is None:
            return {}, "py-spy is not installed (pip install py-spy)"
        self.proc.send_signal(signal.SIGINT)  # py-spy writes what it sampled, and exits
        try:
            _, err = self.proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return {}, "py-spy did not stop"
        try:
            with open(self.out) as f:
                raw = f.read()
        except OSError:
            return {}, f"py-spy wrote nothing: {err.decode(errors='replace').strip()[-200:]}"
        finally:
            shutil.rmtree(os.path.dirname(self.out), ignore_errors=True)
        return shares(raw), None


def per_message(step_shares: Dict[str, float], cpu_us_per_message: Optional[float]) -> Dict[str, float]:
    """Each step's CPU time per message, µs: its share of the samples of the process's own CPU."""
    if not cpu_us_per_message:
        return {}
    busy = {s: v for s, v in step_shares.items() if s != "waiting (poll)"}
    total = sum(busy.values())
    return {s: round(cpu_us_per_message * v / total, 1) for s, v in busy.items()} if total else {}
